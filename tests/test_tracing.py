"""OpenTelemetry traces (launcher --otlp-endpoint) received by a local OTLP/HTTP collector
(otlp_receiver.py): the gateway's span per HTTP request continues the caller's trace, and
Triton's spans for the ensemble and each step join it through the propagated context."""

import json
import time
import urllib.request

import pytest

from qwen_embed_deploy.launcher import trace_args
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.triton import TritonServer, free_port

from otlp_receiver import OTLPReceiver
from triton_helpers import infer, wait_until

pytestmark = pytest.mark.server  # starts tritonserver or other processes

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


def test_trace_flags():
    assert trace_args(None, 1) == []
    assert trace_args("http://collector:4318/", 10) == [
        "--trace-config=mode=opentelemetry",
        "--trace-config=level=TIMESTAMPS",
        "--trace-config=rate=10",
        "--trace-config=count=-1",
        "--trace-config=opentelemetry,url=http://collector:4318/v1/traces",
        "--trace-config=opentelemetry,resource=service.name=qwen-embed-triton",
    ]
    with pytest.raises(ValueError, match="--trace-rate"):
        trace_args("http://collector:4318", -1)


@pytest.fixture(scope="module")
def traced(demo_dir, tmp_path_factory):
    where = tmp_path_factory.mktemp("tracing")
    repo = render(where / "repo", {"embed": demo_dir}, {"encoder": {"dtype": "float32"}})
    port = free_port()
    with OTLPReceiver() as receiver:
        args = ["--otlp-endpoint", receiver.endpoint, "--gateway-port", str(port), "--no-rerank"]
        env = {"OTEL_BSP_SCHEDULE_DELAY": "200"}  # export within a fraction of a second
        with TritonServer(repo, log_path=where / "server.log", launcher_args=args, env=env) as s:
            wait_until(lambda: _healthy(port), "the gateway to answer")
            yield s, f"http://127.0.0.1:{port}", receiver


def _healthy(port) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
            return True
    except OSError:
        return False


def _trace(receiver, trace_id, services):
    """The spans of one trace, once every service in `services` has sent its share."""
    spans = []

    def complete():
        spans[:] = [s for s in receiver.received() if s.trace_id == trace_id]
        models = {s.attributes.get("triton.model_name") for s in spans}
        return {s.service for s in spans} >= services and {
            "embed",
            "tokenizer",
            "encoder",
        } <= models

    wait_until(complete, f"trace {trace_id} from {services}", timeout=60)
    time.sleep(0.5)  # the rest of a batch that was on its way
    return [s for s in receiver.received() if s.trace_id == trace_id]


def test_gateway_request_is_one_trace_through_triton(traced):
    server, base, receiver = traced
    body = json.dumps({"model": "embed", "input": ["Hello, world!", "Gravity."]}).encode()
    request = urllib.request.Request(
        f"{base}/v1/embeddings",
        data=body,
        headers={
            "Content-Type": "application/json",
            "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01",
        },
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        assert len(json.load(r)["data"]) == 2
    spans = _trace(receiver, CALLER_TRACE, {"qwen-embed-gateway", "qwen-embed-triton"})
    (gateway,) = [s for s in spans if s.service == "qwen-embed-gateway"]
    assert gateway.name == "POST /v1/embeddings" and gateway.parent_id == CALLER_SPAN
    assert gateway.attributes["http.response.status_code"] == 200
    assert gateway.attributes["qwen_embed.inputs"] == 2
    by_id = {s.span_id: s for s in spans}

    def ancestors(span):
        while span.parent_id in by_id:
            span = by_id[span.parent_id]
            yield span

    triton = [s for s in spans if s.service == "qwen-embed-triton"]
    # Every Triton span hangs under the gateway's, and each step's under the ensemble's.
    for span in triton:
        assert span.parent_id == gateway.span_id or gateway in ancestors(span), span
    model_spans = {
        s.attributes["triton.model_name"]: s for s in triton if "triton.model_name" in s.attributes
    }
    for step in ("tokenizer", "encoder"):
        assert model_spans["embed"] in ancestors(model_spans[step])
    # The encoder's span carries Triton's queue and compute timestamps.
    timeline = {e for s in triton for e in s.events}
    assert {"QUEUE_START", "COMPUTE_START", "COMPUTE_END"} <= timeline


def test_direct_requests_are_traced_too(traced):
    """rate 1: a request without a trace context starts a trace of its own in Triton."""
    server, _, receiver = traced
    before = {s.trace_id for s in receiver.received()}
    infer(server, ["traced alone"], "grpc")
    wait_until(
        lambda: any(
            s.trace_id not in before and s.attributes.get("triton.model_name") == "encoder"
            for s in receiver.received()
        ),
        "a new trace with the encoder's span",
        timeout=60,
    )
