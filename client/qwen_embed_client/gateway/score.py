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

from fastapi import APIRouter, Request

from ..maxsim import maxsim
from .bodies import Body, TextInputs
from .common import check_model, embed_tokens, vllm_list
from .errors import invalid, json_body, options_checked
from .state import gateway, respond

router = APIRouter(tags=["openai"])


class ScoreRequest(Body):
    model: str | None = None
    text_1: TextInputs
    text_2: TextInputs
    dimensions: int | None = None
    prompt_name: str | None = None


@router.post("/v1/score")
@router.post("/score")
async def score(request: Request):
    gw = gateway(request)
    asked = ScoreRequest.parse(await json_body(request))
    check_model(asked.model, gw.model_names)
    queries, documents = asked.text_1, asked.text_2
    if len(queries) != 1 and len(queries) != len(documents):
        raise invalid(
            f"'text_1' must be one text or as many as 'text_2' ({len(documents)}), "
            f"got {len(queries)}",
            "text_1",
        )
    common = {"normalize": True} | asked.given("dimensions")
    prompt = asked.given("prompt_name")
    query_vectors = await embed_tokens(gw, queries, options_checked(**common, **prompt), "text_1")
    document_vectors = await embed_tokens(gw, documents, options_checked(**common), "text_2")
    if len(queries) == 1:
        query_vectors = query_vectors * len(documents)
    data = [
        {"index": i, "object": "score", "score": maxsim(q, d)}
        for i, (q, d) in enumerate(zip(query_vectors, document_vectors, strict=True))
    ]
    tokens = sum(len(v) for v in query_vectors[: len(queries)]) + sum(
        len(v) for v in document_vectors
    )
    return await respond(gw, vllm_list(gw, "score", data, tokens))
