"""A local OTLP/HTTP trace receiver for tests: what a collector would receive from the gateway
(opentelemetry-python's exporter: protobuf) and from tritonserver (opentelemetry-cpp's: OTLP/JSON),
decoded with the OTLP protobuf definitions (opentelemetry-proto)."""

from __future__ import annotations

import base64
import gzip
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    attributes: dict
    events: tuple[str, ...]


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _ids_to_base64(body: dict) -> dict:
    """OTLP/JSON writes trace and span ids in hex, where protobuf's JSON form has base64."""
    for resource_spans in body.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if span.get(key):
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return body


def decode(request: ExportTraceServiceRequest) -> list[Span]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(
                    Span(
                        service=str(resource.get("service.name", "")),
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        events=tuple(e.name for e in s.events),
                    )
                )
    return spans


class OTLPReceiver:
    """POST /v1/traces on a free local port; `spans` holds everything received."""

    def __init__(self):
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                if "json" in (self.headers.get("Content-Type") or ""):
                    json_format.ParseDict(_ids_to_base64(json.loads(body)), request)
                else:
                    request.ParseFromString(body)
                with receiver._lock:
                    receiver.spans.extend(decode(request))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        """The base URL, as OTEL_EXPORTER_OTLP_ENDPOINT takes it (/v1/traces appended)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def received(self) -> list[Span]:
        with self._lock:
            return list(self.spans)

    def __enter__(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
