"""Named API keys (--api-keys-file): each key uses only its models, on every route and in its
batches, within its requests and tokens per minute, named in the metrics and the access log;
the file is read again when it changes. A real tritonserver serves the demo embedder and
reranker; the gateway runs as its own process. The buckets' refill is checked on a clock the
test turns (no test waits out a minute)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import cohere
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from starlette.requests import Request

from qwen_embed_client.contract import PRIORITIES
from qwen_embed_client.gateway.batch_store import BatchStore
from qwen_embed_client.gateway.batches import next_turn
from qwen_embed_client.gateway.errors import APIError
from qwen_embed_client.gateway.keys import KeyRing
from qwen_embed_deploy.triton import free_port

from triton_helpers import (
    gateway_metrics,
    post_json,
    send_json,
    text_input,
    wait_for,
    wait_until,
)

pytestmark = pytest.mark.server  # starts tritonserver and a gateway process

SERVED = {"embed": ("embed",), "rerank": ("rerank",)}
KEYS = {
    "embedder": {"sha256": hashlib.sha256(b"key-embedder").hexdigest(), "models": ["embed"]},
    "reranker": {"key": "key-reranker", "models": ["rerank"]},
    "limited": {"key": "key-limited", "requests_per_minute": 3},
    "frugal": {"key": "key-frugal", "tokens_per_minute": 20},
    "nightly": {"key": "key-nightly", "priority": "bulk", "max_concurrent_requests": 1},
    "batcher": {"key": "key-batcher", "tokens_per_minute": 50},
}
PLAIN = "key-plain"  # --api-key: every model, no limits


def keys_file(path: Path, keys: dict) -> None:
    """The file written whole and moved into place, as a secret's update lands."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"keys": [{"name": n, **k} for n, k in keys.items()]}))
    os.replace(tmp, path)


class Gateway:
    def __init__(self, server, where: Path):
        self.keys_path, self.log_path = where / "keys.json", where / "gateway.log"
        keys_file(self.keys_path, KEYS)
        self.port = free_port()
        self.root = f"http://127.0.0.1:{self.port}"
        args = ["--triton-url", server.grpc_url, "--port", str(self.port), "--access-log"]
        args += ["--api-keys-file", self.keys_path, "--api-key", PLAIN]
        args += ["--batch-dir", where / "batches", "--batch-shard-lines", 2]
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "qwen_embed_client.gateway", *map(str, args)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_for(f"{self.root}/health")

    def post(self, path: str, body: dict, key: str) -> tuple[int, dict, dict]:
        return post_json(self.root + path, body, {"Authorization": f"Bearer {key}"})

    def get(self, path: str, key: str) -> tuple[int, dict, dict]:
        return send_json("GET", self.root + path, None, {"Authorization": f"Bearer {key}"})

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.root}/v1", api_key=key, max_retries=0)

    def access_lines(self) -> list[dict]:
        lines = self.log_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=20)
        self.log.close()


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory):
    g = Gateway(server, tmp_path_factory.mktemp("keys"))
    yield g
    g.stop()


RERANK = {"model": "rerank", "query": "capital of China?", "documents": ["Beijing", "Paris"]}


