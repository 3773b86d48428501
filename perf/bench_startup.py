"""What a server costs before it embeds anything: seconds until ready and the memory of each
of its processes.

    python bench_startup.py [--rounds 3] [--encoder-settings quantization=int8]

The checked-in repository on the demo models, through the launcher (TritonServer, as `make
serve` runs it without the gateway), started `--rounds` times one after another: seconds from
the launch until Triton reports ready, then, after one request, the resident memory (VmRSS)
of the launcher, tritonserver and each model's Python stubs (per instance) and its peak so far
(VmHWM: the load's, which a memory limit must allow). Medians over the rounds. Before them one
start without the checkpoint files' kept hashes (file-hashes.json removed: a first start,
which reads every file of both checkpoints for their fingerprints): its seconds until ready
apart. `--encoder-settings` (`key=value,...`, as QWEN_EMBED_ENCODER_SETTINGS) for both
encoders. Results: perf/results/startup.{md,json}.
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


def memory(pid: int) -> list[float]:
    return [status_mib("VmRSS", pid), status_mib("VmHWM", pid)]


def one_start(log_dir: Path, env: dict[str, str]) -> dict:
    server = TritonServer(log_path=log_dir / "server.log", env=env)
    started = time.perf_counter()
    with server:  # started on entering
        ready_s = time.perf_counter() - started
        server.embed_http(["a first text", "and a second one"])
        server_pid = server.status()["server_pid"]
        stubs: dict[str, list[list[float]]] = {}
        for pid, model in stub_processes(server_pid).items():
            stubs.setdefault(model, []).append(memory(pid))
        return {  # [resident, peak] MiB
            "ready_s": ready_s,
            "launcher_mb": memory(int(proc_stat(server_pid)[1])),  # its parent
            "tritonserver_mb": memory(server_pid),
            "stubs_mb": stubs,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--encoder-settings", default="", help="key=value,... for both encoders")
    p.add_argument("--out", default=str(RESULTS / "startup"))
    args = p.parse_args()
    env = {"QWEN_EMBED_ENCODER_SETTINGS": args.encoder_settings} if args.encoder_settings else {}
    with tempfile.TemporaryDirectory() as tmp:
        KNOWN_HASHES.path.unlink(missing_ok=True)
        first = one_start(Path(tmp), env)
        runs = [one_start(Path(tmp), env) for _ in range(args.rounds)]
    for run in [first, *runs]:
        print(run, flush=True)

    def mb(values: list[list[float]], each: str = "") -> list[str]:
        return [f"{statistics.median(v[i] for v in values):.0f} MB{each}" for i in (0, 1)]

    models = sorted({m for run in runs for m in run["stubs_mb"]})
    seconds = statistics.median(r["ready_s"] for r in runs)
    rows = [
        ["seconds until ready", "", f"{seconds:.1f}", ""],
        ["the first start: seconds until ready", "", f"{first['ready_s']:.1f}", ""],
        ["launcher", 1, *mb([r["launcher_mb"] for r in runs])],
        ["tritonserver", 1, *mb([r["tritonserver_mb"] for r in runs])],
    ]
    for model in models:
        per_stub = [m for r in runs for m in r["stubs_mb"].get(model, [])]
        count = len(runs[-1]["stubs_mb"].get(model, []))
        rows.append([f"`{model}` stub", count, *mb(per_stub, " each")])
    header = ["process", "instances", f"median of {args.rounds} starts", "peak (VmHWM), median"]
    table = markdown_table(header, rows)
    notes = [
        "the checked-in repository on the demo models; resident memory after one request, and "
        "each process's peak resident memory (VmHWM) by then",
        f"encoder settings: {args.encoder_settings or 'the defaults'}",
    ]
    record = new_record(first=first, rounds=runs, encoder_settings=args.encoder_settings)
    write_report(args.out, record, "Server start-up", notes, table)


if __name__ == "__main__":
    main()
