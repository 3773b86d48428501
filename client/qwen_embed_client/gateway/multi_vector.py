"""Jina AI's multi-vector API, what its ColBERT clients send (Weaviate's text2colbert-jinaai,
Jina's own examples): POST /v1/multi-vector {model, input: a text, {"text": ...} or a list of
them, input_type: "query" | "document" (the default), embedding_type: "float" (the default) |
"base64", dimensions} -> {model, object: "list", usage: {total_tokens}, data: [{object:
"embeddings", index, embeddings: [a vector per token, ...]}]}.

The vectors are the embed model's per-token ones (client.embed_tokens), normalised, as its
other routes give them; `input_type` names the checkpoint's prompt of that name where it has
one (a MultiVectorEncoder's task: its query expansion, lengths and skiplist), else none.
"base64" is each token's float32 vector, little-endian, one string per token. Errors in
Jina's shape: {"detail": message}, the status as the other APIs'."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import AfterValidator

from .bodies import Body, Text, batch, described
from .common import Encoding, check_model, embed_tokens, multi_vector_data
from .errors import STATUS, APIError, options_checked
from .openai import Document
from .state import respond, routed

router = APIRouter(tags=["jina"])


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse({"detail": e.message}, status_code=STATUS[e.kind])


def _texts(value) -> list[str]:
    """One input or a list of them (batch's limits) -> the texts."""
    items = batch(value if isinstance(value, list) else [value])
    return [item.text if isinstance(item, Document) else item for item in items]


MultiVectorInputs = Annotated[
    described(
        Text | Document | list[Text | Document],
        'must be a string, a {"text": ...} document, or a non-empty list of them',
    ),
    AfterValidator(_texts),
]


class MultiVectorRequest(Body):
    model: str | None = None
    input: MultiVectorInputs
    input_type: Literal["query", "document"] = "document"
    embedding_type: Literal["float", "base64"] = "float"
    dimensions: int | None = None


@router.post("/v1/multi-vector")
async def multi_vector(request: Request):
    gw, body = await routed(request)
    asked = MultiVectorRequest.parse(body)
    check_model(asked.model, gw.model_names)
    names = (await gw.facts()).get("prompt_names", [])
    prompt = {"prompt_name": asked.input_type} if asked.input_type in names else {}
    options = options_checked(normalize=True, **asked.given("dimensions"), **prompt)
    vectors = await embed_tokens(gw, asked.input, options, "input")
    data, tokens = multi_vector_data(vectors, Encoding(asked.embedding_type))
    usage = {"total_tokens": tokens}
    body = {"model": asked.model or gw.model_name, "object": "list", "usage": usage, "data": data}
    return await respond(gw, body)
