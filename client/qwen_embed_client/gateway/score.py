"""vLLM's score API: POST /v1/score (and /score) {model, text_1, text_2} -> {data: [{index,
object: "score", score}], usage}. `text_1` is one query (scored against each of `text_2`) or a
list as long as `text_2` (scored pairwise).

On the embed model, late interaction: a score is MaxSim (maxsim.py) over both inputs'
normalised per-token vectors (a multimodal model's inputs may be content parts with images,
vLLM's {"content": [parts]}: ScoreRequest); `prompt_name` (an extension) prefixes `text_1`'s
texts only (without one, a MultiVectorEncoder's query and document tasks:
common.late_interaction_prompts), `dimensions` cuts the token vectors. With `model` a name of
the reranker's (`rerank_model_names`), what vLLM answers for a cross-encoder: the reranker's
relevance of each pair (texts only; a rerank request per distinct query, at most the client's
requests in flight at once; per pair for a listwise reranker, as vLLM scores its pairs).
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Request
from pydantic import AfterValidator, model_validator

from ..client import EmbeddingError
from ..maxsim import maxsim
from .bodies import Body, Text, batch, described
from .common import check_model, embed_tokens, late_interaction_prompts, vllm_list
from .errors import backend_error, invalid, options_checked
from .media import Parts, has_parts
from .state import respond, routed

router = APIRouter(tags=["openai"])


# vLLM's score inputs: texts, or (a multimodal model) inputs of content parts
ScoreInputs = Annotated[
    described(
        Text | list[Text | Parts],
        "must be a string, a list of strings or of content parts, or vLLM's {'content': [parts]}",
    ),
    AfterValidator(batch),
]


class ScoreRequest(Body):
    model: str | None = None
    text_1: ScoreInputs
    text_2: ScoreInputs
    dimensions: int | None = None
    prompt_name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _vllm_content(cls, body):
        """vLLM's {"content": [parts]}: as `text_1`, the one query of its parts; as `text_2`,
        each part one document; as an item of a list, that input's parts."""
        if not isinstance(body, dict):
            return body
        body = dict(body)
        for name in ("text_1", "text_2"):
            value = body.get(name)
            if isinstance(value, dict) and isinstance(value.get("content"), list):
                parts = value["content"]
                body[name] = [parts] if name == "text_1" else [[part] for part in parts]
            elif isinstance(value, list):
                body[name] = [_content(item) for item in value]
        return body


def _content(item):
    return item["content"] if isinstance(item, dict) and "content" in item else item


@router.post("/v1/score")
@router.post("/score")
async def score(request: Request):
    gw, body = await routed(request)
    asked = ScoreRequest.parse(body)
    queries, documents = asked.text_1, asked.text_2
    if len(queries) != 1 and len(queries) != len(documents):
        raise invalid(
            f"'text_1' must be one text or as many as 'text_2' ({len(documents)}), "
            f"got {len(queries)}",
            "text_1",
        )
    if asked.model in gw.rerank_model_names:
        return await _reranker_scores(gw, asked)
    check_model(asked.model, gw.model_names)
    common = {"normalize": True} | asked.given("dimensions")
    query, document = await late_interaction_prompts(gw, asked.given("prompt_name"))
    query_vectors = await embed_tokens(gw, queries, options_checked(**common, **query), "text_1")
    document_vectors = await embed_tokens(
        gw, documents, options_checked(**common, **document), "text_2"
    )
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


async def _reranker_scores(gw, asked: ScoreRequest) -> dict:
    for name in ("dimensions", "prompt_name"):
        if getattr(asked, name) is not None:
            raise invalid(
                f"'{name}' applies to the embed model's token vectors, not to the reranker "
                f"{gw.rerank_model_name!r}",
                name,
            )
    queries, documents = asked.text_1, asked.text_2
    for name, inputs in (("text_1", queries), ("text_2", documents)):
        if has_parts(inputs):
            raise invalid(
                "content parts are scored here by the embed model's late interaction; the "
                f"reranker {gw.rerank_model_name!r} takes them on /v1/rerank",
                name,
            )
    # One rerank request per distinct query; a listwise reranker's pairs one by one (its
    # score of a document depends on the others read with it), as vLLM scores them.
    per_pair = len(queries) > 1 and await gw.client.score_kind() == "cosine"
    if len(queries) == 1:
        queries = queries * len(documents)
    groups: dict = {}
    for i, query in enumerate(queries):
        groups.setdefault(i if per_pair else query, []).append(i)
    slots = asyncio.Semaphore(gw.client.requests_in_flight)  # Triton's queues are bounded

    async def scored(indices: list[int]):
        at = "text_1" if len(asked.text_1) == 1 else f"text_1[{indices[0]}]"
        async with slots:
            try:
                texts = [documents[i] for i in indices]
                result = await gw.client.rerank(queries[indices[0]], texts, headers=gw.outgoing())
            except EmbeddingError as e:
                raise backend_error(e, (), lambda j: f"text_2[{indices[j]}]", at) from e
        return indices, result

    scores, tokens = np.empty(len(documents)), 0
    for indices, result in await asyncio.gather(*(scored(g) for g in groups.values())):
        scores[indices] = result.scores
        tokens += int(result.token_counts.sum())
    data = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)]
    body = vllm_list(gw, "score", data, tokens) | {"model": gw.rerank_model_name}
    return await respond(gw, body)
