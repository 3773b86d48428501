"""Mixedbread's reranking API, what its `mixedbread` SDK's `rerank` posts (mxbai-rerank-v2 is
one of the rerankers served here): POST /v1/reranking, {model, query, input: [document, ...],
top_k, return_input, rank_fields, rewrite_query} -> {object: "list", data: [{index, score,
input (where asked), object: "rank_result"}], model, usage: {prompt_tokens, total_tokens},
top_k, return_input}, best first. A document is a text; objects ranked by their
`rank_fields` and a rewritten query are not served (refused, naming the field). Mixedbread's
embeddings are OpenAI's /v1/embeddings with its `prompt`, `normalized` and `dimensions`
(openai.py). Errors in OpenAI's shape (app.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request

from ..client import EmbeddingError
from ..contract import MAX_DOCUMENTS
from .bodies import Body, NonBlank, Text, at_most, described
from .common import model_adapter
from .errors import APIError, backend_error, invalid, named_as_sent, rerank_checked
from .state import routed

router = APIRouter(tags=["openai"])


class RerankingRequest(Body):
    model: str | None = None
    query: NonBlank
    input: Annotated[
        list[described(Text, "must be a string (objects with 'rank_fields' are not served)")],
        at_most(MAX_DOCUMENTS),
    ]
    top_k: int | None = None
    return_input: bool = False
    rank_fields: object = None
    rewrite_query: bool = False


@router.post("/v1/reranking")
async def reranking(request: Request):
    gw, body = await routed(request)
    asked = RerankingRequest.parse(body)
    for name in ("rank_fields", "rewrite_query"):
        if getattr(asked, name):
            raise invalid(f"'{name}' is not served: the documents are ranked as given", name)
    served, triton = gw.rerank_model_names, gw.triton_rerank_model
    adapter = await model_adapter(gw, asked.model, served, triton)
    options = {"adapter": adapter} if adapter else {}
    if asked.top_k is not None:
        options["top_n"] = asked.top_k
    try:
        options = rerank_checked(**options)
    except APIError as e:
        raise named_as_sent(e, {"top_n": "top_k"}) from None
    try:
        result = await gw.client.rerank(asked.query, asked.input, **options, headers=gw.outgoing())
    except EmbeddingError as e:
        raise backend_error(e, (), "input") from e
    data = []
    for index, score in result.ranking:
        item = {"index": index, "score": score, "object": "rank_result"}
        if asked.return_input:
            item["input"] = asked.input[index]
        data.append(item)
    return {
        "object": "list",
        "data": data,
        "model": adapter or gw.rerank_model_name,
        "usage": {"prompt_tokens": result.total_tokens, "total_tokens": result.total_tokens},
        "top_k": asked.top_k if asked.top_k is not None else len(asked.input),
        "return_input": asked.return_input,
    }
