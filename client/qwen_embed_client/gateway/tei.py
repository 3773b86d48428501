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

import math
from importlib.metadata import version

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from ..client import EmbeddingError
from ..contract import MAX_INPUTS
from .common import embed, embed_tokens, rerank_inputs
from .errors import (
    BACKEND,
    EMPTY,
    INVALID,
    NOT_FOUND,
    OVERLOADED,
    UNAUTHORIZED,
    UNAVAILABLE,
    APIError,
    backend_error,
    check_utf8,
    invalid,
    json_body,
    options_checked,
    token_id_lists,
)
from .openai import rerank_response
from .state import gateway, respond

router = APIRouter(tags=["tei"])

# TEI's ErrorType and the status it answers with (router/src/http/server.rs).
_ERRORS = {
    INVALID: (422, "Validation"),
    EMPTY: (400, "Empty"),
    NOT_FOUND: (424, "Backend"),  # TEI: "model is not a re-ranker model"
    OVERLOADED: (429, "Overloaded"),
    UNAVAILABLE: (503, "Unhealthy"),
    BACKEND: (424, "Backend"),
}
_POOLING = {"last": "last_token", "mean": "mean", "cls": "cls"}


def error_response(e: APIError) -> Response:
    if e.kind == UNAUTHORIZED:  # TEI answers a bare 401
        return Response(status_code=401)
    status, error_type = _ERRORS[e.kind]
    return JSONResponse({"error": e.message, "error_type": error_type}, status_code=status)


def _body(value: object) -> dict:
    if not isinstance(value, dict):
        raise invalid("request body must be a JSON object")
    return value


def _inputs(body: dict, name: str = "inputs") -> tuple[list, bool]:
    """`inputs`: a string, a list of strings, token ids or a list of id lists ->
    (items, whether they are token ids)."""
    value = body.get(name)
    if value == []:
        raise APIError(EMPTY, f"`{name}` cannot be empty", name)
    ids = token_id_lists(value, name)
    items = [value] if isinstance(value, str) else value
    if ids is None and not (isinstance(items, list) and all(isinstance(t, str) for t in items)):
        raise invalid(
            f"`{name}` must be a string, a list of strings, token ids or a list of token id "
            "lists (not a mix of texts and ids)",
            name,
        )
    items = ids if ids is not None else items
    if len(items) > MAX_INPUTS:
        raise invalid(f"batch size {len(items)} > maximum allowed batch size {MAX_INPUTS}", name)
    if ids is None:
        check_utf8([(f"{name}[{i}]", t) for i, t in enumerate(items)])
    return items, ids is not None


def _truncation(body: dict) -> dict:
    """TEI's `truncate` (null: the server's default, which cuts) and `truncation_direction`
    ("Left"/"Right", either case)."""
    options = {}
    if body.get("truncate") is not None:
        options["truncate"] = body["truncate"]
    direction = body.get("truncation_direction")
    if direction is not None:
        if not isinstance(direction, str) or direction.lower() not in ("left", "right"):
            raise invalid(
                "`truncation_direction` must be 'Left' or 'Right'", "truncation_direction"
            )
        options["truncation_direction"] = direction.lower()
    return options


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise invalid(f"`{name}` must be a boolean", name)
    return value


def _int_list(values) -> str:
    return ",".join(str(int(v)) for v in values)


@router.post("/")
@router.post("/embed")
async def embed_route(request: Request):
    gw = gateway(request)
    body = _body(await json_body(request))
    if request.url.path == "/" and isinstance(body.get("inputs"), dict):
        return await _similarity(gw, body)
    if request.url.path == "/" and (await gw.facts()).get("labels"):
        return await _predict(gw, body, nested=True)
    items, ids = _inputs(body)
    options = _truncation(body)
    options["normalize"] = _flag(body, "normalize", True)
    for name in ("prompt_name", "dimensions"):
        if body.get(name) is not None:
            options[name] = body[name]
    if ids:
        options["token_ids"] = True
    result = await embed(gw, items, options_checked(**options), ["float"])
    headers = {
        "x-compute-tokens": str(result.total_tokens),
        "x-tokens": _int_list(result.token_counts),
        "x-input-tokens": _int_list(result.input_tokens),
    }
    return await respond(gw, result.embeddings.tolist(), headers)


