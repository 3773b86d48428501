"""Hugging Face Text Embeddings Inference's API, with TEI's shapes, status codes and error body
({"error", "error_type"}): what `huggingface_hub.InferenceClient`, LlamaIndex's and
LangChain's TEI integrations speak.

POST / and /embed -> [[float]]; /embed_all -> [[[float]]] (every token's final hidden state,
not normalised unless `normalize` says so); /similarity (and / with `inputs` an object, where
`InferenceClient.sentence_similarity` posts) -> [float]; /predict (and / where the model is a
sequence classifier, where `InferenceClient.text_classification` posts) -> [{score, label}];
/rerank with `texts` -> [{index, score, text?}] (the same path takes the Jina/Cohere v1 shape,
`documents`, told apart by that field); /tokenize; /decode; GET /info. TEI ignores fields it
does not know, and so do these routes. TEI's bodies are bare arrays, so the extensions travel
as headers: x-tokens and x-input-tokens (per text, comma separated: tokens used, and before
truncation) and x-model-fingerprint.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

from ..client import EmbeddingError
from ..contract import MAX_DOCUMENTS, MAX_INPUTS
from . import keys
from .bodies import (
    Body,
    Inputs,
    NonBlank,
    Text,
    TextInputs,
    TokenIds,
    at_most,
    batch,
    described,
    token_ids,
)
from .common import embed, embed_tokens, raw_scores
from .errors import (
    BACKEND,
    EMPTY,
    INVALID,
    METHOD,
    NOT_FOUND,
    OVERLOADED,
    RATE_LIMITED,
    TOO_LARGE,
    UNAUTHORIZED,
    UNAVAILABLE,
    APIError,
    backend_error,
    invalid,
    json_body,
    options_checked,
)
from .openai import rerank_response
from .state import gateway, respond

router = APIRouter(tags=["tei"])

# TEI's ErrorType and the status it answers with (router/src/http/server.rs).
_ERRORS = {
    INVALID: (422, "Validation"),
    EMPTY: (400, "Empty"),
    NOT_FOUND: (424, "Backend"),  # TEI: "model is not a re-ranker model"
    TOO_LARGE: (413, "Validation"),  # TEI: its --payload-limit
    OVERLOADED: (429, "Overloaded"),
    RATE_LIMITED: (429, "Overloaded"),
    UNAVAILABLE: (503, "Unhealthy"),
    BACKEND: (424, "Backend"),
    METHOD: (405, "Validation"),
}
_POOLING = {"last": "last_token", "mean": "mean", "cls": "cls", "attention": "attention"}


def error_response(e: APIError) -> Response:
    if e.kind == UNAUTHORIZED:  # TEI answers a bare 401
        return Response(status_code=401)
    status, error_type = _ERRORS[e.kind]
    return JSONResponse({"error": e.message, "error_type": error_type}, status_code=status)


class TEIBody(Body):
    QUOTE = "`{}`"


def _direction(value: str | None) -> str | None:
    if value is not None and value.lower() not in ("left", "right"):
        raise PydanticCustomError("direction", "must be 'Left' or 'Right'")
    return None if value is None else value.lower()


class Truncation(TEIBody):
    """TEI's `truncate` (null: the server's default, which cuts) and `truncation_direction`
    ("Left"/"Right", either case)."""

    truncate: bool | None = None
    truncation_direction: Annotated[str | None, AfterValidator(_direction)] = None

    def truncation(self) -> dict:
        return self.given("truncate", "truncation_direction")


class EmbedRequest(Truncation):
    """POST / and /embed; /embed_all (whose `normalize` defaults to false)."""

    inputs: Inputs
    normalize: bool | None = None
    prompt_name: str | None = None
    dimensions: int | None = None

    def options(self, normalize: bool, **more) -> dict:
        options = self.truncation() | self.given("prompt_name", "dimensions") | more
        options["normalize"] = normalize if self.normalize is None else self.normalize
        if token_ids(self.inputs):
            options["token_ids"] = True
        return options_checked(**options)


class PredictParameters(TEIBody):
    function_to_apply: Literal["softmax", "sigmoid", "none"] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None


class PredictRequest(Truncation):
    inputs: TextInputs  # pairs are refused: the tokenizer builds single texts
    raw_scores: bool = False
    parameters: PredictParameters | None = None


class SimilarityInputs(TEIBody):
    source_sentence: Text
    sentences: Annotated[list[Text], at_most(MAX_INPUTS - 1)]


class SimilarityParameters(Truncation):
    prompt_name: str | None = None


class SimilarityRequest(TEIBody):
    inputs: SimilarityInputs
    parameters: SimilarityParameters | None = None


class RerankRequest(Truncation):
    query: NonBlank
    texts: Annotated[list[Text], at_most(MAX_DOCUMENTS)]
    raw_scores: bool = False
    return_text: bool = False


class TokenizeRequest(TEIBody):
    inputs: TextInputs
    prompt_name: str | None = None
    add_special_tokens: bool = True


class DecodeRequest(TEIBody):
    ids: Annotated[
        described(TokenIds | list[TokenIds], "must be a list of token ids or a list of such lists"),
        AfterValidator(batch),
    ]
    skip_special_tokens: bool = True


def _int_list(values) -> str:
    return ",".join(str(int(v)) for v in values)


# The token counts TEI's routes answer as headers (a browser's page reads them where exposed:
# app.EXPOSED_HEADERS): the request's, and per text those used and those before truncation.
TOKEN_HEADERS = ("x-compute-tokens", "x-tokens", "x-input-tokens")


@router.post("/")
@router.post("/embed")
async def embed_route(request: Request):
    gw = gateway(request)
    body = await json_body(request)
    if request.url.path == "/" and isinstance(body, dict):
        if isinstance(body.get("inputs"), dict):
            return await _similarity(gw, body)
        if (await gw.facts()).get("labels"):
            return await _predict(gw, body, nested=True)
    asked = EmbedRequest.parse(body)
    result = await embed(gw, asked.inputs, asked.options(normalize=True), ["float"], "inputs")
    headers = {
        "x-compute-tokens": str(result.total_tokens),
        "x-tokens": _int_list(result.token_counts),
        "x-input-tokens": _int_list(result.input_tokens),
    }
    return await respond(gw, result.embeddings, headers)


@router.post("/embed_all")
async def embed_all_route(request: Request):
    gw = gateway(request)
    asked = EmbedRequest.parse(await json_body(request))
    options = asked.options(normalize=False, per_token=True)
    vectors = await embed_tokens(gw, asked.inputs, options, "inputs")
    headers = {"x-tokens": _int_list(len(v) for v in vectors)}
    return await respond(gw, vectors, headers)


@router.post("/predict")
async def predict_route(request: Request):
    return await _predict(gateway(request), await json_body(request), nested=False)


async def _predict(gw, body: object, nested: bool):
    """TEI's /predict for a sequence classifier served as the embed model: `inputs` (a text or
    a list of texts), `raw_scores` (logits), `truncate`, `truncation_direction`; with
    huggingface_hub's `parameters` (`function_to_apply`, `top_k`) as the Inference API takes
    them. Per text, every label with its score, best first; a single text answers a flat list
    unless `nested` (POST /, as the Inference API answers)."""
    asked = PredictRequest.parse(body)
    if not (await gw.facts()).get("labels"):
        raise APIError(NOT_FOUND, "model is not a classifier model")  # TEI's words and status
    parameters = asked.parameters or PredictParameters()
    function = "none" if asked.raw_scores else parameters.function_to_apply or "softmax"
    try:
        result = await gw.client.classify(
            asked.inputs, **options_checked(**asked.truncation()), headers=gw.outgoing()
        )
    except EmbeddingError as e:
        raise backend_error(e, (), "inputs") from e
    logits = result.logits.astype(np.float64)
    if function == "softmax":  # a one-label classifier's sigmoid, as TEI's
        scores = result.probabilities
    else:
        scores = 1 / (1 + np.exp(-logits)) if function == "sigmoid" else logits
    answers = []
    for row in scores:
        pairs = zip(row.tolist(), result.labels, strict=True)
        ranked = sorted(pairs, key=lambda p: -p[0])[: parameters.top_k]
        answers.append([{"score": score, "label": label} for score, label in ranked])
    if isinstance(body["inputs"], str) and not nested:
        answers = answers[0]
    return await respond(gw, answers, {"x-tokens": _int_list(result.token_counts)})


@router.post("/similarity")
async def similarity_route(request: Request):
    return await _similarity(gateway(request), await json_body(request))


async def _similarity(gw, body: object):
    """TEI's sentence similarity: {"inputs": {"source_sentence", "sentences"}, "parameters":
    {prompt_name, truncate, truncation_direction}} -> the cosine of each sentence's vector with
    the source's, all of them from one request."""
    asked = SimilarityRequest.parse(body)
    parameters = asked.parameters or SimilarityParameters()
    options = parameters.truncation() | parameters.given("prompt_name") | {"normalize": True}
    texts = [asked.inputs.source_sentence, *asked.inputs.sentences]

    def sentence(i: int) -> str:
        return "inputs.source_sentence" if i == 0 else f"inputs.sentences[{i - 1}]"

    vectors = (await embed(gw, texts, options_checked(**options), ["float"], sentence)).embeddings
    unit = vectors.astype(np.float64)  # normalised: the dot product is the cosine
    return await respond(gw, (unit[1:] @ unit[0]).tolist())


