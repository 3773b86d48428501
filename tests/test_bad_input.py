"""A battery of malformed requests, sent raw (no client-side checks) over HTTP and gRPC.

Each must get a 4xx-class answer whose message names the field or the limit; afterwards the
server must be ready and give the same vectors as before the battery.
"""

import json
import re
import struct
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from triton_helpers import infer

pytestmark = pytest.mark.server  # starts tritonserver or other processes

HTTP_4XX = range(400, 500)
GRPC_4XX = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
CHECK_TEXTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog."]


def bytes_tensor(items) -> bytes:
    """KServe's raw BYTES layout: each element as a 4-byte little-endian length, then data."""
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


@dataclass
class Case:
    id: str
    expect: str  # regex the error message must match
    inputs: list = field(default_factory=list)  # (name, datatype, shape, raw bytes)
    params: dict = field(default_factory=dict)
    model: str = "embed"
    version: str = ""
    # Triton 2.51's HTTP front end answers some JSON it cannot parse with 500, before any
    # model sees the request; those cases pin that status so a change shows up here.
    http_status: int | None = None


def text(*items, shape=None):
    items = [x if isinstance(x, bytes) else x.encode() for x in items]
    return ("TEXT", "BYTES", shape or [len(items), 1], bytes_tensor(items))


def ids(*lists):
    items = [np.asarray(x, "<i4").tobytes() if not isinstance(x, bytes) else x for x in lists]
    return ("TOKEN_IDS", "BYTES", [len(items), 1], bytes_tensor(items))


def chunks(values):
    """One text's CHUNKS element (serving.requests.pack_chunks's layout)."""
    return bytes_tensor([np.asarray(values, "<i4").tobytes()])


