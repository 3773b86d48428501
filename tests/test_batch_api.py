"""OpenAI's Batch API on the gateway, driven by the `openai` SDK's files and batches calls: every
line answered once with the direct route's answer, bad lines as error lines, a gateway killed
mid-batch and started again, a cancel, the limits, and files kept to the key that made them.
A real tritonserver serves the demo embedder (fp32) and reranker; each gateway runs as its own
process with two API keys and its state in a temporary directory."""

import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import openai
import pytest

from qwen_embed_deploy.triton import free_port

from triton_helpers import gateway_metrics, post_json, wait_for

pytestmark = pytest.mark.server  # starts tritonserver or other processes

KEY, OTHER_KEY = "batch-key", "other-key"
SAME = 1e-6  # the same Triton request underneath


class Gateway:
    """A gateway process over `batch_dir`, started again on the same port by `restart`."""

    def __init__(self, server, batch_dir, *extra):
        self.port, self.args = free_port(), [str(a) for a in extra]
        self.server, self.batch_dir = server, batch_dir
        self.process = None
        self.start()

    def start(self):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "qwen_embed_client.gateway", "--triton-url"]
            + [self.server.grpc_url, "--port", str(self.port), "--batch-dir", str(self.batch_dir)]
            + ["--api-key", KEY, "--api-key", OTHER_KEY, *self.args]
        )
        wait_for(f"http://127.0.0.1:{self.port}/health")

    def kill(self):
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)

    def post(self, path: str, body: dict, key=KEY) -> tuple[int, dict | None]:
        """The status and `error` of POSTing `body` to `path`."""
        url, auth = f"http://127.0.0.1:{self.port}{path}", {"Authorization": f"Bearer {key}"}
        status, answer, _ = post_json(url, body, auth)
        return status, (answer or {}).get("error")

    def api(self, key=KEY) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0
        )


@pytest.fixture
def gateway(server, tmp_path):
    g = Gateway(server, tmp_path / "batches", "--batch-shard-lines", 4)
    yield g
    g.stop()


def upload(api, lines: list) -> str:
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    return api.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch").id


def embed_line(i: int, **body) -> dict:
    body = {"model": "embed", "input": [f"text number {i}", f"another {i}"], **body}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/embeddings", "body": body}


def wait(api, batch_id, done=("completed", "failed", "cancelled", "expired"), timeout=300):
    deadline = time.monotonic() + timeout
    while True:
        batch = api.batches.retrieve(batch_id)
        if batch.status in done:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)


def answers(api, file_id) -> list[dict]:
    return [json.loads(line) for line in api.files.content(file_id).text.splitlines()]


def test_a_batch_answers_every_line_once_as_the_direct_route(gateway):
    api = gateway.api()
    lines = [embed_line(i, dimensions=32) for i in range(10)]
    lines += [
        "{not json",
        {"custom_id": "wrong-url", "method": "POST", "url": "/v1/rerank", "body": {}},
        embed_line(99, dimensions=0),  # refused by the route: an error line with its answer
        {"custom_id": "rerank-in-embed", "method": "GET", "url": "/v1/embeddings", "body": {}},
        embed_line(98, model="\ud800"),  # a lone surrogate (JSON's escape) in the route's answer
        {**embed_line(97), "custom_id": "\ud800"},  # nor can an output line hold one
        "[" * 100_000 + "]" * 100_000,  # JSON nested deeper than the parser recurses
    ]
    source = upload(api, lines)
    assert api.files.retrieve(source).purpose == "batch"
    batch = api.batches.create(
        input_file_id=source,
        endpoint="/v1/embeddings",
        completion_window="24h",
        metadata={"job": "test"},
    )
    assert batch.status == "validating" and batch.request_counts.total == 17
    batch = wait(api, batch.id)
    assert batch.status == "completed" and batch.metadata == {"job": "test"}
    assert (batch.request_counts.completed, batch.request_counts.failed) == (10, 7)
    metrics = gateway_metrics(f"http://127.0.0.1:{gateway.port}")  # a new gateway: from 0
    lines = "qwen_embed_gateway_batch_lines_total"
    assert metrics[lines + '{"outcome": "completed"}'] == 10
    assert metrics[lines + '{"outcome": "failed"}'] == 7
    ended = "qwen_embed_gateway_batches_total"
    assert metrics[ended + '{"status": "completed"}'] == 1
    assert metrics[ended + '{"status": "failed"}'] == 0
    done = answers(api, batch.output_file_id)
    assert sorted(a["custom_id"] for a in done) == sorted(f"req-{i}" for i in range(10))
    for a in done:
        i = int(a["custom_id"].split("-")[1])
        direct = api.embeddings.create(
            model="embed",
            input=[f"text number {i}", f"another {i}"],
            dimensions=32,
            encoding_format="float",
        )
        got = np.array([d["embedding"] for d in a["response"]["body"]["data"]])
        assert a["response"]["status_code"] == 200 and a["error"] is None
        assert np.abs(got - np.array([d.embedding for d in direct.data])).max() <= SAME
    errors = answers(api, batch.error_file_id)
    failed = {a["custom_id"]: a for a in errors}
    assert set(failed) == {None, "wrong-url", "req-99", "rerank-in-embed", "req-98"}
    nameless = sorted(a["error"]["message"] for a in errors if a["custom_id"] is None)
    assert nameless[0] == "'custom_id' must be a string of valid UTF-8"
    assert nameless[1].startswith("not JSON: Expecting")
    assert nameless[2] == "not JSON: JSON nested too deeply" and len(nameless) == 3
    assert failed[None]["error"]["code"] == "invalid_request" and failed[None]["response"] is None
    assert "endpoint" in failed["wrong-url"]["error"]["message"]
    assert failed["req-99"]["response"]["status_code"] == 400
    assert failed["req-99"]["response"]["body"]["error"]["param"] == "dimensions"
    unknown = failed["req-98"]["response"]
    assert (
        unknown["status_code"] == 404
        and "'\\ud800' does not exist" in unknown["body"]["error"]["message"]
    )
    listed = api.batches.list(limit=5)
    assert [b.id for b in listed.data] == [batch.id]
    # Azure's v1 API: the same batches and files under /openai/v1
    azure = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/openai/v1", api_key=KEY)
    assert azure.batches.retrieve(batch.id).output_file_id == batch.output_file_id
    assert answers(azure, batch.output_file_id) == done


