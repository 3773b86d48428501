"""The qwen-embed command against a real tritonserver."""

import json
import signal
import subprocess
import sys

import numpy as np
import pytest

from qwen_embed import EncoderSettings, ModelConfig
from qwen_embed.cpu import cpu_features
from qwen_embed.route import Route, choose_route
from qwen_embed_client import EmbeddingClient
from qwen_embed_client.bulk import load
from qwen_embed_client.contract import compact
from qwen_embed_deploy.serving.config import DEMO_MODEL_DIR
from qwen_embed_deploy.triton import free_port

from triton_helpers import infer, wait_until

pytestmark = pytest.mark.server  # starts tritonserver or other processes


def cli(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "qwen_embed_client", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_embed_arguments_to_jsonl_stdout(server):
    r = cli("embed", "hello", "world", "--url", server.grpc_url, "--dimensions", "16")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 2 and len(rows[0]["embedding"]) == 16 and rows[0]["tokens"] == 2


def test_embed_chunks_to_jsonl(server, tmp_path):
    text = "Beijing is the capital of China. The Great Wall runs north of it."
    with EmbeddingClient(server.grpc_url) as client:
        (expected,) = client.embed_chunks([text], chunk_size=6, dimensions=16)
    out = tmp_path / "chunks.jsonl"
    r = cli(
        "embed",
        text,
        "--url",
        server.grpc_url,
        "--chunk-size",
        "6",
        "--dimensions",
        "16",
        "-o",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["tokens"] == expected.token_count
    assert [[c["start"], c["end"]] for c in row["chunks"]] == expected.spans.tolist()
    got = np.array([c["embedding"] for c in row["chunks"]])
    assert np.abs(got - expected.embeddings).max() <= 1e-6
    r = cli("embed", text, "--url", server.grpc_url, "--chunk-size", "6", "-o", "x.npy")
    assert r.returncode != 0 and "--chunk-size writes JSONL" in r.stderr


def test_embed_per_token_to_jsonl(server, tmp_path):
    texts = ["hello world", "a vector per token"]
    with EmbeddingClient(server.grpc_url) as client:
        expected = client.embed_tokens(texts, dimensions=16)
    out = tmp_path / "tokens.jsonl"
    args = ["--url", server.grpc_url, "--dimensions", "16", "--per-token", "-o", str(out)]
    r = cli("embed", *texts, *args)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row, want in zip(rows, expected, strict=True):
        assert (
            row["tokens"] == len(want) and np.abs(np.array(row["embeddings"]) - want).max() < 1e-6
        )
    r = cli("embed", "x", "--url", server.grpc_url, "--per-token", "-o", str(tmp_path / "x.npy"))
    assert r.returncode != 0 and "--per-token writes JSONL" in r.stderr


def test_embed_compact_types_through_client_and_cli(server, tmp_path):
    floats = infer(server, ["hello", "world"], "grpc", dimensions=32)[0]
    with EmbeddingClient(server.grpc_url) as client:
        for kind in ("int8", "uint8", "binary", "ubinary"):
            codes = client.embed(["hello", "world"], dimensions=32, embedding_type=kind)
            assert np.array_equal(codes, compact(floats, kind)), kind
        with pytest.raises(ValueError, match="parameter 'embedding_type' must be one of"):
            client.embed(["hello"], embedding_type="int4")
        bulk = client.embed(["hello", "world"], dimensions=32, priority="bulk")
        assert np.abs(bulk - floats).max() <= 1e-6
        with pytest.raises(ValueError, match="priority must be one of"):
            client.embed(["hello"], priority="urgent")
    out = tmp_path / "codes.npy"
    r = cli(
        "embed",
        "hello",
        "world",
        "--url",
        server.grpc_url,
        "--dimensions",
        "32",
        "--embedding-type",
        "ubinary",
        "-o",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    saved = np.load(out)
    assert saved.dtype == np.uint8 and np.array_equal(saved, compact(floats, "ubinary"))


def test_embed_files_and_stdin_to_npy(server, tmp_path):
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"text": f"t{i}"}) for i in range(5)))
    r = cli(
        "embed",
        "--input",
        str(tmp_path / "in.jsonl"),
        "-o",
        str(tmp_path / "a.npy"),
        "--url",
        server.grpc_url,
    )
    assert r.returncode == 0, r.stderr
    from_stdin = cli(
        "embed",
        "-o",
        str(tmp_path / "b.npy"),
        "--url",
        server.grpc_url,
        stdin="\n".join(f"t{i}" for i in range(5)) + "\n",
    )
    assert from_stdin.returncode == 0, from_stdin.stderr
    a, b = np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy")
    assert a.shape == (5, 1024) and np.abs(a - b).max() <= 1e-5


