"""The gateway's application: the state every handler shares, the API routers, main().

python -m qwen_embed_client.gateway --triton-url localhost:8001 [--triton-url ...]
    [--host 127.0.0.1] [--port 8080] [--served-model-name embed [ALIAS ...]]
    [--rerank-model-name rerank [ALIAS ...]] [--triton-model embed [ENSEMBLE[=NAME,...] ...]]
    [--triton-rerank-model rerank [ENSEMBLE[=NAME,...] ...]]
    [--api-key KEY | $QWEN_EMBED_API_KEY] [--api-keys-file JSON | $QWEN_EMBED_API_KEYS_FILE]
    [--otlp-endpoint URL | $OTEL_EXPORTER_OTLP_ENDPOINT]
    [--allow-remote-images] [--allowed-media-domains HOST ...]
    [--cors-allow-origin ORIGIN | $QWEN_EMBED_CORS_ALLOW_ORIGINS]
    [--ssl-certfile PEM --ssl-keyfile PEM | $QWEN_EMBED_SSL_CERTFILE, $QWEN_EMBED_SSL_KEYFILE]
    [--access-log | $QWEN_EMBED_ACCESS_LOG=1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..client import AsyncEmbeddingClient
from . import (
    azure,
    batches,
    cohere,
    gemini,
    mixedbread,
    multi_vector,
    nim,
    ollama,
    openai,
    perplexity,
    pooling,
    score,
    tei,
    voyage,
)
from .access_log import AccessLog
from .batches import BatchRunner, BatchSettings
from .deadlines import CallerWait
from .errors import INVALID, METHOD, ROUTE, APIError
from .keys import KeyRing, require_batch_key, require_key
from .metrics import GatewayMetrics
from .remote_media import RemoteMedia
from .served import Served, ServedModels
from .state import FINGERPRINT_HEADER, MAX_BODY_BYTES, Gateway

# The response headers the routes set that a page reads (a browser hides others from it):
# the model's fingerprint, vLLM's binary vectors' layout, TEI's token counts.
EXPOSED_HEADERS = (FINGERPRINT_HEADER, "metadata", *tei.TOKEN_HEADERS)

# The renderer of each API's errors, by the tag of the router that served the request.
_RENDERERS = {
    "openai": openai.error_response,
    "tei": tei.error_response,
    "cohere": cohere.error_response,
    "nim": openai.error_response,  # NIM's API is OpenAI's with more fields and routes
    "ollama": ollama.error_response,
    "jina": multi_vector.error_response,
    "gemini": gemini.error_response,
}


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    route = request.scope.get("route")
    tags = getattr(route, "tags", None) or ["openai"]
    api = e.api or tags[0]
    response = _RENDERERS[api](e)
    response.headers.update(e.headers)
    return response


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    """Starlette's own refusals (a path no route serves, a method the route does not take, a
    form it cannot parse) in the route's API's error shape, OpenAI's where no route matched,
    instead of Starlette's {"detail": ...}."""
    where = f"{request.method} {request.url.path}"
    if e.status_code == 404:
        error = APIError(ROUTE, f"Invalid URL ({where})")
    elif e.status_code == 405:
        error = APIError(METHOD, f"Not allowed to {where}")
    else:  # Starlette's other refusals are a body it cannot parse: 400s
        error = APIError(INVALID, str(e.detail))
    response = await _api_error(request, error)
    response.headers.update(e.headers or {})  # 405's Allow
    return response