def test_a_key_uses_only_its_models_on_every_route(gateway):
    vectors = gateway.openai("key-embedder").embeddings.create(model="embed", input=["a", "b"])
    assert len(vectors.data) == 2
    status, answer, _ = gateway.post("/v1/rerank", RERANK, "key-embedder")
    assert status == 404, answer
    assert answer["error"]["code"] == "model_not_found"
    message = "the model 'rerank' does not exist or the API key 'embedder' may not use it"
    assert answer["error"]["message"] == message
    # the same refusal in Cohere's shape, on a route that names no model, and TEI's
    co = cohere.ClientV2(base_url=gateway.root, api_key="key-embedder")
    with pytest.raises(cohere.errors.NotFoundError, match="may not use it"):
        co.rerank(model="rerank", query="capital?", documents=["Beijing"])
    status, answer, _ = gateway.post("/rerank", {"query": "q", "texts": ["t"]}, "key-embedder")
    assert status == 424 and "may not use it" in answer["error"], answer
    # the embedder's tokenizer is the embedder's: its key may tokenize, the reranker's not
    assert gateway.post("/tokenize", {"inputs": "some text"}, "key-embedder")[0] == 200
    status, answer, _ = gateway.post("/tokenize", {"inputs": "some text"}, "key-reranker")
    assert status == 424 and "the model 'embed' does not exist" in answer["error"], answer
    with pytest.raises(openai.NotFoundError, match="API key 'reranker' may not use it"):
        gateway.openai("key-reranker").embeddings.create(model="embed", input="a")
    status, answer, _ = gateway.post("/v1/rerank", RERANK, "key-reranker")
    assert status == 200 and len(answer["results"]) == 2
    # the same scores as through a key that may use every model
    assert gateway.post("/v1/rerank", RERANK, PLAIN)[1]["results"] == answer["results"]
    # the model lists show a key its own models only
    listed = {
        key: [m.id for m in gateway.openai(key).models.list()]
        for key in ("key-embedder", "key-reranker", PLAIN)
    }
    assert listed == {
        "key-embedder": ["embed"],
        "key-reranker": ["rerank"],
        PLAIN: ["embed", "rerank"],
    }
    tags = gateway.get("/api/tags", "key-reranker")[1]  # Ollama's list: embedders only
    assert tags == {"models": []}
    status, answer, _ = gateway.get("/v1/models/rerank", "key-embedder")
    assert status == 404, answer
    # routes that describe a model without asking it: as if asked
    status, answer, _ = gateway.post("/api/show", {"model": "embed"}, "key-reranker")
    assert status == 404 and "may not use it" in answer["error"], answer
    assert gateway.post("/api/show", {"model": "embed"}, "key-embedder")[0] == 200
    status, answer, _ = gateway.get("/info", "key-reranker")
    assert status == 424 and "the model 'embed' does not exist" in answer["error"], answer
    assert gateway.get("/info", "key-embedder")[0] == 200


def test_limits_answer_429_with_when_to_come_back(gateway):
    api = gateway.openai("key-limited")
    remaining = []
    for _ in range(3):
        answer = api.embeddings.with_raw_response.create(model="embed", input="one text")
        assert answer.headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(answer.headers["x-ratelimit-remaining-requests"])
    assert remaining == ["2", "1", "0"]
    with pytest.raises(openai.RateLimitError, match="3 requests per minute") as refused:
        api.embeddings.create(model="embed", input="one text")
    retry_after = int(refused.value.response.headers["retry-after"])
    assert 1 <= retry_after <= 20  # a request's worth comes back every 60 / 3 s
    assert int(refused.value.response.headers["retry-after-ms"]) <= retry_after * 1000
    assert refused.value.code == "rate_limit_exceeded"
    # TEI's shape, and no other key held back by it
    status, answer, _ = gateway.post("/embed", {"inputs": "x"}, "key-limited")
    assert status == 429 and answer["error_type"] == "Overloaded", answer
    assert gateway.post("/embed", {"inputs": "x"}, PLAIN)[0] == 200
    # tokens: a request may overdraw the minute's 20, the next one waits
    frugal = gateway.openai("key-frugal")
    first = frugal.embeddings.with_raw_response.create(model="embed", input="word " * 30)
    assert first.parse().usage.total_tokens > 20
    assert first.headers["x-ratelimit-limit-tokens"] == "20"
    with pytest.raises(openai.RateLimitError, match="20 tokens per minute"):
        frugal.embeddings.create(model="embed", input="x")
    metrics = gateway_metrics(gateway.root)
    refusals = {
        labels: value
        for labels, value in metrics.items()
        if labels.startswith("qwen_embed_gateway_requests_total") and '"status": "429"' in labels
    }
    assert sum(v for k, v in refusals.items() if '"key": "limited"' in k) == 2
    assert sum(v for k, v in refusals.items() if '"key": "frugal"' in k) == 1
    spent = 'qwen_embed_gateway_tokens_total{"api": "openai", "key": "frugal", "model": "embed"}'
    assert metrics[spent] == first.parse().usage.total_tokens


def test_the_access_log_names_the_key(gateway):
    api = gateway.openai("key-embedder")
    answer = api.embeddings.create(
        model="embed", input="logged", extra_headers={"x-request-id": "k1"}
    )
    api_plain = gateway.openai(PLAIN)
    api_plain.embeddings.create(model="embed", input="logged", extra_headers={"x-request-id": "k2"})

    def logged() -> dict:
        return {line.get("request_id"): line for line in gateway.access_lines()}

    # a request's line is written once its answer is sent: the client may read first
    wait_until(lambda: {"k1", "k2"} <= logged().keys(), "both requests' access log lines")
    lines = logged()
    assert lines["k1"]["key"] == "embedder"
    assert lines["k1"]["tokens"] == answer.usage.total_tokens
    assert lines["k2"]["key"] == ""  # a plain key has no name
    assert lines["k1"]["owner"] != lines["k2"]["owner"]
    assert "key-embedder" not in gateway.log_path.read_text()


