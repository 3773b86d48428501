"""Throughput when another process takes one core: does it degrade in proportion or collapse?

    cd perf && ../.venv/bin/python bench_neighbour.py [--seconds 30] [--dtype auto]

For each encoder layout (one instance with a thread per core, with OpenMP threads spinning or
sleeping at barriers, and one pinned instance per core) a real tritonserver serves the
4-layer bench model; clients send the peer benchmark's mixed texts (8 clients x 8 texts) with
no neighbour, with a busy loop pinned to the last core at normal priority, and with the same
loop at nice 19. Reports tokens/s per case and each loaded case over the quiet one, measured in
the same run. A neighbour taking a whole core out of C leaves (C - 1/2) / C of the machine to a
server sharing that core fairly: 0.75 on two cores is "graceful", 0.5 or less is a collapse.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from harness import (
    RESULTS,
    cosine_check,
    drive,
    markdown_table,
    new_record,
    triton_sender,
    write_report,
)
from tokenizers import Tokenizer

from qwen_embed_deploy.placement import read_topology
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.triton import TritonServer

from bench_peers import REPO, ensure_model, reference_vectors
from workload import make_texts

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


def neighbour(cpu: int, niceness: int) -> subprocess.Popen:
    """A pure busy loop pinned to one CPU: a fixed, reproducible load."""
    return subprocess.Popen(
        ["taskset", "-c", str(cpu), sys.executable, "-c", "while True: pass"],
        preexec_fn=lambda: os.nice(niceness),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-model-4l"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--texts", type=int, default=512)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--texts-per-request", type=int, default=8)
    p.add_argument("--out", default=str(RESULTS / "neighbour"))
    p.add_argument("--layouts", nargs="*", help="names (substrings) of the layouts to run")
    args = p.parse_args()
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
    check = cosine_check(
        reference_vectors(
            model_dir,
            ids,
            REPO / ".cache" / "peers" / f"reference-{model_dir.name}-{args.texts}-0.npy",
        )
    )
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
                    busy = None if niceness is None else neighbour(busy_cpu, niceness)
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


if __name__ == "__main__":
    main()
