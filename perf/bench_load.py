"""A server under mixed or uneven load: interactive queries beside bulk work (priority levels, a
Batch API batch), a neighbour taking a core, two servers of unequal speed behind the client's
adaptive split, and clients that give up under overload.

    python bench_load.py priority [--seconds 60] [--before REV]
    python bench_load.py batch [--seconds 60] [--texts-in-flight 16,256]
    python bench_load.py neighbour [--seconds 30] [--dtype auto]
    python bench_load.py impatient [--seconds 30] [--clients 48] [--timeout 5]
    python bench_load.py adaptive_split [--texts 96] [--slow-layers 12]

Each subcommand starts its own servers and writes its own report (results/<subcommand>.md and
.json by default); `python bench_load.py SUBCOMMAND --help` says what it measures and how.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import openai
import tritonclient.grpc as grpcclient
from harness import (
    REPO,
    cosine_check,
    drive,
    ensure_model,
    markdown_table,
    new_record,
    run_subcommands,
    start_gateway,
    triton_sender,
    write_report,
)
from tokenizers import Tokenizer

from qwen_embed_client import EmbeddingClient
from qwen_embed_deploy.demo import build_demo_model
from qwen_embed_deploy.placement import read_topology
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.triton import TritonServer

from bench_peers import reference_vectors
from workload import WORDS, make_texts

# ---------------------------------------------------------------- priority

PRIORITY_DOC = """\
1-text queries under a concurrent bulk load: what priority levels do for them, in one run.

    python bench_load.py priority [--seconds 60] [--before REV] [--bulk-clients 2]
                             [--query-clients 4] [--rounds 1]

This checkout is served twice, one server at a time: "bulk at default priority" sends every
request at the default level (interactive), as a server without priority levels would see them;
"bulk at priority 2" sends the bulk requests at priority bulk (2) and the queries at the default.
With --before REV (no default) the server as of git revision REV runs first, every request at
the default: a git worktree of it under .cache/ (its model repository and plugins on
PYTHONPATH; the native kernels copied, used where its sources are the same). The demo model,
dtype auto, the response cache off. Bulk clients send 256-text requests of the perf mix
(perf/workload.py) in a closed loop, query clients 1-text requests of 4-30 words; the latency
of every query is kept, and the bulk texts/s. Results: perf/results/priority.{md,json}.
"""


DEMO = REPO / ".cache" / "demo-model"


LATENCY_HEADER = ["1-text queries", "p50 ms", "p99 ms", "mean ms"]


def latency_cells(r: dict) -> list:
    """The 1-text queries' columns of the priority and batch tables (LATENCY_HEADER)."""
    return [r["queries"], f"{r['p50_ms']:.0f}", f"{r['p99_ms']:.0f}", f"{r['mean_ms']:.0f}"]


def checkout(rev: str) -> Path:
    """A worktree of `rev` whose Python models import its own plugins, with this checkout's
    native kernels and Triton install."""
    tree = REPO / ".cache" / f"before-{rev}"
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=REPO, check=True)
        # The Python stub ignores PYTHONPATH and finds this checkout's plugins through the
        # venv: the old models put their own first.
        plugins = str(tree / "plugins")
        first = f"import sys; sys.path.insert(0, {plugins!r})  # bench_load priority\n"
        for model in (tree / "model_repository").glob("*/1/model.py"):
            if not model.is_symlink():
                model.write_text(first + model.read_text())
    build = REPO / "plugins" / "qwen_embed" / "native" / "_build"
    target = tree / "plugins" / "qwen_embed" / "native" / "_build"
    if build.exists() and not target.exists():
        shutil.copytree(build, target)
    (tree / ".cache").mkdir(exist_ok=True)
    if not (tree / ".cache" / "triton").exists():
        (tree / ".cache" / "triton").symlink_to(REPO / ".cache" / "triton")
    return tree


def text_input(texts: list[str]):
    arr = np.array([[t.encode()] for t in texts], dtype=object)
    inp = grpcclient.InferInput("TEXT", list(arr.shape), "BYTES")
    inp.set_data_from_numpy(arr)
    return inp


