"""What every handler shares: the Gateway state (app.state.gateway) and the response with the
model fingerprint."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..client import AsyncEmbeddingClient
from .errors import BACKEND, APIError, json_body
from .remote_media import RemoteMedia

# A JSON body's limit: room for a request of images at the contract's size per image
# (MAX_IMAGE_BYTES, base64 in a data URL).
MAX_BODY_BYTES = 64 * 2**20
FINGERPRINT_HEADER = "x-model-fingerprint"


@dataclass
class Gateway:
    """What the handlers share: the Triton client, the names served, the models' facts."""

    client: AsyncEmbeddingClient
    model_names: tuple[str, ...]  # the embed model's served names: the first answers, any is taken
    rerank_model_names: tuple[str, ...]  # the reranker's: the first answers; none: routes off
    triton_rerank_model: str
    tracing: object | None  # tracing.Tracing
    remote_media: RemoteMedia | None = None  # the http(s) media URLs fetched (None: none)
    max_body_bytes: int = MAX_BODY_BYTES  # larger JSON bodies are refused unread (413)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def rerank_model_name(self) -> str | None:
        return self.rerank_model_names[0] if self.rerank_model_names else None

    def outgoing(self) -> dict | None:
        """Headers for the Triton requests: the current span's trace context."""
        return self.tracing.outgoing_headers() if self.tracing is not None else None

    async def facts(self) -> dict:
        """The embed model's published facts: the tokenizer's (dimension, tokens per text,
        prompt names), the encoder's (route, tokens per forward) and the model fingerprint."""
        return await self.client.served_facts()  # remembered there for a few seconds


def gateway(request: Request) -> Gateway:
    """The gateway's own Gateway, its first models' (its key already checked: keys.py),
    for a request that names no model."""
    return request.app.state.gateway


async def routed(request: Request, model: str | None = None) -> tuple[Gateway, object]:
    """A request's Gateway, the one of the model its JSON body names (served.ServedModels),
    and that body (json_body); `model`: the one its URL names (Azure's deployment), over the
    body's."""
    body = await json_body(request)
    if model is not None and isinstance(body, dict):
        body = {**body, "model": model}
    return await request.app.state.models.pick(body), body


def dumps(body) -> bytes:
    """JSON of a body whose vectors are numpy arrays as the server gave them: a float32 value
    in its shortest text that reads back as the same float32 (at most 9 significant digits, as
    TEI writes them, where a Python float's repr takes 17), written by orjson in one pass."""
    return orjson.dumps(
        body, default=_plain, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
    )


def check_finite(body) -> None:
    """A body whose float arrays hold NaN or infinity (a model that overflowed: fp16 on a GPU
    without bf16) is refused with that said, where JSON would carry nulls in their place."""
    if isinstance(body, np.ndarray):
        if body.dtype.kind == "f" and not np.isfinite(body).all():
            raise APIError(BACKEND, "the model's output holds NaN or infinity")
    elif isinstance(body, dict):
        for value in body.values():
            check_finite(value)
    elif isinstance(body, list | tuple):
        for value in body:
            check_finite(value)


def _plain(value):
    """What orjson leaves to us: arrays that are not C-contiguous (a copy that is)."""
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


class VectorResponse(JSONResponse):
    """A JSON response rendered by `dumps`, refused where that wrote a NaN or an infinity as
    null (check_finite walks the body only where the text holds a null)."""

    def render(self, content) -> bytes:
        text = dumps(content)
        if b"null" in text:
            check_finite(content)
        return text


async def respond(
    gw: Gateway, body, headers: dict | None = None, adapter: str | None = None
) -> JSONResponse:
    """An embedding response, with the model fingerprint header when the model publishes one
    (with the request's `adapter`, that adapter's)."""
    return VectorResponse(body, headers=await _with_fingerprint(gw, headers, adapter))


async def respond_bytes(
    gw: Gateway, content: bytes, headers: dict | None = None, adapter: str | None = None
) -> Response:
    """A binary embedding response (vLLM's `bytes` formats), fingerprinted as `respond`'s."""
    headers = await _with_fingerprint(gw, headers, adapter)
    return Response(content, media_type="application/octet-stream", headers=headers)


def answered_adapter(gw: Gateway, answer: dict) -> str | None:
    """The adapter an embeddings answer came from: the model it names, where that is none of
    the served names (openai.embeddings_body names the request's adapter)."""
    return None if answer["model"] in gw.model_names else answer["model"]


async def _with_fingerprint(gw: Gateway, headers: dict | None, adapter: str | None) -> dict:
    facts = await gw.facts()
    if adapter is None:
        fingerprint = facts.get("fingerprint")
    else:
        fingerprint = facts.get("adapter_fingerprints", {}).get(adapter)
    headers = dict(headers or {})
    if fingerprint:
        headers[FINGERPRINT_HEADER] = fingerprint
    return headers