def create_app(
    triton_urls: list[str],
    *,
    model_names: tuple[str, ...] = ("embed",),
    api_keys: tuple[str, ...] = (),
    api_keys_file: Path | None = None,
    triton_model: str = "embed",
    rerank_model_names: tuple[str, ...] = ("rerank",),
    triton_rerank_model: str = "rerank",
    more_models: tuple[Served, ...] = (),
    more_rerank_models: tuple[Served, ...] = (),
    otlp_endpoint: str | None = None,
    batch_dir: Path | None = None,
    batch_settings: BatchSettings | None = None,
    allow_remote_images: bool = False,
    allowed_media_domains: tuple[str, ...] = (),
    max_body_bytes: int = MAX_BODY_BYTES,
    cors_origins: tuple[str, ...] = (),
    access_log: bool = False,
) -> FastAPI:
    """The gateway of the ensemble `triton_model` (served as `model_names`) and the reranking
    one `triton_rerank_model` (as `rerank_model_names`), each answering requests that name no
    model, and of `more_models` and `more_rerank_models` (served.ServedModels: a request's
    `model` picks); `batch_dir` None turns the Batch API off; `allow_remote_images`: fetch
    http(s) media URLs of hosts at public addresses, `allowed_media_domains`: of those hosts
    only, wherever they are (neither: only data URLs are taken); `max_body_bytes`: the largest JSON
    body read; `cors_origins`: the origins whose pages may call it from a browser ("*": any;
    none: only same-origin pages); `access_log`: a JSON line per request on stdout;
    `api_keys`: keys that may use every model, `api_keys_file`: named keys with their models
    and limits (keys.py); neither: no key needed. A keys file that does not read, or names a
    model not served, raises ValueError."""

    def make_client(model: str, rerank_model: str) -> AsyncEmbeddingClient:
        return AsyncEmbeddingClient(
            triton_urls, protocol="grpc", model=model, rerank_model=rerank_model
        )

    tracing = None
    if otlp_endpoint:
        from ..tracing import Tracing

        tracing = Tracing(otlp_endpoint)

    @asynccontextmanager
    async def lifespan(app):
        runner = app.state.batches
        task = None if runner is None else asyncio.create_task(runner.run_forever())
        yield
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            runner.close()
        await app.state.models.close()
        if tracing is not None:
            tracing.shutdown()

    app = FastAPI(
        title="qwen-embed gateway (OpenAI, NIM, Jina, Perplexity, Ollama, TEI and Cohere APIs)",
        lifespan=lifespan,
    )
    app.state.gateway = Gateway(
        client=make_client(triton_model, triton_rerank_model),
        model_names=tuple(model_names),
        rerank_model_names=tuple(rerank_model_names),
        triton_rerank_model=triton_rerank_model,
        tracing=tracing,
        remote_media=(
            RemoteMedia(frozenset(d.lower() for d in allowed_media_domains))
            if allow_remote_images or allowed_media_domains
            else None
        ),
        max_body_bytes=max_body_bytes,
    )
    app.state.models = ServedModels(
        app.state.gateway, make_client, tuple(more_models), tuple(more_rerank_models)
    )
    app.state.keys = KeyRing(tuple(api_keys), api_keys_file, app.state.models.ensembles())
    metrics = GatewayMetrics()
    app.state.batches = None
    if batch_dir is not None:
        settings = batch_settings or BatchSettings()
        app.state.batches = BatchRunner(
            app.state.models, Path(batch_dir), settings, metrics, app.state.keys
        )
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    if tracing is not None:
        app.middleware("http")(_traced(tracing))
    # /metrics carries no key
    metrics.install(app, app.state.keys, AccessLog() if access_log else None)
    if cors_origins:  # a preflight carries no key: answered here, before any route
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],  # Authorization and the SDKs' own headers
            expose_headers=list(EXPOSED_HEADERS),
            max_age=600,
        )
    app.add_middleware(CallerWait)  # outermost: a cancelled handler is counted as such
    app.get("/health")(_health)  # probes carry no key
    app.get("/v1/health/live")(nim.live)
    app.get("/v1/health/ready")(nim.ready)
    # tei last: POST / and /rerank go by body
    for api in (
        openai,
        azure,
        nim,
        perplexity,
        voyage,
        mixedbread,
        multi_vector,
        pooling,
        score,
        batches,
        cohere,
        gemini,
        ollama,
        tei,
    ):
        app.include_router(api.router, dependencies=[_key_check(api.router)])
    for router in azure.V1_ROUTERS:  # Azure's v1 API: OpenAI's routes under /openai
        app.include_router(router, prefix=azure.V1_PREFIX, dependencies=[_key_check(router)])
    return app


