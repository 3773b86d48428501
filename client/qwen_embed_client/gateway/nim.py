"""NVIDIA NIM's reranking API: POST /v1/ranking, {model, query: {text}, passages: [{text}],
truncate} -> {rankings: [{index, logit}]}, best first, what NIM's clients call (LangChain's and
LlamaIndex's NVIDIARerank, Haystack's NvidiaRanker). A logit is the reranker's log-odds of "yes"
(common.log_odds; a listwise reranker's cosine as it is). `truncate`: "END" (the default) cuts a
passage's end, "NONE" refuses a passage past the model's limit. NIM's embeddings are OpenAI's
/v1/embeddings with its `input_type` and `truncate` (openai.py). Errors in OpenAI's shape
(app.py). NIM's probes, GET /v1/health/live and /v1/health/ready (503 until Triton serves the
embed model), carry no key (app.py mounts them beside /health)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..client import EmbeddingError
from ..contract import MAX_DOCUMENTS
from .bodies import Body, NonBlank, Text, at_most
from .common import TRUNCATE_MODES, model_adapter, raw_scores
from .errors import backend_error, rerank_checked
from .state import gateway, routed

router = APIRouter(tags=["nim"])


class Query(Body):
    text: NonBlank


class Passage(Body):
    text: Text


class RankingRequest(Body):
    model: str | None = None
    query: Query
    passages: Annotated[list[Passage], at_most(MAX_DOCUMENTS)]
    truncate: Literal["NONE", "END"] = "END"


@router.post("/v1/ranking")
async def ranking(request: Request):
    gw, body = await routed(request)
    asked = RankingRequest.parse(body)
    served, triton = gw.rerank_model_names, gw.triton_rerank_model
    adapter = await model_adapter(gw, asked.model, served, triton)
    options = TRUNCATE_MODES[asked.truncate] | ({"adapter": adapter} if adapter else {})
    options = rerank_checked(**options)
    passages = [p.text for p in asked.passages]
    try:
        result = await gw.client.rerank(
            asked.query.text, passages, **options, headers=gw.outgoing()
        )
    except EmbeddingError as e:
        raise backend_error(e, (), lambda i: f"passages[{i}].text") from e
    raw = await raw_scores(gw)
    return {"rankings": [{"index": i, "logit": raw(s)} for i, s in result.ranking]}


async def live():
    return {"object": "health.response", "message": "live", "live": True}


async def ready(request: Request):
    gw = gateway(request)
    if await gw.client.model_ready(gw.client.model):
        return {"object": "health.response", "message": "ready", "ready": True}
    body = {"object": "health.response", "message": "not ready", "ready": False}
    return JSONResponse(body, status_code=503)
