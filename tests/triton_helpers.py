"""Plain tritonclient calls to a test server: what every serving test compares against; and
odd request bodies for the contract at the HTTP edge."""

import http.server
import json
import math
import os
import random
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from qwen_embed_deploy.triton import free_port, scrape

# What Triton exports on GPU hosts only, which the dashboard's GPU panels read
# (test_dashboards.py; test_gpu_serving.py checks them on a GPU).
GPU_ONLY_SERIES = ("nv_gpu_utilization", "nv_gpu_memory_used_bytes")


def text_input(module, texts):
    arr = np.array([[t if isinstance(t, bytes) else t.encode()] for t in texts], dtype=object)
    inp = module.InferInput("TEXT", list(arr.shape) if arr.size else [0, 1], "BYTES")
    inp.set_data_from_numpy(arr.reshape(-1, 1))
    return inp


def infer(server, texts, protocol="http", model="embed", **params):
    """One request to `model`; returns (EMBEDDING [n, dim], TOKEN_COUNT [n, 1])."""
    if protocol == "http":
        client = httpclient.InferenceServerClient(server.http_url, network_timeout=300)
        module = httpclient
    else:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        module = grpcclient
    result = client.infer(model, [text_input(module, texts)], parameters=params or None)
    return result.as_numpy("EMBEDDING"), result.as_numpy("TOKEN_COUNT")


def copies_busy_for(seconds, send_one) -> int:
    """How many distinct copies of a long request keep the server busy about `seconds` on this
    machine: one copy is timed first (the CPU kinds these tests run on differ several-fold)."""
    start = time.monotonic()
    send_one()
    return max(2, math.ceil(seconds / max(time.monotonic() - start, 1e-3)))


EXECUTING = "qwen_embed_executing_requests"


def encoder_input(id_lists):
    """TOKEN_IDS of a request straight to `encoder`: each list of ids packed as int32."""
    inp = grpcclient.InferInput("TOKEN_IDS", [len(id_lists), 1], "BYTES")
    inp.set_data_from_numpy(np.array([[np.array(x, "<i4").tobytes()] for x in id_lists], object))
    return inp


@dataclass
class BusyEncoder:
    texts: int  # what it had the encoder embed: the long request and the copy that timed it
    thread: threading.Thread  # sending it, alive until it is answered


@contextmanager
def encoder_kept_busy(server, seconds: float):
    """A long request straight to `encoder`, executing when the body starts and for about
    `seconds` on this machine (copies_busy_for); on leaving, waits until the encoder has
    answered it and holds no request, executing or queued."""

    def send(copies, first):  # distinct ids: no shared prefix makes a copy free
        ids = [list(range(first + i, first + i + 5000)) for i in range(copies)]
        grpcclient.InferenceServerClient(server.grpc_url).infer("encoder", [encoder_input(ids)])

    copies = copies_busy_for(seconds, lambda: send(1, 100))
    busy = threading.Thread(target=send, args=(copies, 1000))
    busy.start()
    wait_until(lambda: server.metric(EXECUTING) >= 1, "the long request inside the encoder")
    try:
        yield BusyEncoder(copies + 1, busy)
    finally:
        busy.join(timeout=120)
        wait_until(
            lambda: (
                server.metric(EXECUTING) == 0
                and server.metric("nv_inference_pending_request_count", model="encoder") == 0
            ),
            "the encoder to hold no request",
        )


def run_clients(count, target):
    """`target(i)` in `count` threads at once; the first exception is raised here."""
    errors = []

    def wrapped(i):
        try:
            target(i)
        except Exception as e:  # collected and re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    if errors:
        raise errors[0]


