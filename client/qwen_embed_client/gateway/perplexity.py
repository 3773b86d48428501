"""Perplexity's contextualized embeddings API, what the `perplexityai` SDK's
`contextualized_embeddings.create` sends (pplx-embed-context-v1's): POST
/v1/contextualizedembeddings, {model, input: [[chunk, ...], ...] (each document's chunks, in
order), dimensions, encoding_format} -> {object: "list", data: [{object: "list", index, data:
[{object: "embedding", index, embedding}]}], model, usage: {prompt_tokens, total_tokens}}.

A document's chunks are read together (client.embed_contextual: joined by the model's chunk
separator, one vector per chunk); a model without a separator is refused. A vector is the
model's own, unnormalised, in Perplexity's encodings (common.Encoding): `base64_int8` (the
default) its int8 codes, `base64_binary` its signs. Perplexity's standard embeddings are
OpenAI's /v1/embeddings with those encodings (openai.py). Errors in OpenAI's shape (app.py). A
body with `inputs` is Voyage AI's form of the route (voyage.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Request

from ..contract import MAX_CHUNKS
from . import voyage
from .bodies import Body, Chunk, at_most
from .common import (
    PERPLEXITY_FORMATS,
    Encoding,
    contextual_answer,
    contextual_chunks,
    model_adapter,
)
from .errors import options_checked
from .state import routed

router = APIRouter(tags=["openai"])

DOCUMENTS_PER_REQUEST = 512  # as Perplexity's API takes them


class ContextualizedRequest(Body):
    model: str | None = None
    input: Annotated[
        list[Annotated[list[Chunk], at_most(MAX_CHUNKS)]], at_most(DOCUMENTS_PER_REQUEST)
    ]
    dimensions: int | None = None
    encoding_format: Literal[PERPLEXITY_FORMATS] = "base64_int8"


@router.post("/v1/contextualizedembeddings")
async def contextualized_embeddings(request: Request):
    gw, body = await routed(request)
    if isinstance(body, dict) and "inputs" in body:
        return await voyage.contextualized_embeddings(gw, body)
    asked = ContextualizedRequest.parse(body)
    adapter = await model_adapter(gw, asked.model, gw.model_names)
    given = asked.given("dimensions") | ({"adapter": adapter} if adapter else {})
    options = options_checked(normalize=False, **given)
    results = await contextual_chunks(gw, asked.input, options, asked.model, "input")
    encode = Encoding(asked.encoding_format)
    vectors = [[encode(v) for v in r.embeddings] for r in results]
    return contextual_answer(vectors, results, adapter or gw.model_name)
