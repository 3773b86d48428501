"""The OpenAI-compatible gateway, driven by the official `openai` package, against a real
gateway process and tritonserver."""

import base64
import collections
import hashlib
import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import openai
import pytest

from qwen_embed_client import EmbeddingClient
from qwen_embed_client.contract import (
    EMBEDDING_TYPES,
    MAX_INPUTS,
    MAX_TEXTS_PER_REQUEST,
    compact,
)
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.triton import TritonServer

from triton_helpers import (
    encoder_kept_busy,
    gateway_metrics,
    gateway_process,
    http_status,
    infer,
    odd_bodies,
    run_clients,
    send_json,
    wait_until,
)

pytestmark = pytest.mark.server  # starts tritonserver or other processes

API_KEY = "test-key-123"


@pytest.fixture(scope="module")
def where(tmp_path_factory):
    return tmp_path_factory.mktemp("gateway-triton")


@pytest.fixture(scope="module")
def stack(demo_dir, where):
    """A server of the demo model alone (no reranker: /v1/rerank has nothing behind it) and
    the gateway in front of it, its access log (stdout) in where / "gateway.out"."""
    repo = render(where / "repo", {"embed": demo_dir}, {"encoder": {"dtype": "float32"}})
    with TritonServer(repo, log_path=where / "server.log") as server:
        # as the launcher's gateway takes them
        env = {"QWEN_EMBED_MAX_BODY_MB": "1", "QWEN_EMBED_ACCESS_LOG": "1"}
        out = where / "gateway.out"
        with gateway_process(server, "--api-key", API_KEY, env=env, stdout=out) as base:
            yield server, f"{base}/v1"


def test_values_and_usage_equal_the_triton_path(stack):
    server, base_url = stack
    api = openai.OpenAI(base_url=base_url, api_key=API_KEY)
    texts = ["Hello, world!", "你好，世界", "a third text"]
    expected, counts = infer(server, texts, "grpc")
    tokens = int(counts.sum())
    as_base64 = api.embeddings.create(input=texts, model="embed")  # the package asks for base64
    as_float = api.embeddings.create(input=texts, model="embed", encoding_format="float")
    for response in (as_base64, as_float):
        got = np.array([d.embedding for d in response.data], dtype=np.float32)
        assert np.abs(got - expected).max() <= 1e-4
        assert [d.index for d in response.data] == [0, 1, 2]
        assert response.usage.prompt_tokens == tokens == response.usage.total_tokens
    single = api.embeddings.create(input="Hello, world!", model="embed", dimensions=64)
    assert len(single.data) == 1 and len(single.data[0].embedding) == 64
    small = infer(server, ["Hello, world!"], "grpc", dimensions=64)[0][0]
    assert np.abs(np.array(single.data[0].embedding) - small).max() <= 1e-4
    assert [m.id for m in api.models.list().data] == ["embed"]


def test_what_a_client_stopped_waiting_for_is_never_embedded(stack):
    """The `openai` SDK sends its read timeout (x-stainless-read-timeout), Envoy its route's
    (x-envoy-expected-rq-timeout-ms): the gateway makes the shorter the deadline of the
    Triton requests it sends for the request, so a request still queued for the busy encoder
    when its client has given up is dropped there, not computed."""
    server, base_url = stack
    api = openai.OpenAI(base_url=base_url, api_key=API_KEY, timeout=0.3, max_retries=0)

    def sdk(i):
        with pytest.raises((openai.APITimeoutError, openai.InternalServerError)):
            api.embeddings.create(model="embed", input=[f"question {i}"])

    def behind_envoy(i):  # no timeout of its own: the gateway's 503 ends it
        headers = {"x-envoy-expected-rq-timeout-ms": "300"}
        status, body = _post(base_url, "embeddings", {"input": f"query {i}"}, headers)
        message = body["error"]["message"]
        assert status == 503 and (
            "not answered within" in message or "timeout expired" in message
        ), body

    texts_before = server.metric("qwen_embed_texts_total")
    with encoder_kept_busy(server, 4.0) as busy:
        run_clients(4, lambda i: (sdk if i % 2 else behind_envoy)(i))
    assert server.metric("qwen_embed_texts_total") - texts_before == busy.texts