def wait_until(condition, what: str, timeout: float = 120.0, log: Path | None = None) -> None:
    """Poll `condition` until it holds (the timeout only stops a hang; it is not a check). On
    giving up, the end of `log` (a server's) says what the server was doing."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log else ""
            pytest.fail(f"gave up after {timeout:.0f} s waiting for {what}\n{tail}".rstrip())
        time.sleep(0.05)


def wait_for(url: str, timeout: float = 60, context: ssl.SSLContext | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2, context=context)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


@contextmanager
def file_server(content: bytes, tls: ssl.SSLContext | None = None):
    """A web server on 127.0.0.1 (HTTPS with `tls`, a server's context) answering every GET
    with `content`, but /to/URL with a redirect to URL; yields (its port, the paths asked)."""
    asked = []

    class Files(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            if self.path.startswith("/to/"):
                self.send_response(302)
                self.send_header("Location", self.path.removeprefix("/to/"))
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], asked
    finally:
        server.shutdown()


@contextmanager
def gateway_process(
    server,
    *args: str,
    env: dict[str, str] | None = None,
    tls: ssl.SSLContext | None = None,
    stdout: Path | None = None,
):
    """The gateway as its own process in front of `server`, as production runs it (`args`: its
    options; `env`: added to its environment; `tls`: it serves HTTPS, and this context trusts
    its certificate; `stdout`: the file its output goes to); yields its base URL once /health
    answers."""
    port = free_port()
    out = open(stdout, "ab") if stdout is not None else None
    process = subprocess.Popen(
        [sys.executable, "-m", "qwen_embed_client.gateway", "--triton-url", server.grpc_url]
        + ["--port", str(port), *args],
        env={**os.environ, **(env or {})},
        stdout=out,
    )
    try:
        base = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        wait_for(f"{base}/health", context=tls)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=10)
        if out is not None:
            out.close()


def gateway_metrics(root: str) -> dict[str, float]:
    """The gateway's /metrics samples by name and labels (no key: scrapers carry none)."""
    samples = scrape(f"{root}/metrics")
    return {name + json.dumps(labels, sort_keys=True): value for name, labels, value in samples}


# What a client may send in place of any field: other types, empty, integers past 64 bits,
# a lone surrogate (JSON's escape "\\ud800", which no UTF-8 text holds), nesting, content parts
# on a text model.
ODD_VALUES = [None, True, 0, -1, 2**63, 2**64, -(2**70), 1.5, "", "x", "\u00e9", "\ud800"]
ODD_VALUES += [[], [None]]
ODD_VALUES += [[1, "a"], [[1], "b"], {}, {"text": 1}, [{"type": "image_url"}], "data:,AAAA"]


def odd_bodies(routes: dict, seed: int = 0, nested: int = 150) -> list[tuple[str, dict]]:
    """(path, body) for `routes` ({path: (a valid body, its fields)}): each field with each of
    ODD_VALUES, then `nested` seeded random bodies with one or two fields of nested odd
    values."""
    rng = random.Random(seed)

    def value(depth=0):
        if depth > 2 or rng.random() < 0.6:
            return rng.choice(ODD_VALUES)
        if rng.random() < 0.5:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(["text", "type", "image_url", "inputs"]): value(depth + 1)}

    bodies = [
        (path, {**body, field: odd})
        for path, (body, fields) in routes.items()
        for field in fields
        for odd in ODD_VALUES
    ]
    for _ in range(nested):
        path = rng.choice(sorted(routes))
        body, fields = routes[path]
        chosen = rng.sample(fields, rng.randint(1, min(2, len(fields))))
        bodies.append((path, {**body, **{f: value() for f in chosen}}))
    return bodies


def http_status(url: str, body: dict, headers: dict | None = None) -> int:
    """The HTTP status of POSTing `body` as JSON."""
    return post_json(url, body, headers)[0]


def post_json(url: str, body: dict, headers: dict | None = None, timeout: float = 60):
    """(status, the answer's JSON or None, its headers) of POSTing `body` as JSON (ASCII
    escapes: a lone surrogate travels as JSON writes it)."""
    return send_json("POST", url, body, headers, timeout)


def send_json(method: str, url: str, body=None, headers: dict | None = None, timeout: float = 60):
    """post_json's answer for any method; `body` None: none."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw, status, answered = response.read(), response.status, response.headers
    except urllib.error.HTTPError as e:
        raw, status, answered = e.read(), e.code, e.headers
    try:
        return status, json.loads(raw) if raw else None, dict(answered)
    except ValueError:  # not JSON (e.g. a plain-text 500)
        return status, None, dict(answered)