def test_a_bulk_key_waits_behind_queued_bulk_work_within_its_requests_in_flight(gateway, server):
    """Bulk requests (Triton priority 2) queue up behind one executing; then the bulk key's
    request through the gateway asks for `interactive`, goes at bulk priority and completes
    after all of them, where an interactive one overtakes them (test_triton_embed.py's order
    test, the same queue): by order of completion, not timing. While it waits, the key's
    second request is past its one in flight: refused at once; once it is answered, the next
    is taken."""
    key = "key-nightly"
    rng = np.random.default_rng(2)
    words = ["alpha", "river", "stone", "cloud", "seven", "market", "blue", "quiet", "engine"]
    texts = [" ".join(rng.choice(words, 12)) for _ in range(256)]  # one execute each
    finished = []

    def bulk(i):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        batch = [f"{key} {i} {t}" for t in texts]  # distinct: no response or prefix reuse
        client.infer("embed", [text_input(grpcclient, batch)], priority=PRIORITIES["bulk"])
        finished.append(f"bulk{i}")

    body = {"model": "embed", "input": f"a query for {key}", "priority": "interactive"}

    def asked():
        assert gateway.post("/v1/embeddings", body, key)[0] == 200
        finished.append("query")

    def tokenized():
        return server.metric("nv_inference_request_success", model="tokenizer")

    before = tokenized()
    threads = [threading.Thread(target=bulk, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    wait_until(
        lambda: (
            tokenized() - before >= 5
            and server.metric("nv_inference_pending_request_count", model="encoder") >= 3
        ),
        "bulk requests queued behind the executing one",
    )
    queued = 5 - len(finished)
    threads.append(threading.Thread(target=asked))
    threads[-1].start()
    in_flight = "qwen_embed_gateway_requests_in_flight{}"
    wait_until(lambda: gateway_metrics(gateway.root)[in_flight] == 1, "the query in flight")
    with pytest.raises(openai.RateLimitError, match="1 requests in flight") as refused:
        gateway.openai(key).embeddings.create(model="embed", input="a second query")
    assert refused.value.response.headers["retry-after"] == "1"
    assert "query" not in finished  # the refusal did not wait for it
    for t in threads:
        t.join(timeout=600)
    assert queued >= 3, finished  # the query had queued bulk work to overtake, had it asked
    assert finished[-1] == "query", finished
    assert gateway.post("/v1/embeddings", body, key)[0] == 200  # its slot given back


def _batch(api, lines: list[dict], wait: bool = True):
    """The rerank batch of `lines`, once it ends (as created without `wait`)."""
    text = "".join(json.dumps(line) + "\n" for line in lines).encode()
    source = api.files.create(file=("in.jsonl", io.BytesIO(text)), purpose="batch").id
    batch = api.batches.create(input_file_id=source, endpoint="/v1/rerank", completion_window="24h")
    if not wait:
        return batch
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = api.batches.retrieve(batch.id)
    return batch


def test_a_batch_runs_under_the_key_that_made_it(gateway):
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/rerank", "body": RERANK}
        for i in range(3)
    ]
    refused = _batch(gateway.openai("key-embedder"), lines)
    assert refused.request_counts.failed == 3 and refused.request_counts.completed == 0
    errors = gateway.openai("key-embedder").files.content(refused.error_file_id).text
    first = json.loads(errors.splitlines()[0])
    assert first["response"]["status_code"] == 404
    assert "the API key 'embedder' may not use it" in first["response"]["body"]["error"]["message"]
    # the reranker's key: answered, as the direct route answers, and counted under its name
    before = gateway_metrics(gateway.root)
    done = _batch(gateway.openai("key-reranker"), lines)
    assert done.request_counts.completed == 3
    answers = gateway.openai("key-reranker").files.content(done.output_file_id).text
    scores = [json.loads(a)["response"]["body"]["results"] for a in answers.splitlines()]
    direct = gateway.post("/v1/rerank", RERANK, "key-reranker")[1]["results"]
    for got in scores:
        assert np.allclose(
            [r["relevance_score"] for r in got], [r["relevance_score"] for r in direct], atol=1e-6
        )
    tokens = 'qwen_embed_gateway_tokens_total{"api": "batch", "key": "reranker", "model": "rerank"}'
    assert gateway_metrics(gateway.root)[tokens] - before.get(tokens, 0) == 3 * direct_usage(
        gateway
    )


def test_a_keys_batches_go_within_its_limits_and_hold_no_other_key_back(gateway):
    """The batcher key (50 tokens per minute): its first batch's lines are taken from its
    tokens (overdrawn: its next request is refused), its second batch waits for them to come
    back, validated and none of its lines run, while another key's batch made after it runs
    to the end; cancelled, it ends at once (checked to fail with the lines not taken)."""
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/rerank", "body": RERANK}
        for i in range(2)
    ]
    api = gateway.openai("key-batcher")
    first = _batch(api, lines)
    assert first.status == "completed" and first.request_counts.completed == 2
    assert 2 * direct_usage(gateway) > 50
    status, answer, _ = gateway.post("/v1/rerank", RERANK, "key-batcher")
    assert status == 429 and "50 tokens per minute" in answer["error"]["message"], answer
    waiting = _batch(api, lines, wait=False)
    other = _batch(gateway.openai(PLAIN), lines)
    assert other.status == "completed" and other.request_counts.completed == 2
    waiting = api.batches.retrieve(waiting.id)
    assert waiting.status == "in_progress" and waiting.request_counts.completed == 0, waiting
    api.batches.cancel(waiting.id)
    deadline = time.monotonic() + 60
    while (waiting := api.batches.retrieve(waiting.id)).status != "cancelled":
        assert time.monotonic() < deadline, waiting
        time.sleep(0.2)
    assert waiting.request_counts.completed == 0