def test_what_a_client_that_disconnects_left_unsent_is_never_sent(stack):
    """A body of many texts goes to Triton in chunks, a few at a time; its client disconnects
    while the first ones wait behind a busy encoder: the gateway cancels its handler (counted
    as status 499), and the chunks not yet sent never are (those already queued for the
    encoder may still be computed: Triton 2.51 does not pass a cancellation on to them)."""
    server, base_url = stack
    url = urllib.parse.urlsplit(base_url)
    texts = [f"text number {i}" for i in range(MAX_INPUTS)]
    body = json.dumps({"model": "embed", "input": texts})
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    texts_before = server.metric("qwen_embed_texts_total")
    closed = "qwen_embed_gateway_requests_total" + json.dumps(
        {"api": "openai", "route": "/v1/embeddings", "status": "499", "model": "embed", "key": ""},
        sort_keys=True,
    )
    closed_before = _metrics(base_url).get(closed, 0)
    with encoder_kept_busy(server, 4.0) as busy:
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        connection.request("POST", "/v1/embeddings", body=body, headers=headers)
        queued = "nv_inference_pending_request_count"
        wait_until(lambda: server.metric(queued, model="encoder") >= 1, "a chunk queued")
        connection.close()  # the client leaves

        def handler_ended():
            metrics = _metrics(base_url)
            return metrics["qwen_embed_gateway_requests_in_flight{}"] == 0 and (
                metrics.get(closed, 0) == closed_before + 1
            )

        wait_until(handler_ended, "the gateway to count the request as closed by its client")
    computed = server.metric("qwen_embed_texts_total") - texts_before - busy.texts
    # at most the chunks in flight when it left (the client's 4 requests of <= 256 texts;
    # none where Triton cancelled them before their encoder step)
    assert computed <= 4 * MAX_TEXTS_PER_REQUEST < len(texts), computed


