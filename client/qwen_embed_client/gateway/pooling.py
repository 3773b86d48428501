"""vLLM's pooling-runner APIs beside /v1/embeddings:

- POST /pooling: an embeddings request (OpenAI's body, vLLM's fields) with vLLM's `task`: "embed"
  (the default) answers each input's vector, "token_embed" every token's (the model's final
  hidden states, a multi-vector retriever's projected, unit length unless `use_activation` is
  false, as vLLM's token pooler gives them; inputs with images as content parts), "classify"
  a sequence classifier's class probabilities -> {id, object: "list", created, model, data:
  [{index, object: "pooling", data}], usage}; vLLM's other tasks are refused, naming `task`.
- POST /classify, for a sequence classifier served as the embed model: {model, input} ->
  {..., data: [{index, label, probs, num_classes}], usage}, `probs` the softmax of the logits
  (a one-label classifier's sigmoid), or the logits with `use_activation` false.
"""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request

from ..client import EmbeddingError
from .common import checkpoint_facts, embed_tokens, vllm_list
from .errors import backend_error, invalid
from .openai import checked_request, embeddings_body, request_plan
from .state import answered_adapter, respond, routed

router = APIRouter(tags=["openai"])

TASKS = ("embed", "token_embed", "classify")


@router.post("/pooling")
async def pooling(request: Request):
    gw, body = await routed(request)
    task = body.pop("task", None) if isinstance(body, dict) else None
    if task not in (None, *TASKS):
        raise invalid(f"'task' must be one of {list(TASKS)}, got {task!r}", "task")
    adapter = None
    if task == "token_embed":
        data, tokens = await _token_vectors(gw, body)
    elif task == "classify":
        scores, _, tokens = await _class_scores(gw, body)
        data = scores.tolist()
    else:
        answer = await embeddings_body(gw, body)
        data = [_vector(item) for item in answer["data"]]
        tokens = answer["usage"]["total_tokens"]
        adapter = answered_adapter(gw, answer)
    items = [{"index": i, "object": "pooling", "data": d} for i, d in enumerate(data)]
    return await respond(gw, vllm_list(gw, "pool", items, tokens, adapter), adapter=adapter)


@router.post("/classify")
async def classify(request: Request):
    gw, body = await routed(request)
    scores, labels, tokens = await _class_scores(gw, body)
    items = [
        {
            "index": i,
            "label": labels[int(np.argmax(row))],
            "probs": row.tolist(),
            "num_classes": len(labels),
        }
        for i, row in enumerate(scores)
    ]
    return await respond(gw, vllm_list(gw, "classify", items, tokens))


def _vector(item: dict):
    """An embeddings data item's vector, or what it holds instead (our extensions: the
    vectors of several embedding types, late chunks)."""
    for key in ("embedding", "embeddings", "chunks"):
        if key in item:
            return item[key]
    raise KeyError(f"an embeddings item of none of the known keys: {sorted(item)}")


async def _plan(gw, body: object):
    request = checked_request(body, gw.model_names)  # the embeddings task alone takes adapters
    facts = await checkpoint_facts(gw, request.input_type or request.task)
    return request, *request_plan(request, facts)


async def _token_vectors(gw, body: object) -> tuple[list, int]:
    """Each input's token vectors, encoded as the body asks, and the tokens in all."""
    request, inputs, options, encoding, kinds, keyed = await _plan(gw, body)
    if kinds != ["float"] or keyed or request.late_chunking or request.chunks is not None:
        raise invalid("task 'token_embed' answers float token vectors, unchunked", "task")
    vectors = await embed_tokens(gw, inputs, options, "input")
    return [encoding(v) for v in vectors], sum(len(v) for v in vectors)


async def _class_scores(gw, body: object) -> tuple[np.ndarray, list[str], int]:
    """A sequence classifier's answer to the body's inputs: each input's probabilities (the
    logits with `use_activation` false), the labels, and the tokens in all."""
    request, inputs, options, *_ = await _plan(gw, body)
    if not (await gw.facts()).get("labels"):
        raise invalid(
            "this model is not a sequence classifier (its vectors: /v1/embeddings)", "model"
        )
    options.pop("normalize", None)  # vLLM's use_activation: the probabilities, here
    try:
        result = await gw.client.classify(inputs, **options, headers=gw.outgoing())
    except EmbeddingError as e:
        raise backend_error(e, (), "input") from e
    scores = result.logits if request.use_activation is False else result.probabilities
    return scores, result.labels, int(result.token_counts.sum())