def direct_usage(gateway) -> int:
    return gateway.post("/v1/rerank", RERANK, "key-reranker")[1]["usage"]["total_tokens"]


def test_the_file_is_read_again_when_it_changes(gateway):
    """A key added works, a key removed is refused, a file that does not read keeps the keys
    before it; then the keys of the other tests are put back."""

    def status_of(key: str) -> int:
        return gateway.post("/v1/embeddings", {"model": "embed", "input": "x"}, key)[0]

    def eventually(key: str, expected: int) -> None:
        deadline = time.monotonic() + 30
        while status_of(key) != expected:
            assert time.monotonic() < deadline, (key, expected)
            time.sleep(0.2)

    assert status_of("key-new") == 401
    others = {k: v for k, v in KEYS.items() if k != "embedder"}
    keys_file(gateway.keys_path, {**others, "new": {"key": "key-new"}})
    eventually("key-new", 200)
    assert status_of("key-embedder") == 401
    gateway.keys_path.write_text('{"keys": [')  # half written: the keys before it stay
    eventually_logged = time.monotonic() + 30
    while "the keys read before it kept" not in gateway.log_path.read_text():
        assert time.monotonic() < eventually_logged
        status_of("key-new")  # a request looks at the file
        time.sleep(0.2)
    assert status_of("key-new") == 200
    keys_file(gateway.keys_path, KEYS)
    eventually("key-embedder", 200)
    assert status_of("key-new") == 401


def test_a_rotated_key_keeps_its_teams_batch_files(gateway):
    """The Batch API's files belong to a named key's name: the key that replaces it under the
    same name reads them; another name does not."""
    api = gateway.openai("key-embedder")
    made = api.files.create(file=("in.jsonl", io.BytesIO(b"{}\n")), purpose="batch").id
    rotated = {**KEYS, "embedder": {"key": "key-embedder-2", "models": ["embed"]}}
    keys_file(gateway.keys_path, rotated)

    def taken(key: str) -> bool:
        return gateway.get("/v1/models", key)[0] == 200

    wait_until(lambda: taken("key-embedder-2"), "the rotated key taken")
    try:
        assert gateway.openai("key-embedder-2").files.retrieve(made).id == made
        with pytest.raises(openai.NotFoundError):
            gateway.openai("key-reranker").files.retrieve(made)
        assert gateway.get("/v1/models", "key-embedder")[0] == 401  # the old key is gone
    finally:
        keys_file(gateway.keys_path, KEYS)
        wait_until(lambda: taken("key-embedder"), "the first key taken again")