def test_rerank_batches_and_files_are_kept_to_their_key(gateway):
    api = gateway.api()
    line = {
        "custom_id": "r1",
        "method": "POST",
        "url": "/v1/rerank",
        "body": {
            "model": "rerank",
            "query": "capital of China?",
            "documents": ["Beijing", "Paris"],
        },
    }
    batch = api.batches.create(
        input_file_id=upload(api, [line]), endpoint="/v1/rerank", completion_window="24h"
    )
    batch = wait(api, batch.id)
    (answer,) = answers(api, batch.output_file_id)
    # the line's tokens counted as the Batch API's, before any direct request's
    tokens = gateway_metrics(f"http://127.0.0.1:{gateway.port}")
    batch_tokens = 'qwen_embed_gateway_tokens_total{"api": "batch", "key": "", "model": "rerank"}'
    assert tokens[batch_tokens] == answer["response"]["body"]["usage"]["total_tokens"] > 0
    direct = api.post("/rerank", body=line["body"], cast_to=object)
    assert answer["response"]["body"]["results"] == direct["results"]
    other = gateway.api(OTHER_KEY)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(batch.output_file_id)
    assert other.batches.list().data == [] and other.files.list().data == []
    with pytest.raises(openai.AuthenticationError):
        gateway.api("wrong").batches.list()
    # Files listed newest first (of a purpose, where asked), and deleted by their key alone.
    listed = api.files.list()
    assert [f.id for f in listed.data] == [batch.output_file_id, batch.input_file_id]
    assert [f.id for f in api.files.list(purpose="batch").data] == [batch.input_file_id]
    with pytest.raises(openai.NotFoundError):
        other.files.delete(batch.output_file_id)
    deleted = api.files.delete(batch.output_file_id)
    assert (deleted.id, deleted.deleted) == (batch.output_file_id, True)
    with pytest.raises(openai.NotFoundError):
        api.files.content(batch.output_file_id)
    assert [f.id for f in api.files.list().data] == [batch.input_file_id]
    assert not (gateway.batch_dir / "files" / batch.output_file_id).exists()