def _key_check(router):
    return Depends(require_batch_key if router is batches.router else require_key)


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
    p = argparse.ArgumentParser(
        description="OpenAI-, NIM-, Jina-, Perplexity-, Voyage-, Mixedbread-, Gemini-, Ollama-, "
        "TEI- and Cohere-compatible gateway"
    )
    p.add_argument("--triton-url", action="append", help="Triton gRPC address, repeatable")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--served-model-name",
        "--model-name",
        dest="model_names",
        nargs="+",
        help="the first embed model's ids clients send, one or more (default: embed): the first "
        "is the one responses name, any is taken (/v1/models lists each)",
    )
    p.add_argument(
        "--rerank-model-name",
        dest="rerank_model_names",
        nargs="+",
        help="the first reranker's ids clients send, as --served-model-name's (default: rerank; "
        "'' turns it off)",
    )
    p.add_argument(
        "--triton-model",
        nargs="+",
        action="extend",
        metavar="ENSEMBLE[=NAME,...]",
        help="the Triton ensembles the embed routes ask (default: embed): the first answers "
        "requests that name no model, under --served-model-name's ids; each other is the one "
        "whose ids (its NAMEs, else its own name) a request's model names",
    )
    p.add_argument(
        "--triton-rerank-model",
        nargs="+",
        action="extend",
        metavar="ENSEMBLE[=NAME,...]",
        help="the Triton ensembles the rerank routes ask (default: rerank), as --triton-model's: "
        "a reranker's, or an embedder's whose deployment names its rerank_recipe",
    )
    p.add_argument(
        "--api-key",
        action="append",
        help="a key clients must send as 'Authorization: Bearer KEY', repeatable "
        "(default: $QWEN_EMBED_API_KEY, comma separated); each key sees its own batches",
    )
    p.add_argument(
        "--api-keys-file",
        default=os.environ.get("QWEN_EMBED_API_KEYS_FILE") or None,
        metavar="JSON",
        help="named keys, each with the models it may use, its requests and tokens per minute, "
        "requests in flight and priority, read again when the file changes "
        "($QWEN_EMBED_API_KEYS_FILE, which reaches the gateway the launcher starts)",
    )
    p.add_argument(
        "--batch-dir",
        default=os.environ.get("QWEN_EMBED_BATCH_DIR", "batches"),
        help="where the Batch API keeps its files and state, created on its first use "
        "($QWEN_EMBED_BATCH_DIR; '' turns the Batch API off)",
    )
    defaults = BatchSettings()
    p.add_argument("--batch-max-file-bytes", type=int, default=defaults.max_file_bytes)
    p.add_argument("--batch-max-lines", type=int, default=defaults.max_lines)
    p.add_argument("--batch-max-line-bytes", type=int, default=defaults.max_line_bytes)
    p.add_argument(
        "--batch-texts-in-flight",
        type=int,
        default=defaults.texts_in_flight,
        help="texts of batch lines sent at once (more: faster batches, slower interactive "
        "requests)",
    )
    p.add_argument(
        "--batch-shard-lines",
        type=int,
        default=defaults.shard_lines,
        help="lines answered together, and redone after a restart",
    )
    p.add_argument(
        "--allow-remote-images",
        action="store_true",
        help="fetch http(s) image and video URLs in requests (a multimodal model) from hosts "
        "at public addresses; otherwise media come as data URLs only",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        metavar="HOST",
        default=[],
        help="fetch media URLs from these hosts only (their names as URLs write them), "
        "wherever they are (an internal image store)",
    )
    p.add_argument(
        "--cors-allow-origin",
        action="append",
        metavar="ORIGIN",
        help="an origin whose pages may call the gateway from a browser (https://app.example, "
        "or '*' for any), repeatable (default: $QWEN_EMBED_CORS_ALLOW_ORIGINS, comma "
        "separated, which reaches the gateway the launcher starts; none: no cross-origin calls)",
    )
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=float(os.environ.get("QWEN_EMBED_MAX_BODY_MB", MAX_BODY_BYTES / 2**20)),
        help="the largest JSON request body in MiB ($QWEN_EMBED_MAX_BODY_MB, which reaches the "
        "gateway the launcher starts); a larger one is answered 413 unread (Batch API uploads "
        "have their own limits)",
    )
    p.add_argument(
        "--ssl-certfile",
        default=os.environ.get("QWEN_EMBED_SSL_CERTFILE") or None,
        metavar="PEM",
        help="serve HTTPS: the gateway's certificate chain, PEM ($QWEN_EMBED_SSL_CERTFILE, "
        "which reaches the gateway the launcher starts)",
    )
    p.add_argument(
        "--ssl-keyfile",
        default=os.environ.get("QWEN_EMBED_SSL_KEYFILE") or None,
        metavar="PEM",
        help="its private key, PEM ($QWEN_EMBED_SSL_KEYFILE)",
    )
    p.add_argument(
        "--access-log",
        action="store_true",
        default=os.environ.get("QWEN_EMBED_ACCESS_LOG", "") not in ("", "0"),
        help="write a JSON line per request on stdout: client, key owner, route, status, "
        "seconds, the tokens each model ran ($QWEN_EMBED_ACCESS_LOG=1, which reaches the "
        "gateway the launcher starts)",
    )
    p.add_argument(
        "--otlp-endpoint",
        default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        help="OTLP/HTTP collector base URL (/v1/traces is appended): trace every request",
    )
    args = p.parse_args()
    tls = _tls_files(p, args.ssl_certfile, args.ssl_keyfile)
    embed, *more_models = _served(p, "", args.triton_model, args.model_names)
    rerank, *more_rerank_models = _served(
        p, "rerank", args.triton_rerank_model, args.rerank_model_names
    )
    import uvicorn

    try:
        app = create_app(
            args.triton_url or ["localhost:8001"],
            model_names=embed.names,
            api_keys=tuple(args.api_key or _env_list("QWEN_EMBED_API_KEY")),
            api_keys_file=Path(args.api_keys_file) if args.api_keys_file else None,
            triton_model=embed.triton_model,
            rerank_model_names=tuple(name for name in rerank.names if name),
            triton_rerank_model=rerank.triton_model,
            more_models=tuple(more_models),
            more_rerank_models=tuple(more_rerank_models),
            otlp_endpoint=args.otlp_endpoint or None,
            allow_remote_images=args.allow_remote_images,
            allowed_media_domains=tuple(args.allowed_media_domains),
            max_body_bytes=int(args.max_body_mb * 2**20),
            cors_origins=tuple(
                args.cors_allow_origin or _env_list("QWEN_EMBED_CORS_ALLOW_ORIGINS")
            ),
            access_log=args.access_log,
            batch_dir=Path(args.batch_dir) if args.batch_dir else None,
            batch_settings=BatchSettings(
                max_file_bytes=args.batch_max_file_bytes,
                max_lines=args.batch_max_lines,
                max_line_bytes=args.batch_max_line_bytes,
                shard_lines=args.batch_shard_lines,
                texts_in_flight=args.batch_texts_in_flight,
            ),
        )
    except ValueError as e:  # a name given to two models, a keys file that does not read
        p.error(str(e))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", **tls)


