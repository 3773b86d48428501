"""Late-interaction scoring on the embed model, in vLLM's score API: POST /v1/score (and
/score) {model, text_1, text_2} -> {data: [{index, object: "score", score}], usage}.

A score is MaxSim (maxsim.py) over both texts' normalised per-token vectors. It is its own
route, not a `method` of the rerank routes: those answer with the reranker (a cross-encoder,
another model, `rerank_model_name`) and its [0, 1] relevance, while MaxSim sums cosines of the
embed model's tokens. `text_1` is one query (scored against each of `text_2`) or a list as long
as `text_2` (scored pairwise); `prompt_name` (an extension) prefixes `text_1`'s texts only,
`dimensions` cuts the token vectors.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from ..contract import MAX_INPUTS
from ..maxsim import maxsim
from .common import check_model, embed_tokens
from .errors import check_utf8, invalid, json_body, options_checked
from .state import gateway, respond

router = APIRouter(tags=["openai"])


def _texts(body: dict, name: str) -> list[str]:
    value = body.get(name)
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise invalid(f"'{name}' must be a string or a non-empty list of strings", name)
    if len(texts) > MAX_INPUTS:
        raise invalid(f"'{name}' holds {len(texts)} texts, more than the limit of {MAX_INPUTS}")
    check_utf8([(f"{name}[{i}]", t) for i, t in enumerate(texts)])
    return texts


@router.post("/v1/score")
@router.post("/score")
async def score(request: Request):
    gw = gateway(request)
    body = await json_body(request)
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    check_model(body.get("model"), gw.model_names)
    queries, documents = _texts(body, "text_1"), _texts(body, "text_2")
    if len(queries) != 1 and len(queries) != len(documents):
        raise invalid(
            f"'text_1' must be one text or as many as 'text_2' ({len(documents)}), "
            f"got {len(queries)}",
            "text_1",
        )
    common = {"normalize": True}
    if body.get("dimensions") is not None:
        common["dimensions"] = body["dimensions"]
    asked = {"prompt_name": body["prompt_name"]} if body.get("prompt_name") is not None else {}
    query_vectors = await embed_tokens(gw, queries, options_checked(**common, **asked))
    document_vectors = await embed_tokens(gw, documents, options_checked(**common))
    if len(queries) == 1:
        query_vectors = query_vectors * len(documents)
    data = [
        {"index": i, "object": "score", "score": maxsim(q, d)}
        for i, (q, d) in enumerate(zip(query_vectors, document_vectors, strict=True))
    ]
    tokens = sum(len(v) for v in query_vectors[: len(queries)]) + sum(
        len(v) for v in document_vectors
    )
    return await respond(
        gw,
        {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": gw.model_name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        },
    )
