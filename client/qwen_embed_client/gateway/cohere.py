"""Cohere's v2 API: POST /v2/embed and /v2/rerank, what Cohere's SDK (`ClientV2(base_url=...)`)
and the RAG frameworks built on it speak, and v1's POST /v1/embed (its `Client`: a list of
float vectors unless `embedding_types` is given; v1's rerank is openai.py's /v1/rerank). Errors
are Cohere's {"id", "message"}.

`input_type` picks the checkpoint's prompt: a prompt named like the input type if the
checkpoint has one; else search_query -> the `query` prompt, search_document -> the `document`
prompt (no prompt if the checkpoint has none), classification and clustering -> the query
prompt with the task Qwen3-Embedding's evaluation uses for them (INPUT_TYPE_TASKS), image ->
the model's default; without `input_type`, the checkpoint's default prompt. Cohere's
`priority` (0 first) maps 0 to the interactive level and anything higher to bulk. A
multimodal model takes images: `image_url` parts in `inputs`, or `images` (media.py).

Extension: `text_tokens`, per text {tokens, input_tokens, truncated} (the SDK's models keep
unknown fields).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, model_validator

from ..client import EmbeddingError
from ..contract import EMBEDDING_TYPES, MAX_DOCUMENTS, MAX_INPUTS
from .bodies import Body, NonBlank, Text, Texts, at_most, distinct, one_of
from .common import (
    TASK_INSTRUCTIONS,
    TRUNCATE_MODES,
    Encoding,
    checkpoint_facts,
    embed,
    model_adapter,
    prompt_options,
    text_usage,
)
from .errors import (
    STATUS,
    APIError,
    backend_error,
    in_body_words,
    options_checked,
    rerank_checked,
)
from .media import ImagePart, ImageURL, Parts, has_parts, texts_and_media
from .state import respond, routed

router = APIRouter(tags=["cohere"])

INPUT_TYPES = ("search_query", "search_document", "classification", "clustering", "image")
INPUT_TYPE_PROMPTS = {"search_query": "query", "search_document": "document"}
INPUT_TYPE_TASKS = {k: TASK_INSTRUCTIONS[k] for k in ("classification", "clustering")}
API_META = {"api_version": {"version": "2"}}


# The contract's options that Cohere's body names otherwise.
_FIELDS = {"dimensions": "output_dimension", "max_document_tokens": "max_tokens_per_doc"}


def error_response(e: APIError) -> JSONResponse:
    message = in_body_words(e.message, _FIELDS)
    return JSONResponse({"id": str(uuid.uuid4()), "message": message}, status_code=STATUS[e.kind])


class CohereBody(Body):
    QUOTE, PREFIX = "{}", "invalid request: "


class Input(CohereBody):
    content: Parts  # text parts and (a multimodal model) image_url parts


Priority = Annotated[int, Field(ge=0)]  # 0 first


class EmbedRequest(CohereBody):
    """POST /v2/embed: `texts`, `inputs` of content parts, or (a multimodal model) `images`
    as data URLs, one vector each."""

    model: str | None = None
    texts: Texts | None = None
    inputs: Annotated[list[Input], at_most(MAX_INPUTS)] | None = None
    images: Annotated[list[str], at_most(MAX_INPUTS)] | None = None
    input_type: Literal[INPUT_TYPES] | None = None
    truncate: Literal[tuple(TRUNCATE_MODES)] = "END"
    output_dimension: int | None = None
    max_tokens: int | None = None
    embedding_types: distinct(Literal[(*EMBEDDING_TYPES, "base64")]) = ["float"]
    priority: Priority | None = None

    @model_validator(mode="after")
    def _one_input_field(self):
        one_of(self, "texts", "inputs", "images")
        return self

    @property
    def items(self) -> list:
        """Texts, or lists of content parts (media.py), one per vector."""
        if self.texts is not None:
            return self.texts
        if self.images is not None:
            return [[ImagePart(type="image_url", image_url=ImageURL(url=u))] for u in self.images]
        return [item.content for item in self.inputs]

    def server_types(self) -> list[str]:
        """The server's types that give the asked ones: `base64`, the float vectors' bytes,
        comes from float."""
        server = {"float" if k == "base64" else k for k in self.embedding_types}
        return [k for k in EMBEDDING_TYPES if k in server]


class RerankRequest(CohereBody):
    model: str | None = None
    query: NonBlank
    documents: Annotated[list[Text], at_most(MAX_DOCUMENTS)]
    top_n: int | None = None
    max_tokens_per_doc: int | None = None
    priority: Priority | None = None


def _priority(value: int | None) -> dict:
    """Cohere's `priority` (0 first): 0 the interactive level, anything higher bulk."""
    return {} if value is None else {"priority": "interactive" if value == 0 else "bulk"}