@router.post("/embed_all")
async def embed_all_route(request: Request):
    gw = gateway(request)
    body = _body(await json_body(request))
    items, ids = _inputs(body)
    options = _truncation(body) | {"normalize": _flag(body, "normalize", False)}
    for name in ("prompt_name", "dimensions"):
        if body.get(name) is not None:
            options[name] = body[name]
    if ids:
        options["token_ids"] = True
    vectors = await embed_tokens(gw, items, options_checked(**options, per_token=True))
    headers = {"x-tokens": _int_list(len(v) for v in vectors)}
    return await respond(gw, [v.tolist() for v in vectors], headers)


@router.post("/predict")
async def predict_route(request: Request):
    return await _predict(gateway(request), _body(await json_body(request)), nested=False)


_SCORES = ("softmax", "sigmoid", "none")


async def _predict(gw, body: dict, nested: bool):
    """TEI's /predict for a sequence classifier served as the embed model: `inputs` (a text or
    a list of texts; pairs are refused: the tokenizer builds single texts), `raw_scores`
    (logits), `truncate`, `truncation_direction`; with huggingface_hub's `parameters`
    (`function_to_apply`, `top_k`) as the Inference API takes them. Per text, every label with
    its score, best first; a single text answers a flat list unless `nested` (POST /, as the
    Inference API answers)."""
    inputs = body.get("inputs")
    if isinstance(inputs, list) and any(isinstance(t, list) for t in inputs):
        raise invalid("`inputs` pairs are not supported: send texts", "inputs")
    items, ids = _inputs(body)
    if ids:
        raise invalid("`inputs` must be texts for /predict", "inputs")
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise invalid("`parameters` must be an object", "parameters")
    function = parameters.get("function_to_apply") or "softmax"
    if _flag(body, "raw_scores", False):
        function = "none"
    if function not in _SCORES:
        raise invalid(f"`function_to_apply` must be one of {list(_SCORES)}", "parameters")
    top_k = parameters.get("top_k")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise invalid("`top_k` must be an integer >= 1", "parameters")
    try:
        result = await gw.client.classify(
            items, **options_checked(**_truncation(body)), headers=gw.outgoing()
        )
    except EmbeddingError as e:
        raise backend_error(e, ()) from e
    logits = result.logits.astype(np.float64)
    if function == "softmax":  # a one-label classifier's sigmoid, as TEI's
        scores = result.probabilities
    else:
        scores = 1 / (1 + np.exp(-logits)) if function == "sigmoid" else logits
    answers = []
    for row in scores:
        pairs = zip(row.tolist(), result.labels, strict=True)
        ranked = sorted(pairs, key=lambda p: -p[0])[:top_k]
        answers.append([{"score": score, "label": label} for score, label in ranked])
    if isinstance(inputs, str) and not nested:
        answers = answers[0]
    return await respond(gw, answers, {"x-tokens": _int_list(result.token_counts)})


@router.post("/similarity")
async def similarity_route(request: Request):
    return await _similarity(gateway(request), _body(await json_body(request)))