def test_a_batch_survives_a_gateway_killed_mid_batch(gateway):
    """SIGKILL while shards are being written; the next gateway on the same directory resumes
    and the output holds every line exactly once."""
    api = gateway.api()
    lines = [embed_line(i, dimensions=16) for i in range(60)]
    batch = api.batches.create(
        input_file_id=upload(api, lines), endpoint="/v1/embeddings", completion_window="24h"
    )
    deadline = time.monotonic() + 300
    while api.batches.retrieve(batch.id).request_counts.completed < 8:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    gateway.kill()
    gateway.start()
    api = gateway.api()
    before = api.batches.retrieve(batch.id)
    assert before.status == "in_progress" and before.request_counts.completed < 60
    batch = wait(api, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 60
    done = answers(api, batch.output_file_id)
    assert sorted(a["custom_id"] for a in done) == sorted(f"req-{i}" for i in range(60))
    assert len({a["id"] for a in done}) == 60


def test_two_keys_batches_take_turns(gateway):
    """A large batch of one key and, made after it, a small one of another: the keys' shards
    go in turn, so the small batch ends while the large one still runs (one after another,
    it would end after it)."""
    api, other = gateway.api(), gateway.api(OTHER_KEY)
    large = api.batches.create(
        input_file_id=upload(api, [embed_line(i) for i in range(200)]),
        endpoint="/v1/embeddings",
        completion_window="24h",
    )
    small = other.batches.create(
        input_file_id=upload(other, [embed_line(i) for i in range(4)]),
        endpoint="/v1/embeddings",
        completion_window="24h",
    )
    small = wait(other, small.id)
    large = api.batches.retrieve(large.id)
    assert small.status == "completed" and small.request_counts.completed == 4
    assert large.status == "in_progress" and large.request_counts.completed < 200, large
    api.batches.cancel(large.id)
    assert wait(api, large.id).status == "cancelled"


def test_cancel_keeps_what_was_done(gateway):
    api = gateway.api()
    lines = [embed_line(i) for i in range(200)]
    batch = api.batches.create(
        input_file_id=upload(api, lines), endpoint="/v1/embeddings", completion_window="24h"
    )
    while api.batches.retrieve(batch.id).request_counts.completed == 0:
        time.sleep(0.05)
    with pytest.raises(openai.BadRequestError, match=f"is the input of batch {batch.id}"):
        api.files.delete(batch.input_file_id)  # the running batch reads it
    assert api.batches.cancel(batch.id).status == "cancelling"
    batch = wait(api, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    assert api.files.delete(batch.input_file_id).deleted  # once it has ended
    kept = answers(api, batch.output_file_id)
    assert 0 < len(kept) == batch.request_counts.completed < 200
    with pytest.raises(openai.BadRequestError, match="cannot be cancelled"):
        api.batches.cancel(
            wait(
                api,
                api.batches.create(
                    input_file_id=upload(api, lines[:1]),
                    endpoint="/v1/embeddings",
                    completion_window="24h",
                ).id,
            ).id
        )


def test_limits_and_bad_batches_get_clear_400s(server, tmp_path):
    gateway = Gateway(
        server,
        tmp_path / "batches",
        "--batch-max-lines",
        3,
        "--batch-max-line-bytes",
        200,
        "--batch-max-file-bytes",
        2000,
    )
    try:
        api = gateway.api()
        with pytest.raises(openai.BadRequestError, match="more than 3 lines"):
            upload(api, [embed_line(i) for i in range(4)])
        with pytest.raises(openai.BadRequestError, match="line 1 is longer than the limit of 200"):
            upload(api, [embed_line(0, input="x" * 300)])
        with pytest.raises(openai.BadRequestError, match="'purpose' must be one of"):
            api.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
        # a form the gateway cannot parse: OpenAI's error shape, not Starlette's {"detail": ...}
        url = f"http://127.0.0.1:{gateway.port}/v1/files"
        form = {"Authorization": f"Bearer {KEY}", "Content-Type": "multipart/form-data"}
        status, answer, _ = post_json(url, {}, form)
        assert status == 400 and "boundary" in answer["error"]["message"]
        assert answer["error"]["type"] == "invalid_request_error"
        source = upload(api, [embed_line(0)])
        with pytest.raises(openai.BadRequestError, match="'endpoint' must be one of"):
            api.batches.create(
                input_file_id=source, endpoint="/v1/chat/completions", completion_window="24h"
            )
        for window in ("1h", ["24h"], {}):
            with pytest.raises(openai.BadRequestError, match="'completion_window'"):
                api.batches.create(
                    input_file_id=source, endpoint="/v1/embeddings", completion_window=window
                )
        # OpenAI's limits on metadata; a lone surrogate (JSON's escape), which no UTF-8 answer
        # could list again, refused as well (sent as bytes: the SDK cannot encode it).
        created = {
            "input_file_id": source,
            "endpoint": "/v1/embeddings",
            "completion_window": "24h",
        }
        odd = [
            ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "17 pairs, more than 16"),
            ({"metadata": {"k": "v" * 513}}, "metadata", "values 512: the pair of 'k'"),
            ({"metadata": {"k": "\ud800"}}, "metadata", "valid UTF-8"),
            ({"metadata": {"\ud800": "v"}}, "metadata", "valid UTF-8"),
            ({"input_file_id": 7}, "input_file_id", "must be a string"),
        ]
        for fields, param, message in odd:
            status, error = gateway.post("/v1/batches", {**created, **fields})
            assert (status, error["param"]) == (400, param) and message in error["message"]
        status, error = gateway.post("/v1/batches", {**created, "input_file_id": "\ud800"})
        assert status == 404 and error["message"] == "No such File object: \\ud800"
        with pytest.raises(openai.BadRequestError, match="'limit' must be in 1..100"):
            api.batches.list(limit="many")
        assert api.batches.list().data == []  # nothing above was kept
        with pytest.raises(openai.NotFoundError, match="No such File") as e:
            api.batches.create(
                input_file_id="file-nope", endpoint="/v1/embeddings", completion_window="24h"
            )
        assert e.value.code is None  # not model_not_found: no model is missing
        # A custom_id on two lines fails the batch in validation, before any line runs.
        sent = server.metric("qwen_embed_texts_total")
        twice = upload(api, [embed_line(0), embed_line(1), embed_line(0)])
        batch = api.batches.create(
            input_file_id=twice, endpoint="/v1/embeddings", completion_window="24h"
        )
        batch = wait(api, batch.id)
        assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
        (error,) = batch.errors.data
        assert (error.code, error.line, error.param) == ("duplicate_custom_id", 3, "custom_id")
        assert "'req-0' of line 3 is line 1's" in error.message
        assert server.metric("qwen_embed_texts_total") == sent
    finally:
        gateway.stop()
    assert os.path.isfile(tmp_path / "batches" / "state.sqlite")
