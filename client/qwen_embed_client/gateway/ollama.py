"""Ollama's embedding API, what its clients (its Python library, LangChain's OllamaEmbeddings,
LlamaIndex's OllamaEmbedding) call with the gateway's URL as their host:

- POST /api/embed: {model, input: a text or texts, truncate, dimensions, options, keep_alive}
  -> {model, embeddings, total_duration, load_duration, prompt_eval_count}, unit vectors (as
  Ollama's); no input (an empty text or list) answers no vectors, as Ollama's does.
- POST /api/embeddings (Ollama's older route): {model, prompt, options} -> {embedding}, the
  vector as the model gives it, not normalized (as Ollama's).
- GET /api/tags and /api/version: the served model's names, and a version; POST /api/show
  {model}: its details as Ollama describes a model (`capabilities` ["embedding"], `model_info`
  with its vectors' length and tokens per text), what tools ask before they embed.

`options.num_ctx` cuts each text to that many tokens (Ollama's context length; without it, the
model's own limit, where Ollama defaults to a context of its own); the other options set
generation and placement, which no vector depends on, and `keep_alive` has nothing to keep.
Errors are Ollama's {"error": message}.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from ..contract import MAX_INPUTS
from . import keys
from .bodies import Body, Text
from .common import embed, model_adapter
from .errors import STATUS, APIError, invalid, options_checked
from .state import respond, routed

router = APIRouter(tags=["ollama"])

VERSION = "0.6.3"  # the Ollama API version these routes follow (its Python library's)


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse({"error": e.message}, status_code=STATUS[e.kind])


class EmbedRequest(Body):
    model: str
    input: Text | Annotated[list[Text], Field(max_length=MAX_INPUTS)] = ""
    truncate: bool = True
    dimensions: Annotated[int, Field(ge=0)] | None = None  # 0: every dimension
    options: dict[str, object] | None = None
    keep_alive: str | int | float | None = None


class EmbeddingsRequest(Body):
    model: str
    prompt: Text = ""
    options: dict[str, object] | None = None
    keep_alive: str | int | float | None = None


def _options(options: dict | None, **asked) -> dict:
    """The contract's options: `asked` and Ollama's `options.num_ctx` (cuts each text)."""
    num_ctx = (options or {}).get("num_ctx")
    if num_ctx is not None:
        if not isinstance(num_ctx, int) or isinstance(num_ctx, bool) or num_ctx < 1:
            raise invalid(f"'options.num_ctx' must be an integer >= 1, got {num_ctx!r}", "options")
        asked["max_tokens"] = num_ctx
    return options_checked(**{k: v for k, v in asked.items() if v is not None})


@router.post("/api/embed")
async def embed_route(request: Request):
    start = time.monotonic_ns()
    gw, body = await routed(request)
    asked = EmbedRequest.parse(body)
    adapter = await model_adapter(gw, asked.model, gw.model_names)
    texts = [asked.input] if isinstance(asked.input, str) else asked.input
    if texts == [""]:
        texts = []
    if not texts:
        return {"model": asked.model, "embeddings": []}
    options = _options(
        asked.options, truncate=asked.truncate, dimensions=asked.dimensions or None, adapter=adapter
    )
    result = await embed(gw, texts, options, ["float"], "input")
    body = {
        "model": asked.model,
        "embeddings": result.embeddings,
        "total_duration": time.monotonic_ns() - start,
        "load_duration": 0,
        "prompt_eval_count": result.total_tokens,
    }
    return await respond(gw, body, adapter=adapter)


@router.post("/api/embeddings")
async def embeddings_route(request: Request):
    gw, body = await routed(request)
    asked = EmbeddingsRequest.parse(body)
    adapter = await model_adapter(gw, asked.model, gw.model_names)
    if not asked.prompt:
        return {"embedding": []}
    options = _options(asked.options, normalize=False, adapter=adapter)
    result = await embed(gw, [asked.prompt], options, ["float"], "prompt")
    body = {"embedding": result.embeddings[0]}
    return await respond(gw, body, adapter=adapter)


DETAILS = {"format": "safetensors", "family": "qwen", "families": ["qwen"]}


def _modified_at(gw) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(gw.created))


@router.get("/api/tags")
async def tags(request: Request):
    served = request.app.state.models
    digests = {}
    for gw in keys.embedders(request):
        facts = await gw.facts()
        # the encoder's adapters are models of their own, each with its fingerprint
        digests |= {name: facts.get("fingerprint") for name in gw.model_names}
        digests |= facts.get("adapter_fingerprints", {})
    models = [
        {
            "name": name,
            "model": name,
            "modified_at": _modified_at(served.default),
            "size": 0,
            "digest": digest or "",
            "details": DETAILS,
        }
        for name, digest in digests.items()
    ]
    return {"models": models}


class ShowRequest(Body):
    model: str
    verbose: bool = False


@router.post("/api/show")
async def show(request: Request):
    gw, body = await routed(request)
    asked = ShowRequest.parse(body)
    await model_adapter(gw, asked.model, gw.model_names)
    keys.check_described(request, gw.client.model)
    facts = await gw.facts()
    info = {"general.architecture": DETAILS["family"]}
    for key, fact in (("embedding_length", "dimension"), ("context_length", "tokens_per_text")):
        if facts.get(fact) is not None:
            info[f"{DETAILS['family']}.{key}"] = facts[fact]
    return {
        "modelfile": "",
        "parameters": "",
        "template": "",
        "license": "",
        "details": DETAILS,
        "model_info": info,
        "capabilities": ["embedding"],
        "modified_at": _modified_at(gw),
    }


@router.get("/api/version")
async def version():
    return {"version": VERSION}