CASES = [
    Case("no inputs", r"expected .*inputs? .*but got 0"),  # TEXT (IMAGES is optional)
    Case(
        "wrong input name",
        r"unexpected inference input 'TEXTS'",
        [("TEXTS", "BYTES", [1, 1], bytes_tensor([b"x"]))],
    ),
    Case(
        "INT32 instead of BYTES",
        r"'TEXT'.*INT32.*BYTES|BYTES.*INT32",
        [("TEXT", "INT32", [1, 1], struct.pack("<i", 7))],
    ),
    Case(
        "FP32 instead of BYTES",
        r"'TEXT'.*FP32|FP32.*BYTES",
        [("TEXT", "FP32", [1, 1], struct.pack("<f", 1.0))],
    ),
    Case("one dimension", r"TEXT", [text("x", shape=[1])]),
    Case("three dimensions", r"TEXT", [text("x", shape=[1, 1, 1])]),
    Case("second dimension 2", r"TEXT", [text("x", "y", shape=[1, 2])]),
    Case("negative dimension", r"TEXT|shape|negative", [text("x", shape=[-1, 1])], http_status=500),
    Case("shape says 2, data holds 1", r"TEXT", [text("x", shape=[2, 1])]),
    Case(
        "truncated element", r"TEXT", [("TEXT", "BYTES", [1, 1], struct.pack("<I", 100) + b"short")]
    ),
    Case("zero texts", r"TEXT", [("TEXT", "BYTES", [0, 1], b"")]),
    Case("257 texts", r"257|256", [text(*["x"] * 257)]),
    Case("10 000 texts", r"10000|256", [text(*["x"] * 10_000)]),
    Case("invalid UTF-8", r"input 'TEXT\[1\]' is not valid UTF-8", [text("ok", b"\xff\xfe bad")]),
    Case("NUL byte", r"input 'TEXT\[0\]' contains a NUL", [text(b"nul\x00inside")]),
    Case("empty string", r"input 'TEXT\[1\]' is empty", [text("ok", "")]),
    Case("only whitespace", r"input 'TEXT\[0\]' is empty or only whitespace", [text(" \n\t ")]),
    Case(
        "1 MB text",
        r"input 'TEXT\[0\]' is 1048576 bytes, more than the limit of 262144",
        [text("a" * 1_048_576)],
    ),
    Case(
        "too many tokens, truncate=false",
        r"input 'TEXT\[0\]' has \d+ tokens, more than the "
        r"limit of 8192",
        [text(" the" * 9000)],
        {"truncate": False},
    ),
    Case(  # 3 x 6001 x 1024 float32: refused before any work
        "per_token answer past its limit",
        r"parameter 'per_token': 3 texts of up to 6001 tokens x 1024 dimensions are 70\.3 MiB "
        r"of float32, more than the 64 MiB one request may return; send fewer texts",
        [text(*[" the" * 6000] * 3)],
        {"per_token": True},
    ),
    Case(  # 40 texts x 490 chunks x 1024 float32
        "chunks answer past its limit",
        r"late chunking: 40 texts of up to 490 chunks x 1024 dimensions are 76\.6 MiB of "
        r"float32, more than the 64 MiB one request may return",
        [text(*[" the" * 490] * 40)],
        {"chunk_size": 1},
    ),
    Case(
        "dimensions 0",
        r"parameter 'dimensions' must be >= 1, got 0",
        [text("x")],
        {"dimensions": 0},
    ),
    Case(
        "negative dimensions",
        r"parameter 'dimensions' must be >= 1, got -5",
        [text("x")],
        {"dimensions": -5},
    ),
    Case(
        "huge dimensions",
        r"parameter 'dimensions' must be in 1\.\.1024, got 1000000000000",
        [text("x")],
        {"dimensions": 10**12},
    ),
    Case(
        "dimensions as string",
        r"parameter 'dimensions' must be an integer",
        [text("x")],
        {"dimensions": "8"},
    ),
    Case(
        "dimensions as float",
        r"parameter 'dimensions' must be an integer",
        [text("x")],
        {"dimensions": 8.5},
    ),
    Case(
        "dimensions as bool",
        r"parameter 'dimensions' must be an integer",
        [text("x")],
        {"dimensions": True},
    ),
    Case(
        "unknown embedding_type",
        r"parameter 'embedding_type' must be one of \['float', 'int8', 'uint8', 'binary', "
        r"'ubinary'\], or several of them separated by commas, got 'int4'",
        [text("x")],
        {"embedding_type": "int4"},
    ),
    Case("unknown option", r"unknown parameter\(s\) \['colour'\]", [text("x")], {"colour": "blue"}),
    Case(
        "truncate as string",
        r"parameter 'truncate' must be a boolean",
        [text("x")],
        {"truncate": "yes"},
    ),
    Case(
        "normalize as int",
        r"parameter 'normalize' must be a boolean",
        [text("x")],
        {"normalize": 1},
    ),
    Case(
        "unknown prompt_name",
        r"parameter 'prompt_name' must be one of",
        [text("x")],
        {"prompt_name": "passage"},
    ),
    Case(
        "empty instruction",
        r"parameter 'instruction' must not be empty",
        [text("x")],
        {"instruction": "  "},
    ),
    Case(
        "instruction as int",
        r"parameter 'instruction' must be a string",
        [text("x")],
        {"instruction": 5},
    ),
    Case(
        "chunk_by_separator as string",
        r"parameter 'chunk_by_separator' must be a boolean",
        [text("x")],
        {"chunk_by_separator": "yes"},
    ),
    Case(
        "chunk_by_separator without a separator",
        r"parameter 'chunk_by_separator' needs a model whose recipe joins .* send chunk_chars",
        [text("a<|endoftext|>b")],
        {"chunk_by_separator": True},
    ),
    Case(
        "chunk_by_separator and chunk_size",
        r"parameters \['chunk_size', 'chunk_by_separator'\] exclude each other",
        [text("x")],
        {"chunk_by_separator": True, "chunk_size": 4},
    ),
    Case(
        "chunk_spans nested past the JSON parser's depth",
        r"parameter 'chunk_spans' must be a JSON list of at most \d+ \[start, end\] token spans, "
        r"got "
        r"'\[\[\[.*\.\.\. \(100002 characters\)",
        [text("x")],
        {"chunk_spans": "[" * 50_000 + "]" * 50_000},
    ),
    Case("unknown model", r"unknown model|embedd", [text("x")], model="embedd"),
    Case("unknown version", r"version|embed", [text("x")], version="7"),
    Case(
        "encoder: ids not a multiple of 4 bytes",
        r"input 'TOKEN_IDS\[0\]' must be a non-empty packed int32 list",
        [ids(b"\x01\x02\x03")],
        model="encoder",
    ),
    Case(
        "encoder: id beyond the vocabulary",
        r"outside 0\.\.151668",
        [ids([5, 10**9])],
        model="encoder",
    ),
    Case("encoder: negative id", r"outside 0\.\.151668", [ids([-3, 5])], model="encoder"),
    Case(
        "encoder: FINISH dimensions past the model's",
        r"input 'FINISH' must hold \(dimensions in 0\.\.1024, normalize 0 or 1, embedding "
        r"types as bits in 1\.\.31, per_token 0 or 1, skiplist 0 or per_token\), "
        r"got \(5000, 1, 1, 0, 0\)",
        [ids([5, 6]), ("FINISH", "INT32", [1, 5], np.array([[5000, 1, 1, 0, 0]], "<i4").tobytes())],
        model="encoder",
    ),
    Case(
        "encoder: CHUNKS not (tail, start, end, ...)",
        r"input 'CHUNKS\[0\]' must be packed int32 \(tail, start, end, \.\.\.\)",
        [ids([5, 6]), ("CHUNKS", "BYTES", [1, 1], chunks([1, 0]))],
        model="encoder",
    ),
    # Triton passes a request without a required input on to a model that has optional ones
    Case(
        "tokenizer: IMAGES without TEXT",
        r"input 'TEXT' is required",
        [("IMAGES", "BYTES", [1, 1], bytes_tensor([b""]))],
        model="tokenizer",
    ),
    Case(
        "encoder: FINISH without TOKEN_IDS",
        r"input 'TOKEN_IDS' is required",
        [("FINISH", "INT32", [1, 5], np.array([[0, 1, 1, 0, 0]], "<i4").tobytes())],
        model="encoder",
    ),
    Case(
        "rerank_tokenizer: QUERY without DOCUMENTS",
        r"input 'DOCUMENTS' is required",
        [
            ("QUERY", "BYTES", [1], bytes_tensor([b"q"])),
            ("QUERY_IMAGES", "BYTES", [1], bytes_tensor([b""])),
        ],
        model="rerank_tokenizer",
    ),
    Case(
        "rerank_tokenizer: DOCUMENTS without QUERY",
        r"input 'QUERY' is required",
        [
            ("DOCUMENTS", "BYTES", [1, 1], bytes_tensor([b"d"])),
            ("DOCUMENT_IMAGES", "BYTES", [1, 1], bytes_tensor([b""])),
        ],
        model="rerank_tokenizer",
    ),
    Case(
        "rerank_encoder: ADAPTER without TOKEN_IDS",
        r"input 'TOKEN_IDS' is required",
        [("ADAPTER", "BYTES", [1, 1], bytes_tensor([b""]))],
        model="rerank_encoder",
    ),
    Case(
        "encoder: CHUNKS span past the text",
        r"chunks\[0\]\[0\] = \(0, 5\): a span must have 0 <= start < end <= 1",
        [ids([5, 6]), ("CHUNKS", "BYTES", [1, 1], chunks([1, 0, 5]))],
        model="encoder",
    ),
]