def _served(parser, flag: str, ensembles: list[str] | None, names: list[str] | None) -> list:
    """--triton-model's (flag "") or --triton-rerank-model's (flag "rerank") ensembles as
    served.Served, the first under --served-model-name's (--rerank-model-name's) names where it
    names none of its own (default: embed, rerank)."""
    default = flag or "embed"
    models_flag = f"--triton-{flag + '-' if flag else ''}model"
    names_flag = f"--{flag}-model-name" if flag else "--served-model-name"
    ensembles = ensembles or [default]
    try:
        served = [Served.parse(text) for text in ensembles]
    except ValueError as e:
        parser.error(f"{models_flag} {e}")
    if "=" not in ensembles[0]:
        served[0] = Served(served[0].triton_model, tuple(names or [default]))
    elif names:
        parser.error(f"{models_flag} {ensembles[0]} names the first model, as {names_flag} does")
    return served  # a name given to two models: served.ServedModels refuses it


def _tls_files(parser, certfile: str | None, keyfile: str | None) -> dict:
    """uvicorn's TLS arguments, the files checked first: one without the other, or a pair
    TLS cannot use, stops the gateway with one line naming them (not a traceback later)."""
    if not certfile and not keyfile:
        return {}
    if not (certfile and keyfile):
        parser.error("--ssl-certfile and --ssl-keyfile go together")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as e:
        parser.error(f"--ssl-certfile {certfile} with --ssl-keyfile {keyfile}: {e}")
    return {"ssl_certfile": certfile, "ssl_keyfile": keyfile}


def _env_list(name: str) -> list[str]:
    """A comma-separated list in the environment variable `name`."""
    return [k.strip() for k in os.environ.get(name, "").split(",") if k.strip()]