def test_progress_bar_for_large_jobs(server, tmp_path):
    (tmp_path / "many.txt").write_text("\n".join(f"line {i}" for i in range(1100)))
    r = cli(
        "embed",
        "--input",
        str(tmp_path / "many.txt"),
        "-o",
        str(tmp_path / "m.npy"),
        "--url",
        server.grpc_url,
        "--url",
        server.grpc_url,
    )
    assert r.returncode == 0, r.stderr
    assert "1100/1100 texts" in r.stderr
    assert np.load(tmp_path / "m.npy").shape == (1100, 1024)


def test_a_refused_text_is_named_by_its_place_in_the_input(server, tmp_path):
    """Past the first client call (progress chunks of 1,024 texts, or a job's shards), a
    refused text is named by its record's index in the input file."""
    for count, bad, out, more in [
        (1030, 1027, "v.npy", []),
        (30, 21, "job", ["--shard-size", "8"]),
    ]:
        texts = [f"line {i}" for i in range(count)]
        texts[bad] = " "
        source = tmp_path / f"texts-{count}.jsonl"
        source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        r = cli(
            "embed",
            "--input",
            str(source),
            "-o",
            str(tmp_path / out),
            *more,
            "--url",
            server.grpc_url,
        )
        assert r.returncode == 1 and f"'TEXT[{bad}]' is empty" in r.stderr, (out, r.stderr)


def test_a_jsonl_line_it_cannot_take_is_named_by_its_number(server, tmp_path):
    """A JSONL input's line that is not JSON, not a string or object, without its text field
    or with fields of other types: one line on stderr naming the file's line (blank lines
    counted), exit 1, no traceback, for embed and for rerank's documents and their media."""
    cases = [
        ("embed", '{"text": "a"}\n\n{bad', "line 3 is not JSON: Expecting property name"),
        ("embed", "[" * 100_000 + "]" * 100_000, "line 1 is not JSON: JSON nested too deeply"),
        ("embed", "5", "line 1: each line must be a JSON string or object"),
        ("embed", '["a", "b"]', "line 1: each line must be a JSON string or object"),
        ("embed", '{"txt": "a"}', "line 1: the object has no 'text' field (--text-field)"),
        ("embed", '{"text": 5}', "line 1: 'text' must be a string"),
        ("rerank", '"a"\n{"text": "b", "images": "x.png"}', "line 2: 'images' must be a list"),
        ("rerank", '{"videos": [["f.png", 3]]}', "line 1: 'videos' must be a list of file paths,"),
    ]
    for command, text, message in cases:
        source = tmp_path / "in.jsonl"
        source.write_text(text + "\n")
        where = ["--input", str(source)] if command == "embed" else ["a query", str(source)]
        r = cli(command, *where, "--url", server.grpc_url)
        assert r.returncode == 1 and r.stderr.count("\n") == 1, (text[:40], r.stderr)
        assert r.stderr.startswith(f"qwen-embed: error: {source} {message}"), r.stderr