@router.post("/rerank")
async def rerank_route(request: Request):
    """TEI's shape ({query, texts}) or, without `texts`, the Jina/Cohere v1 one (openai.py)."""
    gw = gateway(request)
    body = await json_body(request)
    if not (isinstance(body, dict) and "texts" in body):
        try:
            return await rerank_response(gw, body)
        except APIError as e:
            raise APIError(e.kind, e.message, e.param, api="openai") from None
    asked = RerankRequest.parse(body)
    if asked.truncation_direction == "left":
        raise invalid(
            "a reranker cuts the end of each text (the query and template stay whole): "
            "`truncation_direction` must be 'Right'",
            "truncation_direction",
        )
    if not gw.rerank_model_name:
        raise APIError(NOT_FOUND, "model is not a re-ranker model")
    query, texts = asked.query, asked.texts
    truncate = True if asked.truncate is None else asked.truncate
    try:
        result = await gw.client.rerank(query, texts, truncate=truncate, headers=gw.outgoing())
    except EmbeddingError as e:
        raise backend_error(e, (), "texts") from e
    ranks = []
    raw = await raw_scores(gw) if asked.raw_scores else float  # raw: the model's logit
    for index, score in result.ranking:
        value = raw(score)
        text = {"text": texts[index]} if asked.return_text else {}
        ranks.append({"index": index, "score": value} | text)
    return ranks