async def _similarity(gw, body: dict):
    """TEI's sentence similarity: {"inputs": {"source_sentence", "sentences"}, "parameters":
    {prompt_name, truncate, truncation_direction}} -> the cosine of each sentence's vector with
    the source's, all of them from one request."""
    inputs = body.get("inputs")
    source = inputs.get("source_sentence") if isinstance(inputs, dict) else None
    sentences = inputs.get("sentences") if isinstance(inputs, dict) else None
    if not isinstance(source, str):
        raise invalid("`inputs` must be {source_sentence: string, sentences: [string]}", "inputs")
    if sentences == []:
        raise APIError(EMPTY, "`inputs.sentences` cannot be empty", "inputs")
    if not isinstance(sentences, list) or not all(isinstance(t, str) for t in sentences):
        raise invalid("`inputs.sentences` must be a list of strings", "inputs")
    texts = [source, *sentences]
    if len(texts) > MAX_INPUTS:
        limit = f"batch size {len(texts)} > maximum allowed batch size {MAX_INPUTS}"
        raise invalid(limit, "inputs")
    check_utf8(
        [("inputs.source_sentence", source)]
        + [(f"inputs.sentences[{i}]", t) for i, t in enumerate(sentences)]
    )
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise invalid("`parameters` must be an object", "parameters")
    options = _truncation(parameters) | {"normalize": True}
    if parameters.get("prompt_name") is not None:
        options["prompt_name"] = parameters["prompt_name"]
    vectors = (await embed(gw, texts, options_checked(**options), ["float"])).embeddings
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
    if body["texts"] == []:
        raise APIError(EMPTY, "`texts` cannot be empty", "texts")
    query, texts = rerank_inputs(body, "texts", "`{}`".format)
    truncation = _truncation(body)
    if truncation.get("truncation_direction") == "left":
        raise invalid(
            "a reranker cuts the end of each text (the query and template stay whole): "
            "`truncation_direction` must be 'Right'",
            "truncation_direction",
        )
    if not gw.rerank_model_name:
        raise APIError(NOT_FOUND, "model is not a re-ranker model")
    raw, return_text = _flag(body, "raw_scores", False), _flag(body, "return_text", False)
    try:
        result = await gw.client.rerank(
            query, texts, truncate=truncation.get("truncate", True), headers=gw.outgoing()
        )
    except EmbeddingError as e:
        raise backend_error(e, ("query", "texts")) from e
    ranks = []
    for index, score in result.ranking:
        # raw: the model's logit, log(p / (1 - p)) of its yes/no softmax
        value = math.log(score / (1 - score)) if raw and 0 < score < 1 else score
        ranks.append(
            {"index": index, "score": value} | ({"text": texts[index]} if return_text else {})
        )
    return ranks


@router.post("/tokenize")
async def tokenize(request: Request):
    gw = gateway(request)
    body = _body(await json_body(request))
    texts, ids = _inputs(body)
    if ids:
        raise invalid("`inputs` of /tokenize must be texts", "inputs")
    options = {} if body.get("prompt_name") is None else {"prompt_name": body["prompt_name"]}
    keep_special = _flag(body, "add_special_tokens", True)
    try:
        tokens = await gw.client.tokenize(texts, **options_checked(**options))
    except EmbeddingError as e:
        raise backend_error(e, ("prompt_name",)) from e
    if not keep_special:
        tokens = [[t for t in text if not t["special"]] for text in tokens]
    return tokens


@router.post("/decode")
async def decode(request: Request):
    gw = gateway(request)
    body = _body(await json_body(request))
    id_lists = token_id_lists(body.get("ids"), "ids")
    if id_lists is None:
        raise invalid("`ids` must be a list of token ids or a list of such lists", "ids")
    if len(id_lists) > MAX_INPUTS:
        raise invalid(f"batch size {len(id_lists)} > maximum allowed batch size {MAX_INPUTS}")
    try:
        return await gw.client.decode(id_lists, _flag(body, "skip_special_tokens", True))
    except EmbeddingError as e:
        raise backend_error(e, ("ids",)) from e


@router.get("/info")
async def info(request: Request):
    """TEI's Info, from the facts the served models publish. Of TEI's fields, model_sha,
    max_batch_requests, sha and docker_label are null, and max_concurrent_requests and
    tokenization_workers (the gateway sets neither) are left out."""
    gw = gateway(request)
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