def _post(base_url, path, body, headers=None):
    request = urllib.request.Request(
        f"{base_url}/{path}",
        data=json.dumps(body).encode(),
        headers={
            "Authorization": f"Bearer {API_KEY}",
            "Content-Type": "application/json",
            **(headers or {}),
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_text_objects_embed_as_their_texts(stack):
    """{"text": ...} inputs (Qwen3-VL-Embedding's scripts, Jina's API) on a text model."""
    server, base_url = stack
    texts = ["Hello, world!", "a second text"]
    expected, _ = infer(server, texts, "grpc")
    status, body = _post(base_url, "embeddings", {"input": [{"text": t} for t in texts]})
    assert status == 200, body
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert np.abs(got - expected).max() <= 1e-4


def test_compact_vectors_each_way_clients_ask(stack):
    """embedding_type (ours), encoding_format with a type's name (vLLM, NIM) and Cohere's
    embedding_types list (answered keyed by type): the server's codes of its float vectors."""
    server, base_url = stack
    texts = ["Hello, world!", "a second text"]
    floats = infer(server, texts, "grpc", dimensions=64)[0]
    body = {"model": "embed", "input": texts, "dimensions": 64}
    for kind in EMBEDDING_TYPES:
        expected = compact(floats, kind)
        for extra in ({"embedding_type": kind}, {"encoding_format": kind}):
            status, answer = _post(base_url, "embeddings", {**body, **extra})
            assert status == 200, answer
            got = np.array([d["embedding"] for d in answer["data"]], expected.dtype)
            assert np.array_equal(got, expected), (kind, extra)  # float32: the same bits
    before = server.metric("qwen_embed_texts_total", model="encoder")
    status, answer = _post(
        base_url, "embeddings", {**body, "embedding_types": ["int8", "ubinary", "float"]}
    )
    assert status == 200, answer
    # one computation of the vectors for the three types (the encoder's own counter moves
    # before its answer leaves): each text embedded once
    assert server.metric("qwen_embed_texts_total", model="encoder") - before == len(texts)
    for i, entry in enumerate(answer["data"]):
        assert entry["embeddings"]["int8"] == compact(floats, "int8")[i].tolist()
        assert entry["embeddings"]["ubinary"] == compact(floats, "ubinary")[i].tolist()
        assert np.abs(np.array(entry["embeddings"]["float"]) - floats[i]).max() <= 1e-6
    for priority in ("bulk", "interactive", 2):
        status, answer = _post(base_url, "embeddings", {**body, "priority": priority})
        assert status == 200 and len(answer["data"][0]["embedding"]) == 64, answer
    status, answer = _post(
        base_url, "embeddings", {**body, "embedding_type": "int8", "encoding_format": "base64"}
    )
    codes = [np.frombuffer(base64.b64decode(d["embedding"]), np.int8) for d in answer["data"]]
    assert np.array_equal(np.stack(codes), compact(floats, "int8"))
    for bad, param in [
        ({"embedding_type": "int4"}, "embedding_type"),
        ({"embedding_types": []}, "embedding_types"),
        ({"embedding_types": ["int8", "int8"]}, "embedding_types"),
        ({"embedding_type": "int8", "embedding_types": ["int8"]}, "embedding_types"),
        ({"encoding_format": "int8", "embedding_type": "uint8"}, "encoding_format"),
        ({"encoding_format": "hex"}, "encoding_format"),
        ({"priority": "urgent"}, "priority"),
        ({"priority": 7}, "priority"),
    ]:
        status, answer = _post(base_url, "embeddings", {**body, **bad})
        assert status == 400 and answer["error"]["param"] == param, (bad, answer)


def test_2048_inputs_are_split_across_triton_requests(stack):
    _, base_url = stack
    api = openai.OpenAI(base_url=base_url, api_key=API_KEY)
    response = api.embeddings.create(
        input=[f"t{i}" for i in range(2048)], model="embed", dimensions=8
    )
    assert len(response.data) == 2048 and response.data[2047].index == 2047


def test_errors_map_to_openai_shapes(stack):
    _, base_url = stack
    api = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match=r"'dimensions' must be >= 1"):
        api.embeddings.create(input="x", model="embed", dimensions=0)
    with pytest.raises(openai.BadRequestError, match=r"'dimensions' must be in 1\.\.1024"):
        api.embeddings.create(input="x", model="embed", dimensions=4096)  # the model's, served
    # past int64, which Triton's request parameters cannot carry: refused before sending
    with pytest.raises(openai.BadRequestError, match="'dimensions' must be an integer of at"):
        api.embeddings.create(input="x", model="embed", dimensions=2**63)
    with pytest.raises(openai.BadRequestError, match="more than the limit of 2048"):
        api.embeddings.create(input=["x"] * 2049, model="embed")
    with pytest.raises(openai.BadRequestError, match="'input' cannot be empty"):
        api.embeddings.create(input=[], model="embed")
    with pytest.raises(openai.NotFoundError, match="does not exist") as e:
        api.embeddings.create(input="x", model="text-embedding-3-small")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).embeddings.create(
            input="x", model="embed"
        )


def test_routing_refusals_answer_in_the_apis_error_shape(stack):
    """A path no route serves and a method a route does not take are refused in the route's
    API's error shape (OpenAI's where no route matched, as OpenAI words them), not
    Starlette's {"detail": ...}; a 405 says which methods the route takes."""
    _, base_url = stack
    base, auth = base_url.removesuffix("/v1"), {"Authorization": f"Bearer {API_KEY}"}
    status, body, _ = send_json("POST", f"{base}/v1/embedding", {"input": "x"}, auth)
    assert status == 404
    assert body["error"]["message"] == "Invalid URL (POST /v1/embedding)"
    assert body["error"]["type"] == "invalid_request_error"
    status, body, headers = send_json("GET", f"{base}/v1/embeddings", headers=auth)
    assert status == 405 and body["error"]["message"] == "Not allowed to GET /v1/embeddings"
    assert {k.lower(): v for k, v in headers.items()}["allow"] == "POST"
    status, body, _ = send_json("GET", f"{base}/embed", headers=auth)  # TEI's route
    assert status == 405
    assert body == {"error": "Not allowed to GET /embed", "error_type": "Validation"}
    status, body, _ = send_json("DELETE", f"{base}/v2/embed", headers=auth)  # Cohere's
    assert status == 405 and body["message"] == "Not allowed to DELETE /v2/embed"
    api = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match=r"Invalid URL \(POST /v1/nowhere\)"):
        api.post("/nowhere", cast_to=object, body={})


