"""The gateway's application: the state every handler shares, the API routers, main().

python -m qwen_embed_client.gateway --triton-url localhost:8001 [--triton-url ...]
    [--host 127.0.0.1] [--port 8080] [--model-name embed] [--rerank-model-name rerank]
    [--api-key KEY | $QWEN_EMBED_API_KEY] [--otlp-endpoint URL | $OTEL_EXPORTER_OTLP_ENDPOINT]
"""

from __future__ import annotations

import argparse
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..client import AsyncEmbeddingClient
from . import cohere, openai, tei
from .errors import APIError
from .state import Gateway

# The renderer of each API's errors, by the tag of the router that served the request.
_RENDERERS = {
    "openai": openai.error_response,
    "tei": tei.error_response,
    "cohere": cohere.error_response,
}


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    route = request.scope.get("route")
    tags = getattr(route, "tags", None) or ["openai"]
    api = getattr(e, "api", None) or tags[0]
    return _RENDERERS[api](e)


def create_app(
    triton_urls: list[str],
    *,
    model_name: str = "embed",
    api_key: str | None = None,
    triton_model: str = "embed",
    rerank_model_name: str | None = "rerank",
    triton_rerank_model: str = "rerank",
    otlp_endpoint: str | None = None,
) -> FastAPI:
    client = AsyncEmbeddingClient(
        triton_urls, protocol="grpc", model=triton_model, rerank_model=triton_rerank_model
    )
    tracing = None
    if otlp_endpoint:
        from ..tracing import Tracing

        tracing = Tracing(otlp_endpoint)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await client.close()
        if tracing is not None:
            tracing.shutdown()

    app = FastAPI(title="qwen-embed gateway (OpenAI, TEI and Cohere APIs)", lifespan=lifespan)
    app.state.gateway = Gateway(
        client=client,
        model_name=model_name,
        api_key=api_key,
        rerank_model_name=rerank_model_name,
        triton_rerank_model=triton_rerank_model,
        tracing=tracing,
    )
    app.add_exception_handler(APIError, _api_error)
    if tracing is not None:
        app.middleware("http")(_traced(tracing))
    app.get("/health")(_health)
    for api in (openai, cohere, tei):  # tei last: its POST / and /rerank dispatch by body
        app.include_router(api.router)
    return app


async def _health():
    return {"status": "ok"}


def _traced(tracing):
    async def trace(request: Request, call_next):
        path = request.url.path
        if path == "/health":  # probes, not traffic
            return await call_next(request)
        with tracing.request_span(request.method, path, request.headers) as span:
            response = await call_next(request)
            span.set_attribute("http.response.status_code", response.status_code)
            return response

    return trace


def main() -> None:
    p = argparse.ArgumentParser(description="OpenAI-, TEI- and Cohere-compatible gateway")
    p.add_argument("--triton-url", action="append", help="Triton gRPC address, repeatable")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--model-name", default="embed", help="model id clients send")
    p.add_argument(
        "--rerank-model-name",
        default="rerank",
        help="model id /v1/rerank clients send ('' turns the rerank routes off)",
    )
    p.add_argument("--api-key", default=os.environ.get("QWEN_EMBED_API_KEY"))
    p.add_argument(
        "--otlp-endpoint",
        default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        help="OTLP/HTTP collector base URL (/v1/traces is appended): trace every request",
    )
    args = p.parse_args()
    import uvicorn

    app = create_app(
        args.triton_url or ["localhost:8001"],
        model_name=args.model_name,
        api_key=args.api_key or None,
        rerank_model_name=args.rerank_model_name or None,
        otlp_endpoint=args.otlp_endpoint or None,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