@router.post("/tokenize")
async def tokenize(request: Request):
    gw = gateway(request)
    asked = TokenizeRequest.parse(await json_body(request))
    try:
        options = options_checked(**asked.given("prompt_name"))
        tokens = await gw.client.tokenize(asked.inputs, **options, headers=gw.outgoing())
    except EmbeddingError as e:
        raise backend_error(e, ("prompt_name",), "inputs") from e
    if not asked.add_special_tokens:
        tokens = [[t for t in text if not t["special"]] for text in tokens]
    return tokens


@router.post("/decode")
async def decode(request: Request):
    gw = gateway(request)
    asked = DecodeRequest.parse(await json_body(request))
    try:
        return await gw.client.decode(asked.ids, asked.skip_special_tokens)
    except EmbeddingError as e:
        raise backend_error(e, (), "ids") from e


@router.get("/info")
async def info(request: Request):
    """TEI's Info, from the facts the served models publish. Of TEI's fields, model_sha,
    max_batch_requests, sha and docker_label are null, and max_concurrent_requests and
    tokenization_workers (the gateway sets neither) are left out."""
    gw = gateway(request)
    keys.check_described(request, gw.client.model)
    facts = await gw.facts()
    route = facts.get("route", {})
    return {
        "model_id": gw.model_name,
        "model_sha": None,
        "model_dtype": route.get("dtype"),
        "served_model_name": gw.model_name,
        "model_type": {"embedding": {"pooling": _POOLING.get(route.get("pooling"), "last_token")}},
        "max_input_length": facts.get("tokens_per_text"),
        "max_batch_tokens": facts.get("tokens_per_forward"),
        "max_batch_requests": None,
        "max_client_batch_size": MAX_INPUTS,
        "auto_truncate": True,
        "version": version("qwen-embed-client"),
        "sha": None,
        "docker_label": None,
        # extensions
        "fingerprint": facts.get("fingerprint"),
        "dimension": facts.get("dimension"),
        "prompt_names": facts.get("prompt_names"),
        "rerank_model": gw.rerank_model_name,
    }
