"""What a server costs before it embeds anything: seconds until ready and the resident memory
of each of its processes.

    python bench_startup.py [--rounds 3]

The checked-in repository on the demo models, through the launcher (TritonServer, as `make
serve` runs it without the gateway), started `--rounds` times one after another: seconds from
the launch until Triton reports ready, then, after one request, the resident memory (VmRSS)
of the launcher, tritonserver and each model's Python stubs (per instance). Medians over the
rounds. Before them one start without the checkpoint files' kept hashes (file-hashes.json
removed: a first start, which reads every file of both checkpoints for their fingerprints):
its seconds until ready apart. Results: perf/results/startup.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from harness import RESULTS, markdown_table, new_record, status_mib, write_report

from qwen_embed_deploy.launcher import proc_stat, stub_processes
from qwen_embed_deploy.serving.config import KNOWN_HASHES
from qwen_embed_deploy.triton import TritonServer


def one_start(log_dir: Path) -> dict:
    server = TritonServer(log_path=log_dir / "server.log")
    started = time.perf_counter()
    with server:  # started on entering
        ready_s = time.perf_counter() - started
        server.embed_http(["a first text", "and a second one"])
        server_pid = server.status()["server_pid"]
        stubs: dict[str, list[float]] = {}
        for pid, model in stub_processes(server_pid).items():
            stubs.setdefault(model, []).append(status_mib("VmRSS", pid))
        return {
            "ready_s": ready_s,
            "launcher_mb": status_mib("VmRSS", int(proc_stat(server_pid)[1])),  # its parent
            "tritonserver_mb": status_mib("VmRSS", server_pid),
            "stubs_mb": stubs,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "startup"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        KNOWN_HASHES.path.unlink(missing_ok=True)
        first = one_start(Path(tmp))
        runs = [one_start(Path(tmp)) for _ in range(args.rounds)]
    for run in [first, *runs]:
        print(run, flush=True)
    models = sorted({m for run in runs for m in run["stubs_mb"]})
    rows = [
        ["seconds until ready", "", f"{statistics.median(r['ready_s'] for r in runs):.1f}"],
        ["the first start: seconds until ready", "", f"{first['ready_s']:.1f}"],
        ["launcher", 1, f"{statistics.median(r['launcher_mb'] for r in runs):.0f} MB"],
        ["tritonserver", 1, f"{statistics.median(r['tritonserver_mb'] for r in runs):.0f} MB"],
    ]
    for model in models:
        per_stub = [mb for r in runs for mb in r["stubs_mb"].get(model, [])]
        count = len(runs[-1]["stubs_mb"].get(model, []))
        rows.append([f"`{model}` stub", count, f"{statistics.median(per_stub):.0f} MB each"])
    table = markdown_table(["process", "instances", f"median of {args.rounds} starts"], rows)
    notes = ["the checked-in repository on the demo models; resident memory after one request"]
    record = new_record(first=first, rounds=runs)
    write_report(args.out, record, "Server start-up", notes, table)


if __name__ == "__main__":
    main()