def test_health_info_and_errors(server):
    r = cli("health", "--url", server.grpc_url)
    assert r.returncode == 0 and "ready" in r.stdout
    # The facts the steps publish in their configs (no metrics read).
    info = json.loads(cli("info", "--url", server.grpc_url).stdout)
    assert info["dimension"] == 1024 and int(info["max_texts_per_request"]) == 256
    assert info["max_input_tokens"] == "8192" and info["tokens_per_text"] == 8192
    # conftest.server: the demo model with dtype float32
    settings = EncoderSettings(dtype="float32")
    expected = choose_route(settings, ModelConfig.from_dir(DEMO_MODEL_DIR), "cpu", cpu_features())
    assert Route.from_dict(info["route"]) == expected
    assert info["route"]["attention_reason"].startswith("auto")
    # the demo model has no config_sentence_transformers.json: Qwen3-Embedding's prompts
    assert info["prompt_names"] == ["document", "query"] and info["default_prompt_name"] is None
    down = cli("health", "--url", f"127.0.0.1:{free_port()}")
    assert down.returncode == 1 and "not ready" in down.stderr
    bad = cli("embed", "x", "--url", server.grpc_url, "--dimensions", "0")
    assert bad.returncode == 1
    assert bad.stderr.strip().count("\n") == 0 and "'dimensions' must be >= 1" in bad.stderr


def test_bulk_job_resumes_after_ctrl_c_and_a_crash(server, tmp_path):
    """A job in shards, interrupted by Ctrl-C and then killed outright, finishes on the third
    run: every text once, in order, with its id; complete shards are not embedded again."""
    rng = np.random.default_rng(4)
    words = ["alpha", "river", "stone", "cloud", "seven", "market", "blue", "quiet"]
    texts = [f"{i} " + " ".join(rng.choice(words, 30)) for i in range(160)]
    source = tmp_path / "big.jsonl"
    source.write_text(
        "".join(json.dumps({"id": f"doc-{i}", "text": t}) + "\n" for i, t in enumerate(texts))
    )
    out = tmp_path / "out"
    command = [sys.executable, "-m", "qwen_embed_client", "embed", "--input", str(source)]
    command += ["-o", str(out), "--shard-size", "8", "--url", server.grpc_url]

    def interrupted(sig):
        # A shell's background job (make test &) ignores SIGINT, and Python then never turns
        # it into KeyboardInterrupt: give the job a terminal's default.
        reset = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
        proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, preexec_fn=reset)
        before = len(list(out.glob("shard-*[0-9].npy")))
        wait_until(lambda: len(list(out.glob("shard-*[0-9].npy"))) >= before + 2, "two shards")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        return proc.returncode, err

    code, err = interrupted(signal.SIGINT)  # Ctrl-C
    assert code == 130 and "run the same command again to resume" in err, err
    interrupted(signal.SIGKILL)  # a crash
    done = len(list(out.glob("shard-*[0-9].npy")))
    assert 4 <= done < 20
    wait_until(  # the killed run's last requests may still be in the server
        lambda: (
            server.metric("qwen_embed_executing_requests") == 0
            and server.metric("nv_inference_pending_request_count", model="encoder") == 0
        ),
        "the server idle",
    )
    sent_before = server.metric("qwen_embed_texts_total")
    r = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "160/160 texts" in r.stderr and "tokens/s" in r.stderr
    # Only the shards not yet written were embedded (at most a shard in flight is redone).
    assert server.metric("qwen_embed_texts_total") - sent_before == 160 - 8 * done
    ids, vectors = load(out)
    assert ids.tolist() == [f"doc-{i}" for i in range(160)]
    with EmbeddingClient(server.grpc_url) as client:
        expected = client.embed(texts)
    assert vectors.shape == (160, 1024) and np.abs(vectors - expected).max() <= 1e-5
    # A finished job reruns as a no-op; another input in the same directory is refused.
    sent_before = server.metric("qwen_embed_texts_total")
    assert subprocess.run(command, capture_output=True, timeout=300).returncode == 0
    assert server.metric("qwen_embed_texts_total") == sent_before
    source.write_text(json.dumps({"text": "something else"}) + "\n")
    other = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert other.returncode == 1 and "holds another job" in other.stderr, other.stderr
