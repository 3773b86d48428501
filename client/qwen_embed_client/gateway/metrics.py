"""The gateway's own Prometheus metrics, at GET /metrics: what Triton's metrics port cannot
see, the HTTP requests themselves, refused ones included (a 400 from the contract check, a
401, a 413 never reach Triton), by route, API, status, the Triton models they asked and the
named API key that asked (keys.py; "" for a plain key or none), with their durations, and the
tokens those models ran for each API and key (the Batch API's lines too); the Batch API's
lines by outcome and its batches by how they ended.
The same middleware holds each request to its key's models and limits (keys.py) and writes
the access log (access_log.py) where one is asked for.

One registry per app, so that apps made in one process (tests) count apart. /metrics carries
no key, as Triton's metrics port: bind or firewall it as that one.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ..client import guarded, metered
from .access_log import AccessLog
from .keys import KeyRing

# From one-text queries on a GPU to 2,048-text requests on a CPU.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
UNCOUNTED = ("/metrics", "/health")  # scrapes and probes, not traffic
CLIENT_CLOSED = 499  # nginx's status of a request whose client left before its answer
BATCH_LINE_OUTCOMES = ("completed", "failed")
BATCH_END_STATUSES = ("completed", "failed", "cancelled", "expired")


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "qwen_embed_gateway_requests",
            "HTTP requests answered, by route template, API, status code, the Triton "
            "models asked ('' where none was: refused before; several joined by '+') and the "
            "named API key ('' for a plain key or none)",
            ("route", "api", "status", "model", "key"),
            registry=self.registry,
        )
        self.seconds = Histogram(
            "qwen_embed_gateway_request_duration_seconds",
            "Time from a request's arrival to its response, by route template and the Triton "
            "models asked",
            ("route", "model"),
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "qwen_embed_gateway_tokens",
            "Tokens the Triton models ran for the gateway's answers (prompts, special tokens "
            "and media included), by Triton model, API (batch: the Batch API's lines) and "
            "named API key",
            ("model", "api", "key"),
            registry=self.registry,
        )
        # the Batch API's work, which no HTTP request carries (each label counted from 0)
        self.batch_lines = Counter(
            "qwen_embed_gateway_batch_lines",
            "Batch API lines answered, by outcome (completed: a 200 answer; failed: an error line)",
            ("outcome",),
            registry=self.registry,
        )
        self.batches = Counter(
            "qwen_embed_gateway_batches",
            "Batch API batches ended, by their final status",
            ("status",),
            registry=self.registry,
        )
        for outcome in BATCH_LINE_OUTCOMES:
            self.batch_lines.labels(outcome)
        for status in BATCH_END_STATUSES:
            self.batches.labels(status)
        self.in_flight = Gauge(
            "qwen_embed_gateway_requests_in_flight",
            "HTTP requests received and not yet answered",
            registry=self.registry,
        )

    def install(self, app: FastAPI, keys: KeyRing, access_log: AccessLog | None = None) -> None:
        """Count every request but scrapes and probes (and log it to `access_log`), each held
        to its key's models and limits; serve GET /metrics."""
        app.add_middleware(_Measured, metrics=self, keys=keys, access_log=access_log)

        @app.get("/metrics", include_in_schema=False)
        async def metrics() -> Response:
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    def count_tokens(self, usage: dict[str, int], api: str, key: str) -> None:
        for model, tokens in usage.items():
            if tokens:
                self.tokens.labels(model, api, key).inc(tokens)


class _Measured:
    """GatewayMetrics' count and time of each request, as plain ASGI middleware (Starlette's
    BaseHTTPMiddleware, behind app.middleware("http"), streams every response through a task
    group of its own: a tenth of the gateway's CPU per request)."""

    def __init__(self, app, metrics: GatewayMetrics, keys: KeyRing, access_log: AccessLog | None):
        self.app, self.metrics, self.keys, self.access_log = app, metrics, keys, access_log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in UNCOUNTED:
            return await self.app(scope, receive, send)
        m, start, status = self.metrics, time.perf_counter(), 500  # 500: no handler answered

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                limits = self.keys.headers(scope)
                if limits:
                    message = {**message, "headers": [*message.get("headers", ()), *limits]}
            await send(message)

        m.in_flight.inc()
        # the client's calls within add their models and tokens, and ask only the models the
        # request's key may use (found by the routers' dependency, keys.require_key)
        with metered() as usage, guarded(self.keys.request_guard(scope)):
            try:
                await self.app(scope, receive, send_status)
            except asyncio.CancelledError:
                status = CLIENT_CLOSED  # its caller disconnected before the answer (CallerWait)
                raise
            finally:
                m.in_flight.dec()
                seconds = time.perf_counter() - start
                # the template, not the path: a path per model id or batch id would make a
                # series per value
                route = scope.get("route")
                template = getattr(route, "path", "unmatched")
                api = (getattr(route, "tags", None) or ["none"])[0]
                model, key = "+".join(usage), self.keys.key_name(scope)
                m.requests.labels(template, api, str(status), model, key).inc()
                m.seconds.labels(template, model).observe(seconds)
                m.count_tokens(usage, api, key)
                self.keys.done(scope, usage)
                if self.access_log is not None:
                    self.access_log.write(scope, template, api, status, seconds, usage, key)