def send_http(server, case):
    """POST with the binary tensor extension, so any bytes (and lying shapes) can be sent."""
    header = {
        "inputs": [
            {"name": n, "datatype": d, "shape": s, "parameters": {"binary_data_size": len(raw)}}
            for n, d, s, raw in case.inputs
        ]
    }
    if case.params:
        header["parameters"] = case.params
    head = json.dumps(header).encode()
    version = f"/versions/{case.version}" if case.version else ""
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{case.model}{version}/infer",
        data=head + b"".join(raw for *_, raw in case.inputs),
        headers={
            "Inference-Header-Content-Length": str(len(head)),
            "Content-Type": "application/octet-stream",
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, r.read()[:200].decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()).get("error", "")


def send_grpc(server, case):
    request = service_pb2.ModelInferRequest(model_name=case.model, model_version=case.version)
    for name, datatype, shape, raw in case.inputs:
        tensor = request.inputs.add(name=name, datatype=datatype)
        tensor.shape.extend(shape)
        request.raw_input_contents.append(raw)
    for key, value in case.params.items():
        kind = {bool: "bool_param", int: "int64_param", str: "string_param", float: "double_param"}[
            type(value)
        ]
        setattr(request.parameters[key], kind, value)
    with grpc.insecure_channel(server.grpc_url) as channel:
        try:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=120)
            return "OK", ""
        except grpc.RpcError as e:
            return e.code(), e.details()


@pytest.fixture(scope="module")
def before(server):
    return infer(server, CHECK_TEXTS, "grpc")[0]


def test_battery_is_big_enough():
    assert len(CASES) >= 25


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_request_gets_a_clear_4xx(server, before, protocol, case):
    if protocol == "http":
        status, message = send_http(server, case)
        assert status in ([case.http_status] if case.http_status else HTTP_4XX), (status, message)
    else:
        status, message = send_grpc(server, case)
        assert status in GRPC_4XX, (status, message)
    assert re.search(case.expect, message), message


JSON_BODIES = [  # (body, status, message): the HTTP-only malformations
    (b"{not json", 500, "failed to parse the request JSON"),
    (b'{"inputs": "TEXT"}', 500, "Unable to parse 'inputs'"),
    (b'{"inputs": [{"name": "TEXT"}]}', 400, "Input must set only one of"),
    (
        b'{"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [5]}]}',
        500,
        "Unable to parse JSON bytes array",
    ),
]


@pytest.mark.parametrize("body, status, message", JSON_BODIES)
def test_http_body_that_is_not_valid_json(server, body, status, message):
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/embed/infer", data=body)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == status and message in info.value.read().decode()


def test_server_healthy_and_correct_after_the_battery(server, before):
    with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready") as r:
        assert r.status == 200
    for protocol in ("http", "grpc"):
        after = infer(server, CHECK_TEXTS, protocol)[0]
        assert np.abs(after - before).max() <= 1e-5
