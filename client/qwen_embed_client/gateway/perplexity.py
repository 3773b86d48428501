"""Perplexity's contextualized embeddings API, what the `perplexityai` SDK's
`contextualized_embeddings.create` sends (pplx-embed-context-v1's): POST
/v1/contextualizedembeddings, {model, input: [[chunk, ...], ...] (each document's chunks, in
order), dimensions, encoding_format} -> {object: "list", data: [{object: "list", index, data:
[{object: "embedding", index, embedding}]}], model, usage: {prompt_tokens, total_tokens}}.

A document's chunks are read together (client.embed_contextual: joined by the model's chunk
separator, one vector per chunk); a model without a separator is refused. A vector is the
model's own, unnormalised, in Perplexity's encodings (common.Encoding): `base64_int8` (the
default) its int8 codes, `base64_binary` its signs. Perplexity's standard embeddings are
OpenAI's /v1/embeddings with those encodings (openai.py). Errors in OpenAI's shape (app.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import Field

from ..client import EmbeddingError
from ..contract import MAX_CHUNKS
from .bodies import Body, Text, at_most
from .common import PERPLEXITY_FORMATS, Encoding, model_adapter
from .errors import backend_error, chunk_refusal, invalid, json_body, options_checked
from .state import gateway

router = APIRouter(tags=["openai"])

DOCUMENTS_PER_REQUEST = 512  # as Perplexity's API takes them


Chunk = Annotated[Text, Field(min_length=1)]


class ContextualizedRequest(Body):
    model: str | None = None
    input: Annotated[
        list[Annotated[list[Chunk], at_most(MAX_CHUNKS)]], at_most(DOCUMENTS_PER_REQUEST)
    ]
    dimensions: int | None = None
    encoding_format: Literal[PERPLEXITY_FORMATS] = "base64_int8"


@router.post("/v1/contextualizedembeddings")
async def contextualized_embeddings(request: Request):
    gw = gateway(request)
    asked = ContextualizedRequest.parse(await json_body(request))
    adapter = await model_adapter(gw, asked.model, gw.model_names)
    given = asked.given("dimensions") | ({"adapter": adapter} if adapter else {})
    options = options_checked(normalize=False, **given)
    separator = (await gw.client.served_facts()).get("chunk_separator")
    if separator is None:
        raise invalid(
            f"model '{asked.model or gw.model_name}' embeds no contextualized chunks: it has "
            "no chunk separator (a contextual checkpoint's, as pplx-embed-context's)",
            "model",
        )
    try:
        results = await gw.client.embed_contextual(asked.input, **options, headers=gw.outgoing())
    except EmbeddingError as e:
        raise backend_error(e, ("dimensions",), "input") from e
    except ValueError as e:  # a chunk holding the separator (client.joined_documents)
        raise chunk_refusal(e, "documents") from e
    encode = Encoding(asked.encoding_format)
    data = [
        {
            "object": "list",
            "index": i,
            "data": [
                {"object": "embedding", "index": j, "embedding": encode(v)}
                for j, v in enumerate(result.embeddings)
            ],
        }
        for i, result in enumerate(results)
    ]
    tokens = sum(r.token_count for r in results)
    return {
        "object": "list",
        "data": data,
        "model": adapter or gw.model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