@router.post("/v2/embed")
async def embed_v2(request: Request):
    gw, body = await routed(request)
    return await respond(gw, *await _embed(gw, body, version=2))


@router.post("/v1/embed")
async def embed_v1(request: Request):
    """Cohere's v1 embed (its SDK's `Client`): the v2 body, answered as v1 does, a list of
    float vectors unless `embedding_types` is given."""
    gw, body = await routed(request)
    return await respond(gw, *await _embed(gw, body, version=1))


async def _embed(gw, body: object, version: int) -> tuple[dict, None, str | None]:
    """(the answer, no headers, the adapter it came from: common.model_adapter)."""
    asked = EmbedRequest.parse(body)
    adapter = await model_adapter(gw, asked.model, gw.model_names)
    texts, kinds, images, videos = asked.items, asked.server_types(), None, None
    if has_parts(texts):
        texts, images, videos = await texts_and_media(texts, "inputs", gw.remote_media)
    options = {**TRUNCATE_MODES[asked.truncate], **_priority(asked.priority)}
    if asked.output_dimension is not None:
        options["dimensions"] = asked.output_dimension
    options |= asked.given("max_tokens")
    if adapter is not None:
        options["adapter"] = adapter
    prompt_names = (await checkpoint_facts(gw, asked.input_type)).get("prompt_names", [])
    options |= prompt_options(asked.input_type, prompt_names, INPUT_TYPE_PROMPTS, INPUT_TYPE_TASKS)
    try:
        options = options_checked(**options)
    except APIError as e:
        e.message = f"invalid request: {e.message}"
        raise
    items = next(k for k in ("texts", "images", "inputs") if getattr(asked, k) is not None)
    params = ("dimensions", "max_tokens")
    result = await embed(gw, texts, options, kinds, items, params, images=images, videos=videos)
    embeddings = {}
    for kind in asked.embedding_types:
        vectors = result.by_type["float" if kind == "base64" else kind]
        encode = Encoding("base64" if kind == "base64" else "float")
        embeddings[kind] = [encode(v) for v in vectors]
    tokens = result.total_tokens
    by_type = version == 2 or body.get("embedding_types") is not None
    return (
        {
            "id": str(uuid.uuid4()),
            "embeddings": embeddings if by_type else embeddings["float"],
            "texts": texts,
            "meta": {
                "api_version": {"version": str(version)},
                "billed_units": {"input_tokens": tokens},
                "tokens": {"input_tokens": tokens},
            },
            "response_type": "embeddings_by_type" if by_type else "embeddings_floats",
            "text_tokens": [text_usage(result, i) for i in range(len(texts))],
        },
        None,
        adapter,
    )


@router.post("/v2/rerank")
async def rerank_v2(request: Request):
    gw, body = await routed(request)
    asked = RerankRequest.parse(body)
    served, triton = gw.rerank_model_names, gw.triton_rerank_model
    adapter = await model_adapter(gw, asked.model, served, triton)
    query, documents = asked.query, asked.documents
    options = _priority(asked.priority) | asked.given("top_n")
    if adapter is not None:
        options["adapter"] = adapter
    if asked.max_tokens_per_doc is not None:
        options["max_document_tokens"] = asked.max_tokens_per_doc
    try:
        options = rerank_checked(**options)
    except APIError as e:
        e.message = f"invalid request: {e.message}"
        raise
    try:
        result = await gw.client.rerank(query, documents, **options, headers=gw.outgoing())
    except EmbeddingError as e:
        raise backend_error(e, (), "documents") from e
    return {
        "id": str(uuid.uuid4()),
        "results": [{"index": i, "relevance_score": s} for i, s in result.ranking],
        "meta": {**API_META, "billed_units": {"search_units": 1}},
    }
