"""OpenTelemetry traces for the gateway: one server span per HTTP request (continuing the
caller's trace when it sends a W3C `traceparent`), whose context goes on to Triton in the same
header, so Triton's own spans (ensemble, tokenizer, encoder) join the trace. Spans leave over
OTLP/HTTP in batches. Needs the `gateway` extra; imported only where tracing is asked for."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


def traces_url(endpoint: str) -> str:
    """An OTLP base URL (OTEL_EXPORTER_OTLP_ENDPOINT's meaning) -> its traces path."""
    return endpoint.rstrip("/") + "/v1/traces"


class Tracing:
    def __init__(self, endpoint: str, service_name: str = "qwen-embed-gateway"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        name = os.environ.get("OTEL_SERVICE_NAME") or service_name
        self._provider = TracerProvider(resource=Resource.create({"service.name": name}))
        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("qwen_embed_client.gateway")
        self._propagator = TraceContextTextMapPropagator()
        self._server_kind = SpanKind.SERVER

    @contextmanager
    def request_span(self, method: str, path: str, headers: Mapping[str, str]) -> Iterator:
        """The span of one HTTP request, current while the handler runs."""
        parent = self._propagator.extract(dict(headers))
        with self._tracer.start_as_current_span(
            f"{method} {path}",
            context=parent,
            kind=self._server_kind,
            attributes={"http.request.method": method, "url.path": path},
        ) as span:
            yield span

    def outgoing_headers(self) -> dict[str, str]:
        """`traceparent` (and `tracestate`) of the current span, for the Triton requests."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier)
        return carrier

    def set_attributes(self, **attributes) -> None:
        from opentelemetry import trace

        trace.get_current_span().set_attributes(attributes)

    def shutdown(self) -> None:
        """Export what is still queued."""
        self._provider.shutdown()