# The ring itself, without a server: the file's refusals and the buckets' refill.


def _request(key: str) -> Request:
    return Request({"type": "http", "headers": [(b"authorization", f"Bearer {key}".encode())]})


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"name": "a", "key": "k", "models": ["large"]},
            r"keys\[0\].models: \['large'\] not served",
        ),
        ({"name": "a", "sha256": "abc"}, r"keys\[0\].sha256 must be 64 hex digits"),
        ({"name": "a"}, r"keys\[0\] needs one of sha256"),
        ({"name": "a", "key": "k", "rpm": 3}, r"keys\[0\]: unknown fields \['rpm'\]"),
        ({"name": "a", "key": "k", "tokens_per_minute": 0}, r"tokens_per_minute must be a number"),
        ({"name": "", "key": "k"}, r"keys\[0\].name must be a non-empty string"),
        ({"name": "a", "key": "k", "priority": "urgent"}, r"priority must be one of"),
        ({"name": "a", "key": "k", "expires_at": "soon"}, r"expires_at must be an ISO 8601"),
        ({"name": "a", "key": "k", "max_concurrent_requests": 1.5}, r"must be an integer >= 1"),
    ],
)
def test_a_file_that_does_not_read_stops_the_gateway(tmp_path, entry, message):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [entry]}))
    with pytest.raises(ValueError, match=message):
        KeyRing((), path, SERVED)


def test_two_keys_of_one_name_or_one_key_are_refused(tmp_path):
    path = tmp_path / "keys.json"
    for keys, what in [
        ([{"name": "a", "key": "k1"}, {"name": "a", "key": "k2"}], "name"),
        (
            [{"name": "a", "key": "k"}, {"name": "b", "sha256": hashlib.sha256(b"k").hexdigest()}],
            "key",
        ),
    ]:
        path.write_text(json.dumps({"keys": keys}))
        with pytest.raises(ValueError, match=f"two keys have the same {what}"):
            KeyRing((), path, SERVED)


