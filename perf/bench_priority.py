"""1-text queries under a concurrent bulk load: what priority levels do for them, in one run.

    python bench_priority.py [--seconds 60] [--before REV] [--bulk-clients 2]
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

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from harness import RESULTS, markdown_table, new_record, write_report

from qwen_embed_deploy.triton import TritonServer

from bench_peers import REPO
from workload import WORDS, make_texts

DEMO = REPO / ".cache" / "demo-model"


def checkout(rev: str) -> Path:
    """A worktree of `rev` whose Python models import its own plugins, with this checkout's
    native kernels and Triton install."""
    tree = REPO / ".cache" / f"before-{rev}"
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=REPO, check=True)
        # The Python stub ignores PYTHONPATH and finds this checkout's plugins through the
        # venv: the old models put their own first.
        first = f"import sys; sys.path.insert(0, {str(tree / 'plugins')!r})  # bench_priority\n"
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


def run(server: TritonServer, seconds: float, bulk_clients: int, query_clients: int, bulk_priority):
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--before", help="also serve this git revision (every request at the default)")
    p.add_argument("--bulk-clients", type=int, default=2)
    p.add_argument("--query-clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS / "priority"))
    args = p.parse_args()
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
                outcome = run(s, args.seconds, args.bulk_clients, args.query_clients, v["priority"])
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
        [
            name,
            r["queries"],
            f"{r['p50_ms']:.0f}",
            f"{r['p99_ms']:.0f}",
            f"{r['mean_ms']:.0f}",
            f"{r['bulk_texts_per_s']:.1f}",
        ]
        for name, runs in results.items()
        for r in runs
    ]
    table = markdown_table(
        ["server", "1-text queries", "p50 ms", "p99 ms", "mean ms", "bulk texts/s"], rows
    )
    notes = [
        "this checkout with bulk requests at the default priority (interactive, as without "
        "priority levels) and at priority 2 (bulk); each request answered when its own texts "
        "are done"
        + (f"; revision {args.before} with every request at the default" if args.before else ""),
        f"{args.bulk_clients} bulk clients x 256 texts, {args.query_clients} query clients x 1 "
        f"text, {args.seconds:.0f} s per server, demo model, dtype auto",
    ]
    write_report(args.out, record, "1-text queries under a bulk load", notes, table)


if __name__ == "__main__":
    main()