def test_a_body_over_the_limit_is_refused_unread(stack):
    """A 1 MiB limit ($QWEN_EMBED_MAX_BODY_MB): a larger body is a 413 in the API's shape,
    whether it declares its length (answered before any of it is sent) or comes in chunks;
    a body just under it is read."""
    _, base_url = stack
    texts = ["x" * 500] * 2100  # about 1.03 MiB
    body = json.dumps({"model": "embed", "input": texts}).encode()
    root = base_url.removesuffix("/v1")
    chunked = urllib.request.Request(
        f"{root}/v1/embeddings",
        data=iter([body[:700_000], body[700_000:]]),  # no length
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(chunked, timeout=60)
    answers = [(e.value.code, json.loads(e.value.read())["error"]["message"])]
    status, answer = _declared_only(f"{root}/v1/embeddings", len(body))
    answers.append((status, answer["error"]["message"]))
    status, answer = _declared_only(f"{root}/embed", len(body))  # TEI
    answers.append((status, answer["error"]))
    for status, message in answers:
        assert status == 413, message
        assert "larger than the limit of 1048576 bytes" in message
    # 2,049 texts just under the limit: read, then refused by the contract (no Triton request)
    status, answer = _post(base_url, "embeddings", {"model": "embed", "input": texts[:2049]})
    assert status == 400 and "more than the limit of 2048" in answer["error"]["message"]


def _declared_only(url: str, length: int) -> tuple[int, dict]:
    """(status, JSON answer) of a POST that declares `length` bytes of body and sends none: a
    refusal from the declared length comes before the body (the gateway closes the connection
    after it, which a client still sending a large body can meet as a broken pipe)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.putrequest("POST", parts.path)
        connection.putheader("Authorization", f"Bearer {API_KEY}")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(length))
        connection.endheaders()
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _metrics(base_url: str) -> dict[str, float]:
    return gateway_metrics(base_url.removesuffix("/v1"))


def test_metrics_count_the_requests_triton_never_sees(stack):
    """Answered, refused by the contract, unauthenticated and too large requests each counted
    by route template, API, status and the Triton model asked (none for those refused before
    one was); their durations observed; the tokens the model ran, its answer's usage; none
    left in flight."""
    _, base_url = stack
    before = _metrics(base_url)
    status, answer = _post(base_url, "embeddings", {"model": "embed", "input": ["x", "a y"]})
    assert status == 200
    assert (
        _post(base_url, "embeddings", {"model": "embed", "input": "x", "dimensions": 0})[0] == 400
    )
    too_long = {"model": "embed", "input": "word " * 40_000, "truncate": False}  # 32K the most
    assert _post(base_url, "embeddings", too_long)[0] == 400  # refused by Triton's tokenizer
    assert _declared_only(f"{base_url}/embeddings", 2**21)[0] == 413
    for _ in range(2):
        wrong = urllib.request.Request(
            f"{base_url}/models/embed", headers={"Authorization": "Bearer wrong"}
        )
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(wrong)
    after = _metrics(base_url)

    def added(name: str, **labels) -> float:
        key = name + json.dumps(labels, sort_keys=True)
        return after.get(key, 0) - before.get(key, 0)

    requests = "qwen_embed_gateway_requests_total"
    for status, model, count in [("200", "embed", 1), ("400", "", 1), ("400", "embed", 1)]:
        labels = {"route": "/v1/embeddings", "api": "openai", "status": status, "model": model}
        assert added(requests, **labels, key="") == count, (status, after)
    labels = {"route": "/v1/embeddings", "api": "openai", "status": "413", "model": "", "key": ""}
    assert added(requests, **labels) == 1, after
    models = {"route": "/v1/models/{model:path}", "api": "openai", "status": "401"}
    models |= {"model": "", "key": ""}  # the key label: a named key's (test_gateway_keys.py)
    assert added(requests, **models) == 2, after
    seconds = "qwen_embed_gateway_request_duration_seconds_count"
    assert added(seconds, route="/v1/embeddings", model="") == 2
    assert added(seconds, route="/v1/embeddings", model="embed") == 2
    tokens = added("qwen_embed_gateway_tokens_total", model="embed", api="openai", key="")
    assert tokens == answer["usage"]["total_tokens"] > 0
    assert after["qwen_embed_gateway_requests_in_flight{}"] == 0
    assert not any("metrics" in key or "health" in key for key in after)  # scrapes uncounted


def test_the_access_log_says_who_asked_what_and_what_it_cost(stack, where):
    """$QWEN_EMBED_ACCESS_LOG (--access-log): a JSON line per request on stdout with its key's
    owner digest (never the key), route, status, seconds and the tokens each model ran (its
    answer's usage); probes and scrapes left out."""
    _, base_url = stack
    request_id = f"access-log-{time.time_ns()}"
    tagged = {"x-request-id": request_id}
    api = openai.OpenAI(base_url=base_url, api_key=API_KEY, default_headers=tagged)
    answer = api.embeddings.create(input=["a logged text", "another"], model="embed")
    refused = {"model": "embed", "input": "x", "dimensions": 0}
    assert _post(base_url, "embeddings", refused, headers=tagged)[0] == 400
    wrong = {"Authorization": "Bearer wrong", **tagged}
    assert send_json("GET", f"{base_url}/models", headers=wrong)[0] == 401
    urllib.request.urlopen(f"{base_url.removesuffix('/v1')}/health").read()
    log = where / "gateway.out"

    def ours() -> list[dict]:
        lines = [json.loads(line) for line in log.read_text().splitlines() if line[:1] == "{"]
        return [line for line in lines if line.get("request_id") == request_id]

    wait_until(lambda: len(ours()) == 3, "the three requests' lines")
    answered, contract, unauthorized = ours()
    owner = hashlib.sha256(f"Bearer {API_KEY}".encode()).hexdigest()[:32]
    tokens = answer.usage.total_tokens
    assert answered["models"] == {"embed": tokens} and answered["tokens"] == tokens > 0
    assert answered["user_agent"].startswith("OpenAI/Python")
    for line, status in [(answered, 200), (contract, 400)]:
        assert line["status"] == status and line["owner"] == owner, line
        assert (line["method"], line["path"], line["route"]) == ("POST",) + ("/v1/embeddings",) * 2
        assert line["api"] == "openai" and line["client"] == "127.0.0.1" and line["seconds"] > 0
    assert contract["models"] == {} and contract["tokens"] == 0
    assert unauthorized["status"] == 401 and unauthorized["path"] == "/v1/models"
    assert unauthorized["owner"] != owner  # the digest of what it sent
    text = log.read_text()
    assert API_KEY not in text and '"path":"/health"' not in text


def test_json_nested_past_the_parsers_depth_is_a_400_not_a_500(stack):
    """JSON nested deeper than Python's parser recurses is the client's mistake on every route
    that reads a body."""
    _, base_url = stack
    root = base_url.removesuffix("/v1")
    deep = b"[" * 100_000 + b"]" * 100_000
    routes = ["/v1/embeddings", "/embed", "/v2/embed", "/api/embed", "/pooling", "/tokenize"]
    for path in routes + ["/classify", "/similarity", "/decode", "/api/embeddings"]:
        request = urllib.request.Request(
            root + path,
            data=deep,
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=30)
        assert 400 <= e.value.code < 500, (path, e.value.code)
        assert "not valid JSON" in e.value.read().decode(), path


def test_a_lone_surrogate_is_a_400_not_a_500(stack):
    # Valid JSON (an escaped lone surrogate) that no UTF-8 text can hold.
    _, base_url = stack
    for path, body in [
        ("embeddings", '{"model": "embed", "input": ["ok", "\\ud800"]}'),
        ("embeddings", '{"model": "embed", "input": "\\udfff"}'),
    ]:
        request = urllib.request.Request(
            f"{base_url}/{path}",
            data=body.encode(),
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=30)
        assert e.value.code == 400
        assert "not valid UTF-8" in json.loads(e.value.read())["error"]["message"]


def test_odd_bodies_get_a_4xx_never_a_5xx(stack):
    """The contract at the HTTP edge: each route of the embed model with each field replaced by
    odd values, then seeded random bodies of nested ones (triton_helpers.odd_bodies), answers
    below 500; the server embeds as before."""
    server, base_url = stack
    root = base_url.removesuffix("/v1")
    routes = {
        "/v1/embeddings": (
            {"model": "embed", "input": ["hello"]},
            ["input", "model", "dimensions", "encoding_format", "prompt_name", "max_tokens"]
            + ["task", "late_chunking", "embed_dtype", "encoding_type", "use_activation"]
            + ["return_multivector", "input_type", "output_dtype", "output_dimension"]
            + ["truncation", "add_generation_prompt", "chat_template_kwargs", "media_io_kwargs"],
        ),
        "/embeddings": (
            {"model": "embed", "input": ["hello"], "modality": "image"},
            ["input", "modality", "dimensions", "encoding_format"],
        ),
        "/embed": (
            {"inputs": "hello"},
            ["inputs", "normalize", "truncate", "truncation_direction", "dimensions"]
            + ["prompt_name"],
        ),
        "/v2/embed": (
            {"model": "embed", "texts": ["hello"], "input_type": "search_query"},
            ["texts", "inputs", "input_type", "embedding_types", "output_dimension", "model"],
        ),
        "/tokenize": ({"inputs": "hello"}, ["inputs", "add_special_tokens", "prompt_name"]),
        "/decode": ({"ids": [1, 2, 3]}, ["ids", "skip_special_tokens"]),
        "/similarity": ({"inputs": {"source_sentence": "a", "sentences": ["b"]}}, ["inputs"]),
        "/api/embed": (
            {"model": "embed", "input": ["hello"]},
            ["input", "model", "truncate", "dimensions", "options", "keep_alive"],
        ),
        "/api/embeddings": ({"model": "embed", "prompt": "hello"}, ["prompt", "options", "model"]),
        "/pooling": (
            {"model": "embed", "input": ["hello"], "task": "token_embed"},
            ["input", "task", "encoding_format", "use_activation", "embed_dtype", "model"],
        ),
        "/classify": ({"model": "embed", "input": ["hello"]}, ["input", "use_activation", "model"]),
        "/v1/contextualizedembeddings": (
            {"model": "embed", "input": [["hello", "world"]]},
            ["input", "model", "dimensions", "encoding_format"]
            + ["inputs", "input_type", "output_dtype", "output_dimension", "chunk_size"],
        ),
        "/v1/multimodalembeddings": (
            {"model": "embed", "inputs": [{"content": [{"type": "text", "text": "hello"}]}]},
            ["inputs", "model", "input_type", "output_dtype", "output_dimension"]
            + ["truncation", "output_encoding"],
        ),
        "/v1beta/models/embed:batchEmbedContents": (
            {"requests": [{"content": {"parts": [{"text": "hello"}]}}]},
            ["requests"],
        ),
        "/v1/models/embed:embedContent": (
            {"content": {"parts": [{"text": "hello"}]}, "taskType": "RETRIEVAL_QUERY"},
            ["content", "taskType", "task_type", "outputDimensionality", "title", "model"],
        ),
        "/v1/reranking": (
            {"model": "rerank", "query": "hello", "input": ["world"]},
            ["query", "input", "top_k", "return_input", "rank_fields", "rewrite_query"],
        ),
        "/v1/multi-vector": (
            {"model": "embed", "input": [{"text": "hello"}], "input_type": "query"},
            ["input", "model", "input_type", "embedding_type", "dimensions"],
        ),
    }
    with EmbeddingClient(server.grpc_url) as client:
        before = client.embed(["hello"])
    statuses = collections.Counter()
    for path, body in odd_bodies(routes):
        status = http_status(root + path, body, {"Authorization": f"Bearer {API_KEY}"})
        assert status < 500, (path, body, status)
        statuses[status] += 1
    assert sum(n for s, n in statuses.items() if s >= 400) > 100, statuses
    with EmbeddingClient(server.grpc_url) as client:
        assert np.array_equal(client.embed(["hello"]), before)


def test_rerank_without_a_triton_reranker_is_404(stack):
    """This server serves `embed` only: /v1/rerank answers model_not_found, /v1/models omits it."""
    _, base_url = stack
    body = json.dumps({"model": "rerank", "query": "q", "documents": ["d"]}).encode()
    request = urllib.request.Request(
        f"{base_url}/rerank",
        body,
        {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=60)
    assert e.value.code == 404
    error = json.loads(e.value.read())["error"]
    assert error["code"] == "model_not_found" and "rerank" in error["message"]


def test_late_chunking_extension(stack):
    """ "chunks": {"size": N} or {"spans": [...]}: each data item lists its chunks (characters
    and vector), the vectors Triton's CHUNK_EMBEDDING gives; the client's embed_chunks alike."""
    server, base_url = stack
    texts = ["Beijing is the capital of China. The Great Wall runs north of it.", "Gravity."]
    client = EmbeddingClient(server.grpc_url)
    expected = client.embed_chunks(texts, chunk_size=6, dimensions=32)
    assert [len(e.embeddings) for e in expected] == [3, 1]  # the second text: one short chunk
    assert expected[0].token_count == 17 and expected[0].spans[-1, 1] == len(texts[0])
    body = {"model": "embed", "input": texts, "dimensions": 32, "chunks": {"size": 6}}
    status, answer = _post(base_url, "embeddings", body)
    assert status == 200, answer
    for entry, want in zip(answer["data"], expected, strict=True):
        assert [[c["start"], c["end"]] for c in entry["chunks"]] == want.spans.tolist()
        got = np.array([c["embedding"] for c in entry["chunks"]])
        assert np.abs(got - want.embeddings).max() <= 1e-6
    assert answer["usage"]["total_tokens"] == sum(e.token_count for e in expected)
    (one,) = client.embed_chunks(texts[:1], spans=[(0, 3), (3, 15)])
    status, answer = _post(
        base_url,
        "embeddings",
        {"model": "embed", "input": texts[:1], "chunks": {"spans": [[0, 3], [3, 15]]}},
    )
    got = np.array([c["embedding"] for c in answer["data"][0]["chunks"]])
    assert status == 200 and np.abs(got - one.embeddings).max() <= 1e-6
    client.close()
    for bad, words in [
        ({"chunks": {"size": "6"}}, "'chunks'"),
        ({"chunks": {"size": 6, "spans": [[0, 1]]}}, "'chunks'"),
        ({"chunks": {"size": 6}, "embedding_type": "int8"}, "'chunks'"),
        ({"chunks": {"size": 0}}, "'chunks.size' must be >= 1"),  # the gateway's contract check
        ({"chunks": {"spans": [[0, 99]]}}, "'chunks.spans'[0] = [0, 99] goes past"),  # the server
    ]:
        status, answer = _post(base_url, "embeddings", {"model": "embed", "input": texts, **bad})
        assert status == 400 and answer["error"]["param"] == "chunks", (bad, answer)
        assert words in answer["error"]["message"], (bad, answer)
