"""Production behaviour on real tritonservers: closed admin APIs, bind address, torch only in
the encoders, a killed stub recovered by the watchdog under load, a bounded queue, SIGTERM
draining in-flight requests."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from qwen_embed.engine import EncoderSettings, host_weights, plan
from qwen_embed_client import EmbeddingClient, EmbeddingError
from qwen_embed_client.contract import MAX_INPUTS
from qwen_embed_deploy.launcher import (
    RESTART_LIMIT,
    RESTART_WINDOW_S,
    OomKills,
    check_ports,
    find_stubs,
    may_restart,
    proc_stat,
    server_stubs,
    stub_processes,
)
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.triton import TritonServer, free_port

from triton_helpers import (
    EXECUTING,
    encoder_kept_busy,
    infer,
    post_json,
    text_input,
    wait_until,
)

pytestmark = pytest.mark.server  # starts tritonserver or other processes

LONG_TEXT = " ".join(["the quick brown fox"] * 300)  # ~1200 tokens: ~1 s of encoder work here


def start_server(demo_dir, tmp_path, launcher_args=(), **kwargs):
    """The checked-in repository (or `model_repository`) without its reranking models: these
    tests fail and recover the embed path, and a server starts faster without them."""
    env = {"QWEN_EMBED_MODEL_DIR": str(demo_dir)}
    args = [*launcher_args, "--no-rerank"]
    return TritonServer(
        env=env, log_path=tmp_path / "server.log", launcher_args=args, **kwargs
    ).start()


def http_status(url, key=None):
    headers = {"admin-key": key} if key else {}
    request = urllib.request.Request(url, data=b"{}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def launcher_command(args=()) -> tuple[list[str], list[int]]:
    """The launcher without the rerank models on free ports: (its command, the HTTP, gRPC and
    metrics ports)."""
    ports = [free_port() for _ in range(3)]
    command = [sys.executable, "-m", "qwen_embed_deploy.launcher", "--no-rerank", *args]
    command += [f"--http-port={ports[0]}", f"--grpc-port={ports[1]}"]
    return command + [f"--metrics-port={ports[2]}"], ports


def launch(env: dict, args: list[str], **run) -> subprocess.CompletedProcess:
    """The launcher run to its end (a deployment that cannot start), its output captured."""
    env = {**os.environ, **env}
    command = launcher_command(args)[0]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, **run)


def launcher_error(env: dict, args: list[str]) -> str:
    """The launcher's one line of error (exit status 2) for a deployment that cannot start."""
    done = launch(env, args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "error: " in lines[0], done.stderr
    return lines[0]


@pytest.mark.parametrize(
    "env, args, message",
    [
        ({"QWEN_EMBED_MODEL_DIR": "/nonexistent/checkpoint"}, [], "neither a checkpoint"),
        ({"QWEN_EMBED_ENCODER_SETTINGS": "dtype=float9"}, [], "dtype must be one of"),
        ({}, ["--cpu-instances", "none"], "--cpu-instances is auto"),
        # E2Rank's recipe on a tokenizer that appends <|endoftext|> (the demo's) reads it twice
        ({}, ["--rerank-recipe", "e2rank"], "appends <|endoftext|> to every text, which E2Rank"),
        # the gateway's names of a model the repository does not hold (rerank not loaded)
        ({}, ["--served-model-name", "rerank=r"], "the gateway serves no model 'rerank'"),
    ],
)
def test_a_bad_setting_or_checkpoint_is_said_in_one_line(demo_dir, env, args, message):
    """What the deployment asks for is read before any server starts: a checkpoint not found
    or a setting out of range ends the launcher with exit status 2 and one line saying so."""
    assert message in launcher_error({"QWEN_EMBED_MODEL_DIR": str(demo_dir), **env}, args)


LFS_POINTER = b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 1211\n"


def test_a_port_in_use_is_said_in_one_line(demo_dir):
    """Triton binds its ports only after every model has loaded: a port another process
    listens on, or one given for two services, is said before any server starts."""
    with socket.socket() as other:
        other.bind(("0.0.0.0", 0))
        other.listen()
        port = other.getsockname()[1]
        line = launcher_error(
            {"QWEN_EMBED_MODEL_DIR": str(demo_dir)}, ["--gateway-port", str(port)]
        )
    assert f"--gateway-port {port} on 0.0.0.0: Address already in use" in line
    with pytest.raises(ValueError, match=f"--grpc-port and --http-port are both port {port}"):
        check_ports("127.0.0.1", {"--http-port": port, "--grpc-port": port})
    check_ports("127.0.0.1", {"--http-port": port, "--gateway-port": 0})  # free again; 0: off


def cut_short(path: Path) -> bytes:
    """A safetensors file's header and its first few bytes of data: an interrupted download."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return size.to_bytes(8, "little") + f.read(size + 1000)


@pytest.mark.parametrize(
    "name, damage, message",
    [
        ("model.safetensors", None, "no *.safetensors in"),
        ("model.safetensors", cut_short, "model.safetensors is cut short: its header describes"),
        ("tokenizer.json", None, "has no tokenizer.json"),
        ("tokenizer.json", lambda _: LFS_POINTER, "tokenizer.json is a Git LFS pointer, not the"),
    ],
    ids=["no weights", "weights cut short", "no tokenizer", "tokenizer an LFS pointer"],
)
def test_a_damaged_checkpoint_is_said_in_one_line(demo_dir, tmp_path, name, damage, message):
    """The files a model reads only after others (the encoder's weights after its config, a
    tensor's bytes after the file's header, the tokenizer model's file) are checked before
    any server starts too, as far as a look costs no time (a tokenizer.json cut short is
    found by the tokenizer model as it loads): the demo checkpoint with `name` damaged
    (`damage` of its bytes) or left out (None)."""
    for f in demo_dir.iterdir():
        if f.name != name:
            (tmp_path / f.name).symlink_to(f)
    if damage is not None:
        (tmp_path / name).write_bytes(damage(demo_dir / name))
    assert message in launcher_error({"QWEN_EMBED_MODEL_DIR": str(tmp_path)}, [])


@pytest.mark.parametrize(
    "damaged, args, last_line",
    [
        (True, [], r"tritonserver exited before it was ready \(exit status 1\): its log above"),
        (False, ["--startup-timeout", "0.5"], r"tritonserver not ready in 0.5s: stopped it"),
    ],
    ids=["a model fails to load", "past the start-up timeout"],
)
def test_a_server_that_is_not_ready_ends_the_launcher(demo_dir, tmp_path, damaged, args, last_line):
    """A server that exits before it is ready (a tokenizer.json cut short, found only as the
    tokenizer model loads), or is not ready in --startup-timeout, ends the launcher with exit
    status 1 and a last line saying which; the one it stopped leaves no process behind."""
    model = demo_dir
    if damaged:
        model = tmp_path / "model"
        model.mkdir()
        for f in demo_dir.iterdir():
            (model / f.name).symlink_to(f)
        (model / "tokenizer.json").unlink()
        (model / "tokenizer.json").write_bytes((demo_dir / "tokenizer.json").read_bytes()[:1000])
    done = launch({"QWEN_EMBED_MODEL_DIR": str(model)}, args)
    assert done.returncode == 1, done.stderr
    assert re.search(last_line, done.stderr.strip().splitlines()[-1]), done.stderr
    if damaged:
        assert "tokenizer.json is not a tokenizer the tokenizers library reads" in done.stderr
    # tritonserver and its stubs are the processes that name the served copy
    served = re.search(r"serving a copy with .*: (\S+)", done.stderr).group(1)
    left = subprocess.run(["pgrep", "-f", served], capture_output=True, text=True)
    assert left.stdout == "", left.stdout


def test_oom_kills_are_counted_since_the_last_look(tmp_path):
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 12\noom_kill 3\nnuma_hit 9\n")
    kills = OomKills(vmstat)
    assert kills.since() == ""
    vmstat.write_text("nr_free_pages 12\noom_kill 5\nnuma_hit 9\n")
    assert kills.since().startswith("the kernel's OOM killer ended 2 process(es) on this host")
    assert kills.since() == ""  # counted once
    vmstat.write_text("nr_free_pages 12\n")  # a kernel that does not count them
    assert OomKills(vmstat).since() == ""


def memory_cgroup(tmp_name: str, limit_bytes: int) -> Path | None:
    """A memory cgroup (v1 or v2) of that limit, where this process may make one."""
    for root, limit, mark in (
        ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.limit_in_bytes"),
        ("/sys/fs/cgroup", "memory.max", "cgroup.controllers"),  # a v2 hierarchy
    ):
        group = Path(root) / tmp_name
        if not (Path(root) / mark).exists():  # not a cgroup file system of that kind
            continue
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            (group / limit).write_text(str(limit_bytes))
            return group
        except OSError:
            group.rmdir()
    return None


def launch_in_memory_cgroup(model: Path, limit_bytes: int) -> subprocess.CompletedProcess:
    """The launcher on `model`, run to its end with every process it starts in a memory
    cgroup of that limit (skipped where none can be made)."""
    group = memory_cgroup(f"qwen-embed-test-{os.getpid()}", limit_bytes)
    if group is None:
        pytest.skip("no memory cgroup can be made here")
    try:
        return launch(
            {"QWEN_EMBED_MODEL_DIR": str(model)},
            [],
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
        )
    finally:
        wait_until(lambda: not (group / "cgroup.procs").read_text().strip(), "cgroup empty")
        group.rmdir()


def test_a_server_killed_for_memory_is_said_so(demo_dir):
    """Triton says only "Stub process ... is not healthy" of a stub the kernel's OOM killer
    ended; the launcher says what happened. The whole deployment in a memory cgroup too small
    for its stubs."""
    done = launch_in_memory_cgroup(demo_dir, 350 << 20)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "tritonserver exited before it was ready" in last, done.stderr
    assert "the kernel's OOM killer ended" in last and "need more memory" in last, last


def sparse_checkpoint(demo_dir: Path, folder: Path, layers: int) -> Path:
    """Qwen3-Embedding-8B's widths over `layers` layers, every weight in one bf16 file whose
    bytes are a hole (a sparse file: its size without its disk), with the demo's tokenizer."""
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((demo_dir / name).read_bytes())
    config = json.loads((demo_dir / "config.json").read_text())
    hidden, inter, heads, kv, dim = 4096, 12288, 32, 8, 128
    config |= {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": dim,
        "num_hidden_layers": layers,
    }
    (folder / "config.json").write_text(json.dumps(config))
    shapes = {
        "model.embed_tokens.weight": [config["vocab_size"], hidden],
        "model.norm.weight": [hidden],
    }
    for i in range(layers):
        at = f"model.layers.{i}."
        shapes |= {
            at + "input_layernorm.weight": [hidden],
            at + "post_attention_layernorm.weight": [hidden],
            at + "self_attn.q_proj.weight": [heads * dim, hidden],
            at + "self_attn.k_proj.weight": [kv * dim, hidden],
            at + "self_attn.v_proj.weight": [kv * dim, hidden],
            at + "self_attn.o_proj.weight": [hidden, heads * dim],
            at + "self_attn.q_norm.weight": [dim],
            at + "self_attn.k_norm.weight": [dim],
            at + "mlp.gate_proj.weight": [inter, hidden],
            at + "mlp.up_proj.weight": [inter, hidden],
            at + "mlp.down_proj.weight": [hidden, inter],
        }
    header, offset = {}, 0
    for key, shape in shapes.items():
        size = 2 * int(np.prod(shape))
        header[key] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + offset)
    return folder


def test_weights_larger_than_the_memory_are_refused_before_loading(demo_dir, tmp_path):
    """A checkpoint whose decoder weights alone exceed what the container may hold would load
    for minutes into the OOM killer: the launcher says so first, exit status 2, no server
    started. Three layers of Qwen3-Embedding-8B's widths (1.1 GiB of bf16, 2.2 GiB where this
    CPU's route holds them in fp32, which bfloat16 would halve) in a 700 MiB memory cgroup."""
    wide = sparse_checkpoint(demo_dir, tmp_path / "wide", 3)
    weights = host_weights(*plan(wide, EncoderSettings(device="cpu")))  # the repository's route
    done = launch_in_memory_cgroup(wide, 700 << 20)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    gib = f"{weights.bytes / 2**30:.1f} GiB"
    assert f"weights alone need at least {gib}" in line and f"encoder 1 x {gib}" in line, line
    assert "more than this container's memory limit (0.7 GiB)" in line, line
    assert ("dtype=bfloat16" in line) == (weights.bytes == 4 * weights.elements), line


def can_mount_a_small_shared_memory() -> bool:
    probe = ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except OSError:
        return False


def test_a_small_shared_memory_bounds_answers_and_never_hangs(demo_dir, tmp_path):
    """Docker's and Kubernetes' default /dev/shm is 64 MiB. An answer a Python model cannot
    fit there is never sent, and its request waited for its deadline: now the launcher warns
    at start, the encoder refuses an answer past a quarter of /dev/shm before any work, and
    the client library halves a job's requests until theirs fit. The launcher in a mount
    namespace of its own, /dev/shm a 64 MiB tmpfs (skipped where one cannot be mounted)."""
    if not can_mount_a_small_shared_memory():
        pytest.skip("no mount namespace with a tmpfs can be made here")
    launcher, ports = launcher_command()
    script = "mount -t tmpfs -o size=64m tmpfs /dev/shm && exec " + " ".join(launcher)
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["unshare", "-m", "sh", "-c", script],
            env={**os.environ, "QWEN_EMBED_MODEL_DIR": str(demo_dir)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        ready = f"http://127.0.0.1:{ports[0]}/v2/health/ready"
        wait_until(lambda: http_ok(ready), "the server", log=log)
        assert "one request may return 16 MiB of vectors here (64 MiB from 256 MiB up)" in (
            log.read_text()
        )
        texts = [" ".join(["word"] * 1100)] * 4  # 4 x 1101 x 1024 float32: 17.2 MiB
        url = f"127.0.0.1:{ports[1]}"
        client = grpcclient.InferenceServerClient(url)
        with pytest.raises(InferenceServerException) as refused:
            client.infer(
                "embed",
                [text_input(grpcclient, texts)],
                parameters={"per_token": True},
                client_timeout=60,  # the hang this was
            )
        assert "StatusCode.INVALID_ARGUMENT" in str(refused.value.status())
        assert "more than the 16 MiB one request may return on this server (a quarter of " in (
            refused.value.message()
        )

        def refused_requests():
            stats = client.get_inference_statistics("embed", as_json=True)
            return int(stats["model_stats"][0]["inference_stats"]["fail"].get("count", 0))

        before = refused_requests()
        with EmbeddingClient(url) as embedding:
            halved = embedding.embed_tokens(texts)
            alone = [embedding.embed_tokens([t])[0] for t in texts[:1]]
        assert refused_requests() > before  # refused, then halved
        assert [v.shape for v in halved] == [(1101, 1024)] * 4
        np.testing.assert_array_equal(halved[0], alone[0])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def test_admin_apis_need_the_key(server):
    base = f"http://{server.http_url}/v2"
    for path in ("/repository/index", "/repository/models/embed/unload", "/logging"):
        status, body = http_status(base + path)
        assert status == 403 and "admin-key" in body, (path, status, body)
    status, body = http_status(base + "/repository/index", key="wrong")
    assert status == 403
    status, body = http_status(base + "/repository/index", key=server.admin_key)
    assert status == 200 and '"name":"embed"' in body
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="admin-key"):
        client.get_model_repository_index()
    # gRPC metadata keys carry Triton's prefix.
    key = {"triton-grpc-protocol-admin-key": server.admin_key}
    index = client.get_model_repository_index(headers=key)
    served = {"embed", "encoder", "tokenizer", "rerank", "rerank_encoder", "rerank_tokenizer"}
    assert {m.name for m in index.models} == served
    # Inference, health, metadata and config stay open.
    assert client.is_server_ready() and client.get_model_config("embed")
    assert infer(server, ["still open"], "grpc")[0].shape == (1, 1024)


def listening_addresses(port):
    """IPv4 addresses of LISTEN sockets on `port`, from /proc/net/tcp{,6} (hex, little-endian
    words; gRPC listens on IPv6 with a v4-mapped address). An unspecified address reads '*'."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            host, hex_port = fields[1].split(":")
            if fields[3] != "0A" or int(hex_port, 16) != port:
                continue
            if int(host, 16) == 0 or host[:-8] not in ("", "0000000000000000FFFF0000"):
                found.append("*")
            else:
                found.append(".".join(str(int(host[-8:][i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def test_endpoints_bind_the_configured_address(server):
    for port in (server.http_port, server.grpc_port, server.metrics_port):
        assert listening_addresses(port) == ["127.0.0.1"], port


def test_only_the_encoders_load_torch(server):
    """The processes beside the encoders never load torch: the tokenizer stubs (several per
    server) and the launcher, whose encoder facts are worked out in a child process that ends."""

    def maps_torch(pid: int) -> bool:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    server_pid = server.status()["server_pid"]
    launcher = int(proc_stat(server_pid)[1])  # tritonserver's parent
    stubs = stub_processes(server_pid)
    assert {"encoder", "tokenizer"} <= set(stubs.values())
    assert not maps_torch(launcher)
    assert {model for pid, model in stubs.items() if maps_torch(pid)} == {
        model for model in stubs.values() if model.endswith("encoder")
    }


def test_killed_encoder_stub_recovers_under_load(demo_dir, tmp_path):
    """Requests fail only while the watchdog reloads the encoder; no client hangs."""
    server = start_server(demo_dir, tmp_path, exit_timeout_s=1)
    results = []  # (start, end, error or None)
    stop = threading.Event()
    try:

        def client():
            c = grpcclient.InferenceServerClient(server.grpc_url)
            while not stop.is_set():
                start = time.monotonic()
                try:
                    c.infer(
                        "embed", [text_input(grpcclient, ["a short text"] * 4)], client_timeout=30
                    )
                    error = None
                except InferenceServerException as e:
                    error = e
                    time.sleep(0.1)
                results.append((start, time.monotonic(), error))

        threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        wait_until(lambda: sum(r[2] is None for r in results) >= 4, "the clients' first answers")
        stubs = stub_processes(server.status()["server_pid"])
        (encoder_pid,) = [pid for pid, model in stubs.items() if model == "encoder"]
        killed_at = time.monotonic()
        os.kill(encoder_pid, signal.SIGKILL)

        def recovered():  # the watchdog reloaded the encoder and clients succeed again
            recent = [r for r in results if r[0] > killed_at + 1 and r[2] is None]
            return len(recent) >= 8 and (server.status()["reloads"] or restarted())

        def restarted():  # the kill hit Triton's bug (see the launcher): the server died too
            return server.status()["restarts"]

        # A guard against a hang, not a speed check: a reload under the full suite's load
        # takes a while on two cores.
        wait_until(recovered, "answers after the reload", timeout=180, log=server.log_path)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a client hung"
        failures = [r for r in results if r[2] is not None]
        assert failures, "killing the stub should have failed some requests"
        # Failed on the dead stub (and, where the kill hit Triton's bug, on the dead server);
        # never a request left unanswered until its client's deadline.
        expected = ("StatusCode.UNAVAILABLE",) if restarted() else ()
        odd = [
            (f[2].status(), f[2].message(), f[0] - killed_at)
            for f in failures
            if "not healthy" not in f[2].message() and f[2].status() not in expected
        ]
        assert not odd, odd
        if not restarted():
            assert [model for model, _ in server.status()["reloads"]] == ["encoder"]
        assert all(f[1] >= killed_at for f in failures)  # none before the kill
        # Once the reloaded encoder has answered, no request sent after that answer fails.
        first_answer = min(r[1] for r in results if r[0] > killed_at and r[2] is None)
        assert all(f[0] < first_answer for f in failures), "a request failed after recovery"
        window = max(f[1] for f in failures) - killed_at
        print(
            f"recovery window {window:.1f}s, {len(failures)} failed requests, "
            f"reloads {server.status()['reloads']}"
        )
        assert infer(server, ["after recovery"], "grpc")[0].shape == (1, 1024)
    finally:
        stop.set()
        server.stop()


def gateway_pids(port: int) -> list[int]:
    found = subprocess.run(
        ["pgrep", "-f", f"qwen_embed_client.gateway .*--port {port} "],
        capture_output=True,
        text=True,
    )
    return [int(pid) for pid in found.stdout.split()]


def test_a_gateway_that_dies_is_started_again(demo_dir, tmp_path):
    """The launcher watches the gateway as it watches tritonserver: a gateway killed is started
    again on its port, the server left as it was; one that keeps dying stops the server."""
    port = free_port()
    server = start_server(demo_dir, tmp_path, launcher_args=["--gateway-port", str(port)])
    try:
        health = f"http://127.0.0.1:{port}/health"
        wait_until(lambda: http_ok(health), "the gateway")
        (first,) = gateway_pids(port)
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: gateway_pids(port) not in ([], [first]), "a new gateway")
        wait_until(lambda: http_ok(health), "the gateway again", log=server.log_path)
        body = json.dumps({"model": "embed", "input": ["a short text"]}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/embeddings",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            assert len(json.loads(r.read())["data"][0]["embedding"]) == 1024
        said = server.log_path.read_text()
        assert "gateway exited unasked (signal SIGKILL): starting it again" in said
        assert not server.status()["restarts"]  # the server itself untouched
        # One that keeps dying (RESTART_LIMIT restarts in RESTART_WINDOW_S) is left to the
        # orchestrator: the server stopped, the launcher's exit status 1.
        for _ in range(RESTART_LIMIT):
            wait_until(lambda: gateway_pids(port), "a gateway", log=server.log_path)
            os.kill(gateway_pids(port)[0], signal.SIGKILL)
        wait_until(lambda: server.proc.poll() is not None, "the launcher's exit")
        assert server.proc.returncode == 1
        assert "restarted too often: stopping the server" in server.log_path.read_text()
    finally:
        server.stop()


def test_no_request_lost_to_a_dead_stub_or_a_crashed_server(demo_dir, tmp_path):
    """The client library and the gateway (which uses it) send a request that failed again
    until the server answers: zero failures under load, first across a killed encoder stub
    (the watchdog reloads it), then across tritonserver aborting (the launcher starts it again
    and removes the dead server's shared memory)."""
    gateway_port = free_port()
    server = start_server(
        demo_dir, tmp_path, exit_timeout_s=1, launcher_args=["--gateway-port", str(gateway_port)]
    )
    results = []  # (route, error or None)
    stop = threading.Event()
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{gateway_port}/health"), "the gateway")

        def library():
            with EmbeddingClient(server.grpc_url, retry_deadline_s=60) as client:
                while not stop.is_set():
                    try:
                        client.embed(["a short text"] * 4)
                        results.append(("client", None))
                    except EmbeddingError as e:
                        results.append(("client", e))

        def gateway():
            url = f"http://127.0.0.1:{gateway_port}/v1/embeddings"
            body = json.dumps({"model": "embed", "input": ["a short text"] * 4}).encode()
            while not stop.is_set():
                request = urllib.request.Request(
                    url, data=body, headers={"Content-Type": "application/json"}
                )
                try:
                    with urllib.request.urlopen(request, timeout=120) as r:
                        results.append(("gateway", None if r.status == 200 else r.status))
                except (urllib.error.HTTPError, OSError) as e:
                    results.append(("gateway", e))

        def answered_since(done_before):
            # Guards against a hang, as above.
            wait_until(
                lambda: {r for r, e in results[done_before:] if e is None} == {"client", "gateway"},
                "answers on both routes",
                timeout=180,
                log=server.log_path,
            )

        threads = [threading.Thread(target=f, daemon=True) for f in (library, gateway) * 2]
        for t in threads:
            t.start()
        answered_since(0)

        stubs_server = server.status()["server_pid"]
        stubs = stub_processes(stubs_server)
        (encoder_pid,) = [pid for pid, model in stubs.items() if model == "encoder"]

        def long_text():  # an execute that outlasts a metrics scrape, for the kill to land in
            with EmbeddingClient(server.grpc_url, retry_deadline_s=60) as client:
                try:
                    client.embed(["a longer text " * 1000])
                    results.append(("client", None))
                except EmbeddingError as e:
                    results.append(("client", e))

        in_flight = threading.Thread(target=long_text, daemon=True)
        in_flight.start()
        wait_until(lambda: server.metric(EXECUTING) >= 1, "an execute in the encoder")
        os.kill(encoder_pid, signal.SIGKILL)
        done_before = len(results)
        wait_until(
            lambda: server.status()["reloads"] or server.status()["restarts"],
            "the watchdog's reload",
            timeout=180,
            log=server.log_path,
        )
        answered_since(done_before)
        failed = server.metric("nv_inference_request_failure", model="embed")
        if not Path(f"/proc/{stubs_server}").exists():
            # Triton's bug (see the launcher) hit, maybe after the reload, as the old instance
            # went: the scrape may have reached the next server; its restart is what counts.
            wait_until(
                lambda: server.status()["restarts"],
                "the launcher's restart",
                timeout=180,
                log=server.log_path,
            )
        elif not server.status()["restarts"]:
            assert [model for model, _ in server.status()["reloads"]] == ["encoder"]
            # Requests did fail on the dead stub inside Triton: they were sent again.
            assert failed > 0

        restarts = len(server.status()["restarts"])
        crashed = server.status()["server_pid"]
        # One region per live stub: the killed stub's was removed after the reload.
        regions = shm_regions(crashed)
        assert regions == {stub.region for stub in server_stubs(crashed).values()}
        os.kill(crashed, signal.SIGABRT)  # as Triton's Python backend aborts
        done_before = len(results)
        wait_until(
            lambda: len(server.status()["restarts"]) > restarts,
            "the launcher's restart",
            timeout=180,
            log=server.log_path,
        )
        answered_since(done_before)
        stop.set()
        for t in [*threads, in_flight]:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in [*threads, in_flight]), "a client hung"
        failures = [(route, e) for route, e in results if e is not None]
        assert failures == [], failures[:3]
        assert {route for route, _ in results} == {"client", "gateway"}
        # The dead server's stubs are gone and their regions removed; the new server's stubs
        # have one region each.
        serving = server.status()["server_pid"]
        assert serving != crashed
        assert not find_stubs(lambda ppid, region: region in regions)
        assert all(not (Path("/dev/shm") / r).exists() for r in regions)
        assert shm_regions(serving) == {stub.region for stub in server_stubs(serving).values()}
    finally:
        stop.set()
        server.stop()


def test_a_server_that_keeps_dying_is_not_restarted_for_ever():
    restarted_at = [float(i) for i in range(RESTART_LIMIT)]
    assert may_restart([], now=0.0)
    assert may_restart(restarted_at[:-1], now=RESTART_LIMIT)
    assert not may_restart(restarted_at, now=RESTART_LIMIT)
    assert may_restart(restarted_at, now=RESTART_WINDOW_S + 0.5)  # the first fell out of it


def shm_regions(server_pid: int) -> set[str]:
    """The /dev/shm regions of a server's Python stubs, by the prefix the launcher gave it."""
    (prefix,) = re.findall(r"shm-region-prefix-name=(\S+)", cmdline(server_pid))
    return {region.name for region in Path("/dev/shm").glob(f"{prefix}*")}


def test_watchdog_tries_a_failed_reload_again(demo_dir, tmp_path):
    """A reload that fails (here: the served config unreadable to Triton for a while) is tried
    again, after waits that double, until one succeeds; the encoder then answers. Meanwhile
    Triton 2.51 still says ready, and the liveness probe, made for recovery that fails, fails."""
    server = start_server(demo_dir, tmp_path, exit_timeout_s=1)
    try:
        assert run_probe(server).returncode == 0
        config = Path(server.status()["model_repository"]) / "encoder" / "config.pbtxt"
        good = config.read_text()
        config.write_text("this is not a model config {")
        stubs = stub_processes(server.status()["server_pid"])
        (encoder_pid,) = [pid for pid, model in stubs.items() if model == "encoder"]
        os.kill(encoder_pid, signal.SIGKILL)

        def failed_reloads():
            return server.log_path.read_text().count("watchdog: reloading 'encoder' failed")

        wait_until(lambda: failed_reloads() >= 2, "two failed reloads", log=server.log_path)
        assert server.status()["reloads"] == []
        assert server.ready()
        failed = run_probe(server)
        assert failed.returncode == 1 and "not healthy" in failed.stderr, failed.stderr
        config.write_text(good)
        wait_until(lambda: server.status()["reloads"], "the reload", log=server.log_path)
        assert [model for model, _ in server.status()["reloads"]] == ["encoder"]
        assert infer(server, ["after recovery"], "grpc")[0].shape == (1, 1024)
        assert run_probe(server).returncode == 0
    finally:
        server.stop()


def http_ok(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_full_queue_answers_unavailable_at_once(demo_dir, tmp_path):
    repo = render(tmp_path / "repo", {"embed": demo_dir}, max_queue_size=2)
    server = start_server(demo_dir, tmp_path, model_repository=repo)
    try:
        outcomes = []

        def client(i):  # outcomes in the order the answers came back
            c = grpcclient.InferenceServerClient(server.grpc_url)
            try:
                c.infer("embed", [text_input(grpcclient, [LONG_TEXT])], client_timeout=300)
                outcomes.append(("ok", ""))
            except InferenceServerException as e:
                outcomes.append((str(e.status()), e.message()))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        rejected = [o for o in outcomes if o[0] != "ok"]
        served = [o for o in outcomes if o[0] == "ok"]
        assert len(outcomes) == 16 and rejected and served, outcomes
        assert all(o[0] == "StatusCode.UNAVAILABLE" for o in rejected), rejected
        assert all("queue" in o[1] for o in rejected), rejected
        # Refused without waiting for the work ahead of them: every refusal came back before
        # the last of the served answers.
        last_served = max(i for i, o in enumerate(outcomes) if o[0] == "ok")
        assert all(i < last_served for i, o in enumerate(outcomes) if o[0] != "ok"), outcomes
        assert infer(server, ["after overload"], "grpc")[0].shape == (1, 1024)
    finally:
        server.stop()


def kernel_segfaults(pids) -> list[str] | None:
    """The kernel log's segfault lines of these processes; None where the log is unreadable."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if log.returncode != 0:
        return None
    crashed = (re.search(r"\[(\d+)\]: segfault", line) for line in log.stdout.splitlines())
    return [m.string for m in crashed if m and int(m[1]) in pids]


def test_sigterm_drains_in_flight_requests(demo_dir, tmp_path):
    """SIGTERM: the requests in flight are answered, new ones refused, and every stub ends
    without a crash (Triton's stub segfaulted freeing the encoder's metric families in its own
    teardown, server#8662: the encoder frees them in finalize)."""
    server = start_server(demo_dir, tmp_path)
    stubs = stub_processes(server.status()["server_pid"])
    assert "encoder" in stubs.values()
    outcomes = []

    def client():
        c = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            result = c.infer("embed", [text_input(grpcclient, [LONG_TEXT] * 2)], client_timeout=120)
            outcomes.append(result.as_numpy("EMBEDDING"))
        except InferenceServerException as e:
            outcomes.append(e)

    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    wait_until(  # all three are past the tokenizer: queued or running in the encoder
        lambda: server.metric("nv_inference_request_success", model="tokenizer") >= 3,
        "three requests in the encoder",
    )
    os.killpg(server.proc.pid, signal.SIGTERM)
    log = tmp_path / "server.log"  # Triton says when it stops taking new requests
    wait_until(lambda: "Waiting for in-flight requests" in log.read_text(), "the drain to begin")
    with pytest.raises(InferenceServerException):  # no new work once draining
        infer(server, ["too late"], "grpc")
    for t in threads:
        t.join(timeout=120)
    assert server.proc.wait(timeout=60) == 0
    assert len(outcomes) == 3
    for out in outcomes:
        assert isinstance(out, np.ndarray) and out.shape == (2, 1024), out
    server.stop()
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in stubs), "stubs' exits")
    crashes = kernel_segfaults(stubs)
    if crashes is None:
        pytest.skip("drained; the kernel log is unreadable here, so the stubs' ends are unchecked")
    assert not crashes, crashes


def test_sigterm_lets_the_gateway_finish_its_requests_before_triton_drains(demo_dir, tmp_path):
    """SIGTERM to the launcher alone (an orchestrator signals PID 1): the gateway stops taking
    requests and finishes those in flight before Triton drains (a draining Triton refuses new
    requests): a body of 2,048 texts whose chunks were still queued, and partly unsent, when
    the signal came is answered whole; then the server drains and the launcher exits 0."""
    port = free_port()
    server = start_server(demo_dir, tmp_path, launcher_args=["--gateway-port", str(port)])
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/health"), "the gateway")
        texts = [f"text number {i}" for i in range(MAX_INPUTS)]  # 8 chunks, 4 sent at a time
        answers = []

        def ask():
            url, body = f"http://127.0.0.1:{port}/v1/embeddings", {"model": "embed", "input": texts}
            answers.append(post_json(url, body, timeout=180)[:2])

        asker = threading.Thread(target=ask)
        with encoder_kept_busy(server, 3.0):
            asker.start()
            queued = "nv_inference_pending_request_count"
            wait_until(lambda: server.metric(queued, model="encoder") >= 1, "chunks queued")
            os.kill(server.proc.pid, signal.SIGTERM)
        asker.join(timeout=180)
        ((status, answer),) = answers
        assert status == 200 and len(answer["data"]) == len(texts), answer
        assert server.proc.wait(timeout=120) == 0
        log = server.log_path.read_text()
        assert log.index("the gateway finishing its requests") < log.index("Waiting for in-flight")
    finally:
        server.stop()


def run_probe(server):
    cmd = [sys.executable, "-m", "qwen_embed_deploy.probe", "--url", server.http_url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_failed_tensor_parallel_group_is_reloaded(demo_dir, tmp_path):
    """tp_size=2 over gloo: a worker killed under the encoder's stub fails the next batch with
    UNAVAILABLE naming the rank, the stub exits instead of failing every later request while
    Triton reports ready, and the watchdog loads it again."""
    repo = render(tmp_path / "repo", {"embed": demo_dir}, {"encoder": {"tp_size": "2"}})
    server = start_server(demo_dir, tmp_path, model_repository=repo, exit_timeout_s=1)
    try:
        assert infer(server, ["before"], "grpc")[0].shape == (1, 1024)
        stubs = stub_processes(server.status()["server_pid"])
        (stub,) = [pid for pid, model in stubs.items() if model == "encoder"]
        children = Path(f"/proc/{stub}/task/{stub}/children").read_text().split()
        workers = [int(c) for c in children if "qwen_embed.worker" in cmdline(int(c))]
        assert len(workers) == 1, children
        os.kill(workers[0], signal.SIGKILL)
        with pytest.raises(InferenceServerException) as e:
            infer(server, ["during"], "grpc")
        assert "TP rank 1 exited with code -9" in e.value.message(), e.value.message()
        wait_until(lambda: server.status()["reloads"], "the watchdog's reload", timeout=120)
        assert [model for model, _ in server.status()["reloads"]] == ["encoder"]
        assert infer(server, ["after"], "grpc")[0].shape == (1, 1024)
    finally:
        server.stop()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
