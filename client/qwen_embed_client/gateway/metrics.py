"""The gateway's own Prometheus metrics, at GET /metrics: what Triton's metrics port cannot
see, the HTTP requests themselves, refused ones included (a 400 from the contract check, a
401, a 413 never reach Triton), by route, API and status, with their durations.

One registry per app, so that apps made in one process (tests) count apart. /metrics carries
no key, as Triton's metrics port: bind or firewall it as that one.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# From one-text queries on a GPU to 2,048-text requests on a CPU.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
UNCOUNTED = ("/metrics", "/health")  # scrapes and probes, not traffic


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "qwen_embed_gateway_requests",
            "HTTP requests answered, by route template, API and status code",
            ("route", "api", "status"),
            registry=self.registry,
        )
        self.seconds = Histogram(
            "qwen_embed_gateway_request_duration_seconds",
            "Time from a request's arrival to its response, by route template",
            ("route",),
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "qwen_embed_gateway_requests_in_flight",
            "HTTP requests received and not yet answered",
            registry=self.registry,
        )

    def install(self, app: FastAPI) -> None:
        """Count every request but scrapes and probes; serve GET /metrics."""

        async def measure(request: Request, call_next):
            if request.url.path in UNCOUNTED:
                return await call_next(request)
            start = time.perf_counter()
            self.in_flight.inc()
            status = 500  # an exception no handler answered
            try:
                response = await call_next(request)
                status = response.status_code
                return response
            finally:
                self.in_flight.dec()
                # the template, not the path: a path per model id or batch id would make a
                # series per value
                route = request.scope.get("route")
                template = getattr(route, "path", "unmatched")
                api = (getattr(route, "tags", None) or ["none"])[0]
                self.requests.labels(template, api, str(status)).inc()
                self.seconds.labels(template).observe(time.perf_counter() - start)

        app.middleware("http")(measure)

        @app.get("/metrics", include_in_schema=False)
        async def metrics() -> Response:
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