def test_the_gateway_will_not_start_on_a_bad_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"name": "a", "key": "k", "models": ["large"]}]}))
    started = subprocess.run(
        [sys.executable, "-m", "qwen_embed_client.gateway", "--api-keys-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert started.returncode == 2
    assert "--api-keys-file" in started.stderr and "['large'] not served" in started.stderr


def test_buckets_refill_over_the_minute(tmp_path):
    now = [1000.0]
    path = tmp_path / "keys.json"
    keys_file(path, {"a": {"key": "k", "requests_per_minute": 2, "tokens_per_minute": 100}})
    ring = KeyRing((), path, SERVED, clock=lambda: now[0])

    def ask(tokens: int = 30) -> str:
        """'ok' (and its tokens spent), or which bucket refused it."""
        request = _request("k")
        try:
            ring.admit(request)
        except APIError as e:
            assert e.kind == "rate_limited" and int(e.headers["retry-after"]) >= 1
            return "requests" if "requests per minute" in e.message else "tokens"
        ring.done(request.scope, {"embed": tokens})
        return "ok"

    assert [ask(), ask(), ask()] == ["ok", "ok", "requests"]
    now[0] += 29.9  # a request's worth comes back every 30 s
    assert ask() == "requests"
    now[0] += 0.2
    assert ask() == "ok"
    now[0] += 30
    assert ask(tokens=150) == "ok"  # a full bucket overdrawn by 50
    now[0] += 30
    assert ask() == "tokens"  # 30 s brought back 50: the bucket is at 0
    now[0] += 1
    assert ask() == "ok"  # the requests' bucket lost nothing to the refusal
    now[0] += 3600  # a long idle fills each bucket to its minute, no more
    assert [ask(), ask(), ask()] == ["ok", "ok", "requests"]
    with pytest.raises(APIError, match="Incorrect API key"):
        ring.admit(_request("another"))


def test_batch_lines_are_taken_from_their_keys_limits(tmp_path):
    """A named key's Batch API lines: a request and their tokens each, overdrawn as need be;
    its next shard waits until each limit holds a request again, and so do its direct
    requests; a plain key's, or one no longer in the file, never wait."""
    now = [1000.0]
    path = tmp_path / "keys.json"
    keys_file(path, {"a": {"key": "k", "requests_per_minute": 2, "tokens_per_minute": 100}})
    ring = KeyRing((), path, SERVED, clock=lambda: now[0])
    assert ring.room_in_s("a") == 0 and ring.room_in_s("") == 0 and ring.room_in_s("gone") == 0
    ring.spend("a", {"embed": 30})
    ring.spend("a", {"embed": 30})  # the requests spent: one back in 30 s
    assert ring.room_in_s("a") == pytest.approx(30)
    with pytest.raises(APIError, match="2 requests per minute"):
        ring.admit(_request("k"))
    now[0] += 30
    assert ring.room_in_s("a") == 0
    ring.spend("a", {"embed": 190})  # tokens at 40 + 50 - 190 = -100: 101 to come back
    assert ring.room_in_s("a") == pytest.approx(101 * 60 / 100)
    ring.spend("", {"embed": 10**6})
    ring.spend("gone", {"embed": 10**6})
    assert ring.room_in_s("") == 0


def test_owners_take_turns():
    """The next batch's owner: the first after the last served, in the order of their oldest
    batches, whose key has room now."""
    owners, free = ["a", "b", "c"], {"a": 0, "b": 0, "c": 0}
    assert next_turn(owners, free, None) == "a"
    assert [next_turn(owners, free, last) for last in owners] == ["b", "c", "a"]
    assert next_turn(owners, free | {"b": 5.0}, "a") == "c"
    assert next_turn(owners, free | {"b": 5.0, "c": 1.0}, "a") == "a"  # the last, again
    assert next_turn(owners, dict.fromkeys(owners, 2.0), "a") is None
    assert next_turn(owners, free, "gone") == "a"
    assert next_turn([], {}, None) is None


def test_a_batch_directory_made_before_named_keys_opens_with_them(tmp_path):
    """A gateway's Batch API state from before the batches' key column: opened, its batches
    belong to no named key (their lines use every model, as they did)."""
    db = sqlite3.connect(tmp_path / "state.sqlite")
    db.executescript(
        """
        CREATE TABLE files (id TEXT PRIMARY KEY, owner TEXT NOT NULL, object TEXT NOT NULL);
        CREATE TABLE batches (
            id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at INTEGER NOT NULL,
            status TEXT NOT NULL, object TEXT NOT NULL);
        INSERT INTO batches VALUES ('batch_old', 'o', 1, 'validating', '{}');
        """
    )
    db.close()
    store = BatchStore(tmp_path)
    assert store.key_of("batch_old") == ""
    store.add_batch("o", {"id": "batch_new", "created_at": 2, "status": "validating"}, "search")
    assert store.key_of("batch_new") == "search"
    store.close()


def test_a_key_is_refused_from_its_expiry_on(tmp_path):
    wall = [datetime(2027, 1, 31, 23, 59, 59, tzinfo=timezone.utc).timestamp()]
    path = tmp_path / "keys.json"
    keys_file(path, {"temp": {"key": "k", "expires_at": "2027-02-01"}})  # its start, UTC
    ring = KeyRing((), path, SERVED, wall=lambda: wall[0])
    ring.admit(_request("k"))
    wall[0] += 1
    with pytest.raises(APIError, match=r"'temp' expired at 2027-02-01T00:00:00\+00:00"):
        ring.admit(_request("k"))
    keys_file(path, {"temp": {"key": "k", "expires_at": "2027-02-01T09:00:00+09:00"}})
    assert KeyRing((), path, SERVED).named[0].expires_at == wall[0]  # the same instant


def test_a_new_key_and_its_entry_are_taken_as_made(tmp_path):
    """`new-key` prints a key and its entry (the digest, never the key): the entry in a keys
    file takes that key, with the models and expiry given."""
    made = subprocess.run(
        [sys.executable, "-m", "qwen_embed_client.gateway", "new-key", "search"]
        + ["--models", "embed", "--expires-at", "2999-01-01"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = dict(line.split(": ", 1) for line in made.stdout.splitlines())
    key, entry = lines["key"], json.loads(lines["entry"])
    assert key not in lines["entry"] and len(key) > 40
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [entry]}))
    ring = KeyRing((), path, SERVED)
    request = _request(key)
    ring.admit(request)
    assert request.state.api_key.name == "search" and request.state.api_key.models == ("embed",)
    with pytest.raises(APIError, match="Incorrect API key"):
        ring.admit(_request(key[:-1]))
