"""vLLM's pooling API: POST /pooling, an embeddings request (OpenAI's body, vLLM's fields) with
vLLM's `task`: "embed" (the default) answers each input's vector, "token_embed" every token's
(the model's final hidden states, unit length unless `use_activation` is false, as vLLM's token
pooler gives them) -> {id, object: "list", created, model, data: [{index, object: "pooling",
data}], usage}. A sequence classifier's logits are TEI's /predict here; vLLM's other tasks are
refused, naming `task`.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from .common import checkpoint_facts, embed_tokens
from .errors import invalid, json_body
from .openai import checked_request, embeddings_body, request_plan
from .state import gateway, respond

router = APIRouter(tags=["openai"])

TASKS = ("embed", "token_embed")


@router.post("/pooling")
async def pooling(request: Request):
    gw = gateway(request)
    body = await json_body(request)
    task = body.pop("task", None) if isinstance(body, dict) else None
    if task not in (None, *TASKS):
        raise invalid(
            f"'task' must be one of {list(TASKS)} (a classifier's logits: /predict), got {task!r}",
            "task",
        )
    if task == "token_embed":
        data, tokens = await _token_vectors(gw, body)
    else:
        answer = await embeddings_body(gw, body)
        data = [_vector(item) for item in answer["data"]]
        tokens = answer["usage"]["total_tokens"]
    return await respond(
        gw,
        {
            "id": f"pool-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": gw.model_name,
            "data": [{"index": i, "object": "pooling", "data": d} for i, d in enumerate(data)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        },
    )


def _vector(item: dict):
    """An embeddings data item's vector, or what it holds instead (our extensions: the
    vectors of several embedding types, late chunks)."""
    for key in ("embedding", "embeddings", "chunks"):
        if key in item:
            return item[key]
    raise KeyError(f"an embeddings item of none of the known keys: {sorted(item)}")


async def _token_vectors(gw, body: object) -> tuple[list, int]:
    """Each input's token vectors, encoded as the body asks, and the tokens in all."""
    request = checked_request(body, gw.model_names)
    facts = await checkpoint_facts(gw, request.input_type or request.task)
    inputs, options, encoding, kinds, keyed = request_plan(request, facts)
    if kinds != ["float"] or keyed or request.late_chunking or request.chunks is not None:
        raise invalid("task 'token_embed' answers float token vectors, unchunked", "task")
    vectors = await embed_tokens(gw, inputs, options, "input")
    return [encoding(v) for v in vectors], sum(len(v) for v in vectors)