def priority_load(
    server: TritonServer, seconds: float, bulk_clients: int, query_clients: int, bulk_priority
):
    bulk_texts = make_texts(4096, seed=3)
    rng = np.random.default_rng(5)
    queries = [" ".join(rng.choice(WORDS, size=int(k))) for k in rng.integers(4, 31, 4096)]
    stop = threading.Event()
    latencies: list[float] = []
    bulk_done = [0]

    def bulk(k: int) -> None:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        i = k * 256
        while not stop.is_set():
            batch = [bulk_texts[(i + j) % len(bulk_texts)] for j in range(256)]
            client.infer("embed", [text_input(batch)], priority=bulk_priority, client_timeout=900)
            bulk_done[0] += 256
            i += 256 * bulk_clients

    def query(k: int) -> None:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        i = k
        while not stop.is_set():
            start = time.perf_counter()
            client.infer("embed", [text_input([queries[i % len(queries)]])], client_timeout=900)
            latencies.append(time.perf_counter() - start)
            i += query_clients

    threads = [threading.Thread(target=bulk, args=(k,)) for k in range(bulk_clients)]
    threads += [threading.Thread(target=query, args=(k,)) for k in range(query_clients)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    ms = np.array(latencies) * 1e3
    return {
        "queries": len(ms),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
        "bulk_texts_per_s": bulk_done[0] / seconds,
    }


def priority_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--before", help="also serve this git revision (every request at the default)")
    p.add_argument("--bulk-clients", type=int, default=2)
    p.add_argument("--query-clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)


def priority(args: argparse.Namespace) -> None:
    env = {"QWEN_EMBED_MODEL_DIR": str(DEMO)}
    here = dict(model_repository=REPO / "model_repository", env=env)
    variants = {
        "bulk at default priority": dict(here, priority=0),
        "bulk at priority 2": dict(here, priority=2),
    }
    if args.before:
        tree = checkout(args.before)
        before = dict(
            model_repository=tree / "model_repository",
            env={**env, "PYTHONPATH": os.pathsep.join([str(tree / "plugins")])},
            priority=0,
        )
        variants = {f"revision {args.before}": before, **variants}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, v in variants.items():
            launcher = ["--no-rerank"]
            with TritonServer(v["model_repository"], env=v["env"], launcher_args=launcher) as s:
                client = grpcclient.InferenceServerClient(s.grpc_url)
                for _ in range(3):  # warm-up
                    client.infer("embed", [text_input(["warm up"] * 8)])
                outcome = priority_load(
                    s, args.seconds, args.bulk_clients, args.query_clients, v["priority"]
                )
            print(name, outcome, flush=True)
            results[name].append(outcome)
    record = new_record(
        before=args.before,
        seconds=args.seconds,
        bulk_clients=args.bulk_clients,
        query_clients=args.query_clients,
        rounds=args.rounds,
        results=results,
    )
    rows = [
        [name, *latency_cells(r), f"{r['bulk_texts_per_s']:.1f}"]
        for name, runs in results.items()
        for r in runs
    ]
    table = markdown_table(["server", *LATENCY_HEADER, "bulk texts/s"], rows)
    notes = [
        "this checkout with bulk requests at the default priority (interactive, as without "
        "priority levels) and at priority 2 (bulk); each request answered when its own texts "
        "are done"
        + (f"; revision {args.before} with every request at the default" if args.before else ""),
        f"{args.bulk_clients} bulk clients x 256 texts, {args.query_clients} query clients x 1 "
        f"text, {args.seconds:.0f} s per server, demo model, dtype auto",
    ]
    write_report(args.out, record, "1-text queries under a bulk load", notes, table)


# ---------------------------------------------------------------- batch

BATCH_DOC = """\
1-text queries through the gateway while an OpenAI Batch API batch runs, against no batch
running, in one run.

    python bench_load.py batch [--seconds 60] [--query-clients 2] [--lines 4000]
                          [--texts-per-line 16] [--texts-in-flight 16,256]

One server (this checkout through the launcher, the demo model, dtype auto) and a gateway in
front of it, started once per value of its --batch-texts-in-flight (the Batch API's state in a
temporary directory). Query clients send 1-text `/v1/embeddings` requests of 4-30 words in a
closed loop, first with nothing else running, then while a batch of `--lines` lines of
`--texts-per-line` texts of the perf mix (perf/workload.py) runs at the bulk priority level;
the latency of every query is kept, and the batch's texts/s over the same window. Results:
perf/results/batch.{md,json}.
"""


def queries_for(api: openai.OpenAI, seconds: float, clients: int) -> list[float]:
    rng = np.random.default_rng(5)
    queries = [" ".join(rng.choice(WORDS, size=int(k))) for k in rng.integers(4, 31, 4096)]
    stop, latencies = threading.Event(), []

    def query(k: int) -> None:
        i = k
        while not stop.is_set():
            start = time.perf_counter()
            api.embeddings.create(model="embed", input=queries[i % len(queries)])
            latencies.append(time.perf_counter() - start)
            i += clients

    threads = [threading.Thread(target=query, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return latencies


def summary(latencies: list[float]) -> dict:
    ms = np.array(latencies) * 1e3
    return {
        "queries": len(ms),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
    }


def submit(api: openai.OpenAI, lines: int, per_line: int) -> str:
    texts = make_texts(lines * per_line, seed=3)
    body = "".join(
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "embed", "input": texts[i * per_line : (i + 1) * per_line]},
            }
        )
        + "\n"
        for i in range(lines)
    )
    source = api.files.create(file=("bench.jsonl", io.BytesIO(body.encode())), purpose="batch")
    batch = api.batches.create(
        input_file_id=source.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    return batch.id


class Gateway:
    """A gateway process in front of `server` with its own Batch API state."""

    def __init__(self, server: TritonServer, texts_in_flight: int, state: str):
        self.process, port = start_gateway(
            server.grpc_url,
            *("--rerank-model-name", "", "--batch-dir", state),
            *("--batch-texts-in-flight", str(texts_in_flight)),
        )
        self.api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def during_batch(api: openai.OpenAI, args) -> dict:
    """Query latency while a batch runs, and the batch's texts/s over the same window."""
    batch_id = submit(api, args.lines, args.texts_per_line)
    while api.batches.retrieve(batch_id).request_counts.completed == 0:
        time.sleep(0.2)
    start_count = api.batches.retrieve(batch_id).request_counts.completed
    start = time.monotonic()
    result = summary(queries_for(api, args.seconds, args.query_clients))
    done = api.batches.retrieve(batch_id)
    lines = done.request_counts.completed - start_count
    result["batch_texts_per_s"] = lines * args.texts_per_line / (time.monotonic() - start)
    result["batch_still_running"] = done.status == "in_progress"
    api.batches.cancel(batch_id)
    return result


def batch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--query-clients", type=int, default=2)
    p.add_argument("--lines", type=int, default=4000)
    p.add_argument("--texts-per-line", type=int, default=16)
    p.add_argument(
        "--texts-in-flight",
        default="16,256",
        help="the gateway's --batch-texts-in-flight values to compare, comma separated",
    )


def batch(args: argparse.Namespace) -> None:
    results = {}
    env = {"QWEN_EMBED_MODEL_DIR": str(DEMO)}
    with TritonServer(REPO / "model_repository", env=env, launcher_args=["--no-rerank"]) as s:
        for n in [int(x) for x in args.texts_in_flight.split(",")]:
            with tempfile.TemporaryDirectory() as state:
                gateway = Gateway(s, n, state)
                try:
                    if not results:  # the baseline, once
                        for _ in range(3):  # warm-up
                            gateway.api.embeddings.create(model="embed", input=["warm up"] * 8)
                        alone = summary(queries_for(gateway.api, args.seconds, args.query_clients))
                        results["no batch"] = alone
                        print("no batch", alone, flush=True)
                    name = f"a batch running, {n} texts in flight"
                    results[name] = during_batch(gateway.api, args)
                    print(name, results[name], flush=True)
                finally:
                    gateway.stop()
    record = new_record(
        seconds=args.seconds,
        query_clients=args.query_clients,
        lines=args.lines,
        texts_per_line=args.texts_per_line,
        results=results,
    )
    rows = [
        [
            name,
            *latency_cells(r),
            f"{r['batch_texts_per_s']:.1f}" if "batch_texts_per_s" in r else "",
        ]
        for name, r in results.items()
    ]
    table = markdown_table(["gateway", *LATENCY_HEADER, "batch texts/s"], rows)
    notes = [
        f"{args.query_clients} query clients x 1 text through /v1/embeddings, {args.seconds:.0f}"
        " s with no batch, then the same while a Batch API batch runs at the bulk priority level, "
        "once per value of the gateway's --batch-texts-in-flight",
        f"the batch: {args.lines} lines x {args.texts_per_line} texts of the perf mix, cancelled "
        "after each window; demo model, dtype auto",
    ]
    write_report(args.out, record, "1-text queries while a batch runs", notes, table)


# ---------------------------------------------------------------- impatient

IMPATIENT_DOC = """\
Clients that give up under overload: what dropping the requests nobody waits for any more does
for the clients still waiting, in one run.

    python bench_load.py impatient [--seconds 30] [--clients 48] [--timeout 5] [--rounds 2]

One server (this checkout through the launcher, the demo model, dtype auto) and a gateway in
front of it. `--clients` closed-loop clients of the `openai` SDK (its default 2 retries) send
`/v1/embeddings` requests of 8 texts of the perf mix (perf/workload.py) with a `--timeout` s
timeout: more work than the server answers in that time. Two ways alternate, `--rounds` times
each for `--seconds`, the server idle before each: the SDK as it is (it sends its read timeout
in x-stainless-read-timeout, which the gateway makes the deadline of its Triton requests: the
encoder's queue drops a request once its client has stopped waiting), and the same clients
with that header left out (a client that gives up closes its connection, which cancels what
the gateway has not sent yet; what waits in the encoder's queue is computed all the same). Per
way: requests answered per second and their latency, requests the SDK gave up on (after its
retries), texts the encoder computed per second and the share of them a client received.
Results: perf/results/impatient.{md,json}.
"""

TEXTS_PER_REQUEST = 8


def impatient_window(api, server, texts, args, announce: bool) -> dict:
    """One window of the closed-loop clients; `announce`: the SDK's timeout header sent."""
    headers = {} if announce else {"x-stainless-read-timeout": openai.Omit()}
    stop, answered, gave_up = threading.Event(), [], []

    def client(k: int) -> None:
        i = k
        while not stop.is_set():
            start = (i * TEXTS_PER_REQUEST) % (len(texts) - TEXTS_PER_REQUEST)
            began = time.perf_counter()
            try:
                api.embeddings.create(
                    model="embed",
                    input=texts[start : start + TEXTS_PER_REQUEST],
                    extra_headers=headers,
                )
                answered.append(time.perf_counter() - began)
            except openai.APIError:  # timed out after the SDK's retries, or a 5xx
                gave_up.append(time.perf_counter() - began)
            i += args.clients

    computed = server.metric("qwen_embed_texts_total")
    threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
    began = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(args.seconds)
    computed = server.metric("qwen_embed_texts_total") - computed
    seconds = time.monotonic() - began
    stop.set()
    for t in threads:
        t.join()
    ms = np.array(answered or [np.nan]) * 1e3
    return {
        "answered_per_s": len(answered) / seconds,
        "gave_up_per_s": len(gave_up) / seconds,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "computed_texts_per_s": computed / seconds,
        "useful_share": len(answered) * TEXTS_PER_REQUEST / max(computed, 1),
    }


def idle(server: TritonServer) -> None:
    """Until the encoder holds no request, executing or queued (the last window's leftovers
    are not the next one's work)."""
    while server.metric("qwen_embed_executing_requests") or server.metric(
        "nv_inference_pending_request_count", model="encoder"
    ):
        time.sleep(0.5)


def impatient_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--timeout", type=float, default=5.0, help="the SDK's timeout, seconds")
    p.add_argument("--rounds", type=int, default=2)


WAYS = {True: "timeout sent (the SDK as it is)", False: "timeout header left out"}


def impatient(args: argparse.Namespace) -> None:
    texts = make_texts(4096, seed=11)
    env = {"QWEN_EMBED_MODEL_DIR": str(DEMO)}
    windows = {way: [] for way in WAYS.values()}
    with TritonServer(REPO / "model_repository", env=env, launcher_args=["--no-rerank"]) as s:
        process, port = start_gateway(s.grpc_url, "--rerank-model-name", "")
        try:
            base_url = f"http://127.0.0.1:{port}/v1"
            api = openai.OpenAI(base_url=base_url, api_key="unused", timeout=args.timeout)
            for _ in range(3):  # warm-up
                api.embeddings.create(model="embed", input=texts[:TEXTS_PER_REQUEST])
            for _ in range(args.rounds):
                for announce, way in WAYS.items():
                    idle(s)
                    windows[way].append(impatient_window(api, s, texts, args, announce))
                    print(way, windows[way][-1], flush=True)
        finally:
            process.kill()  # a graceful stop would wait for the requests nobody waits for
            process.wait(timeout=30)
    results = {
        way: {k: float(np.mean([w[k] for w in ws])) for k in ws[0]} for way, ws in windows.items()
    }
    record = new_record(
        seconds=args.seconds,
        clients=args.clients,
        timeout_s=args.timeout,
        rounds=args.rounds,
        texts_per_request=TEXTS_PER_REQUEST,
        windows=windows,
        results=results,
    )
    rows = [
        [
            way,
            f"{r['answered_per_s']:.2f}",
            f"{r['gave_up_per_s']:.2f}",
            f"{r['p50_ms']:.0f}",
            f"{r['p99_ms']:.0f}",
            f"{r['computed_texts_per_s']:.1f}",
            f"{r['useful_share']:.0%}",
        ]
        for way, r in results.items()
    ]
    header = ["clients' timeout", "answered/s", "gave up/s", "p50 ms", "p99 ms"]
    table = markdown_table([*header, "texts computed/s", "computed texts answered"], rows)
    on, off = (results[way]["answered_per_s"] for way in WAYS.values())
    notes = [
        f"{args.clients} closed-loop `openai` SDK clients (timeout {args.timeout:g} s, 2 "
        f"retries) x {TEXTS_PER_REQUEST} texts of the perf mix through /v1/embeddings; the two "
        f"ways alternate, {args.rounds} windows of {args.seconds:.0f} s each, means shown; "
        "demo model, dtype auto; an answered request's latency includes the SDK's retries",
        f"requests answered, timeout sent / header left out: {on / max(off, 1e-9):.2f}x",
    ]
    write_report(args.out, record, "Clients that give up under overload", notes, table)


# ---------------------------------------------------------------- neighbour

NEIGHBOUR_DOC = """\
Throughput when another process takes one core: does it degrade in proportion or collapse?

    cd perf && ../.venv/bin/python bench_load.py neighbour [--seconds 30] [--dtype auto]

For each encoder layout (one instance with a thread per core, with OpenMP threads spinning or
sleeping at barriers, and one pinned instance per core) a real tritonserver serves the
4-layer bench model; clients send the peer benchmark's mixed texts (8 clients x 8 texts) with
no neighbour, with a busy loop pinned to the last core at normal priority, and with the same
loop at nice 19. Reports tokens/s per case and each loaded case over the quiet one, measured in
the same run. A neighbour taking a whole core out of C leaves (C - 1/2) / C of the machine to a
server sharing that core fairly: 0.75 on two cores is "graceful", 0.5 or less is a collapse.
"""


# The launcher sets GOMP_SPINCOUNT=20000 unless the environment sets a wait policy.
LAYOUTS = {
    "1 instance x all cores, OMP_WAIT_POLICY=ACTIVE": (
        "count: 1, kind: KIND_CPU",
        {"OMP_WAIT_POLICY": "ACTIVE"},
    ),
    "1 instance x all cores, OMP_WAIT_POLICY=PASSIVE": (
        "count: 1, kind: KIND_CPU",
        {"OMP_WAIT_POLICY": "PASSIVE"},
    ),
    "1 instance per core, pinned, PASSIVE": (
        "count: {cores}, kind: KIND_CPU",
        {"OMP_WAIT_POLICY": "PASSIVE"},
    ),
    # The launcher's default: spin ~0.2 ms at a barrier, then sleep.
    "1 instance x all cores, GOMP_SPINCOUNT=20000": ("count: 1, kind: KIND_CPU", {}),
}


LOADS = {"quiet": None, "busy core": 0, "busy core, nice 19": 19}


def busy_core(cpu: int, niceness: int) -> subprocess.Popen:
    """A pure busy loop pinned to one CPU: a fixed, reproducible load."""
    return subprocess.Popen(
        ["taskset", "-c", str(cpu), sys.executable, "-c", "while True: pass"],
        preexec_fn=lambda: os.nice(niceness),
    )


def neighbour_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-model-4l"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--texts", type=int, default=512)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--texts-per-request", type=int, default=8)
    p.add_argument("--layouts", nargs="*", help="names (substrings) of the layouts to run")


def neighbour(args: argparse.Namespace) -> None:
    layouts = {
        name: layout
        for name, layout in LAYOUTS.items()
        if not args.layouts or any(part in name for part in args.layouts)
    }

    model_dir = ensure_model(Path(args.model_dir).resolve(), 4)
    texts = make_texts(args.texts, 0)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = [e.ids for e in tokenizer.encode_batch(texts)]
    counts = np.array([len(i) for i in ids])
    check = cosine_check(reference_vectors(model_dir, ids, f"{args.texts}-0"))
    topology = read_topology()
    cores = sum(len(node) for node in topology)
    busy_cpu = max(c for node in topology for core in node for c in core)
    load = {
        "clients": args.clients,
        "per_request": args.texts_per_request,
        "seconds": args.seconds,
        "passes": 0,
    }
    rows = []
    for layout, (instances, env) in layouts.items():
        with tempfile.TemporaryDirectory() as tmp:
            repo = render(
                tmp,
                {"embed": model_dir},
                {"encoder": {"dtype": args.dtype}},
                encoder_instances=instances.format(cores=cores),
            )
            with TritonServer(repo, env=env, log_path=Path(tmp) / "server.log") as server:
                make = triton_sender(server.grpc_url, texts)
                drive(make, counts, check, **{**load, "clients": 2, "max_requests": 4})
                quiet = None
                for name, niceness in LOADS.items():
                    busy = None if niceness is None else busy_core(busy_cpu, niceness)
                    try:
                        stats = drive(make, counts, check, **load)
                    finally:
                        if busy:
                            busy.kill()
                            busy.wait()
                    quiet = quiet or stats["tokens_per_s"]
                    rows.append(
                        {
                            "layout": layout,
                            "load": name,
                            **stats,
                            "over_quiet": stats["tokens_per_s"] / quiet,
                        }
                    )
                    print(
                        f"{layout} | {name}: {stats['tokens_per_s']:.0f} tok/s "
                        f"({rows[-1]['over_quiet']:.2f}x quiet)",
                        flush=True,
                    )
    record = new_record(dtype=args.dtype, cores=cores, busy_cpu=busy_cpu, rows=rows)
    notes = [
        f"model: {model_dir.name} (4 layers), encoder dtype {args.dtype}; {args.clients} "
        f"clients x {args.texts_per_request} mixed texts, {args.seconds:.0f} s per case",
        f"neighbour: `taskset -c {busy_cpu} python -c 'while True: pass'` at nice 0 or 19",
    ]
    header = ["encoder layout", "neighbour", "tokens/s", "x quiet", "p50 s", "p99 s", "min cosine"]
    table = markdown_table(
        header,
        [
            [
                r["layout"],
                r["load"],
                f"{r['tokens_per_s']:.0f}",
                f"{r['over_quiet']:.2f}",
                f"{r['p50_s']:.1f}",
                f"{r['p99_s']:.1f}",
                f"{r['min_check']:.5f}",
            ]
            for r in rows
        ],
    )
    write_report(args.out, record, "Throughput with a neighbour on one core", notes, table)


# ---------------------------------------------------------------- adaptive_split

ADAPTIVE_SPLIT_DOC = """\
Two servers of unequal speed: the client's adaptive split against an even split, timed.

    python bench_load.py adaptive_split [--texts 96] [--slow-layers 12] [--repeats 3]

Each server is pinned to its own core (two "machines"); the slow one serves a deeper model.
The client measures each server's speed and sizes chunks by it; the even split sends half the
texts to each. Both are timed in the same run, alternately; the test suite only checks what
the scheduler decided (tests/test_client.py), since a loaded machine can flip a timing.
"""


def even_split(fast: str, slow: str, texts: list[str]) -> float:
    half = len(texts) // 2
    with EmbeddingClient(fast) as a, EmbeddingClient(slow) as b:
        threads = [
            threading.Thread(target=a.embed, args=(texts[:half],)),
            threading.Thread(target=b.embed, args=(texts[half:],)),
        ]
        began = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - began


def adaptive_split_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--texts", type=int, default=96)
    p.add_argument("--slow-layers", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)


def adaptive_split(args: argparse.Namespace) -> None:
    texts = [f"document {i} " + "about many things " * 12 for i in range(args.texts)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fast_model = build_demo_model(tmp / "fast-model", layers=3)
        slow_model = build_demo_model(tmp / "slow-model", layers=args.slow_layers, seed=2)
        fast = TritonServer(
            render(tmp / "fast", {"embed": fast_model}), cpus="0", log_path=tmp / "fast.log"
        )
        slow = TritonServer(
            render(tmp / "slow", {"embed": slow_model}), cpus="1", log_path=tmp / "slow.log"
        )
        with (
            fast,
            slow,
            EmbeddingClient([fast.grpc_url, slow.grpc_url], requests_in_flight=2) as client,
        ):
            client.embed(texts[:16])  # learn the speeds
            for _ in range(args.repeats):
                before = {u: s["texts_done"] for u, s in client.stats().items()}
                began = time.monotonic()
                client.embed(texts)
                adaptive = time.monotonic() - began
                split = {u: s["texts_done"] - before[u] for u, s in client.stats().items()}
                even = even_split(fast.grpc_url, slow.grpc_url, texts)
                rows.append(
                    {
                        "adaptive_s": adaptive,
                        "even_s": even,
                        "ratio": even / adaptive,
                        "fast_texts": split[fast.grpc_url],
                        "slow_texts": split[slow.grpc_url],
                    }
                )
                print(rows[-1], flush=True)
    table = [
        "| adaptive s | even split s | even / adaptive | texts to fast | texts to slow |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        table.append(
            f"| {r['adaptive_s']:.1f} | {r['even_s']:.1f} | {r['ratio']:.2f} | "
            f"{r['fast_texts']} | {r['slow_texts']} |"
        )
    note = (
        f"fast server: demo model (3 layers) on core 0; slow: {args.slow_layers} layers on "
        f"core 1; {args.texts} texts per job"
    )
    title = "Adaptive split over two unequal servers vs an even split"
    write_report(args.out, new_record(rows=rows), title, [note], table)


COMMANDS = {
    "priority": (PRIORITY_DOC, priority_arguments, priority),
    "batch": (BATCH_DOC, batch_arguments, batch),
    "neighbour": (NEIGHBOUR_DOC, neighbour_arguments, neighbour),
    "impatient": (IMPATIENT_DOC, impatient_arguments, impatient),
    "adaptive_split": (ADAPTIVE_SPLIT_DOC, adaptive_split_arguments, adaptive_split),
}


def main() -> None:
    run_subcommands(__doc__, COMMANDS)


if __name__ == "__main__":
    main()
