"""Locust headless at several user counts against a real tritonserver; CSV, HTML, a summary
and charts of throughput and p50/p99 latency against users.

    python perf/run_locust.py [--users 1 4 16 32] [--seconds 60] [--host 127.0.0.1:8001]
        [--texts-per-request 8] [--length-mix mixed]

Without --host a tritonserver is started on the demo model (or $QWEN_EMBED_MODEL_DIR) and
stopped after. Results: perf/results/locust/ (per level: u{N}_stats.csv, u{N}.html).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

from harness import RESULTS, markdown_table, new_record, write_report

from qwen_embed_deploy.serving.config import DEMO_MODEL_DIR
from qwen_embed_deploy.triton import TritonServer

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
STOP_TIMEOUT_S = 300  # the encoder's default queue timeout: no request waits longer


def percentile(row: dict, column: str) -> float | None:
    return None if row[column] == "N/A" else float(row[column])  # N/A: no request finished


def run_locust(host: str, users: int, seconds: int, prefix: Path, extra: list[str]) -> dict:
    """One headless Locust run; returns its aggregated row (counts, req/s, p50/p99 ms, tokens/s)."""
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "-H",
        host,
        "-u",
        str(users),
        "-r",
        str(users),
        "-t",
        f"{seconds}s",
        "--only-summary",
        # Let requests in flight at the time limit finish and count: on 2 CPU cores one
        # takes tens of seconds at 16+ users, and Locust would otherwise drop them.
        "--stop-timeout",
        str(STOP_TIMEOUT_S),
        "--csv",
        str(prefix),
        "--html",
        f"{prefix}.html",
        "--loglevel",
        "WARNING",
        *extra,
    ]
    subprocess.run(cmd, check=False, cwd=LOCUSTFILE.parent)  # exit 1 on failures: read the CSV
    with open(f"{prefix}_stats.csv") as f:
        row = next(r for r in csv.DictReader(f) if r["Name"] == "Aggregated")
    rps = float(row["Requests/s"])
    return {
        "users": users,
        "requests": int(row["Request Count"]),
        "failures": int(row["Failure Count"]),
        "requests_per_s": round(rps, 2),
        # response length is the tokens embedded by that request (locustfile.py)
        "tokens_per_s": round(rps * float(row["Average Content Size"]), 1),
        "p50_ms": percentile(row, "50%"),
        "p99_ms": percentile(row, "99%"),
    }


def ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def chart(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    users = [r["users"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(users, [r["tokens_per_s"] for r in rows], marker="o")
    left.set(xlabel="users", ylabel="tokens/s", title="throughput", xscale="log", ylim=(0, None))
    right.plot(users, [r["p50_ms"] for r in rows], marker="o", label="p50")
    right.plot(users, [r["p99_ms"] for r in rows], marker="o", label="p99")
    right.set(xlabel="users", ylabel="ms", title="latency", xscale="log")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--seconds", type=int, default=60)
    p.add_argument("--host", help="a running server's gRPC address; default: start one")
    p.add_argument("--texts-per-request", type=int, default=8)
    p.add_argument("--length-mix", default="mixed")
    p.add_argument("--out", type=Path, default=RESULTS / "locust")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    extra = ["--texts-per-request", str(args.texts_per_request), "--length-mix", args.length_mix]
    model_dir = os.environ.get("QWEN_EMBED_MODEL_DIR", str(DEMO_MODEL_DIR))
    server = None if args.host else TritonServer(env={"QWEN_EMBED_MODEL_DIR": model_dir})
    rows = []
    with server or nullcontext():
        host = args.host or server.grpc_url
        for users in args.users:
            rows.append(run_locust(host, users, args.seconds, args.out / f"u{users}", extra))
            print(json.dumps(rows[-1]), flush=True)
    record = new_record(model_dir=model_dir, load_average=os.getloadavg(), levels=rows)
    title = f"embed, {args.texts_per_request} texts/request ({args.length_mix}), {record['date']}"
    chart(rows, title, args.out / "locust.png")
    notes = [
        f"model: {model_dir}",
        f"load: {args.texts_per_request} texts/request, {args.length_mix} lengths "
        f"(perf/workload.py), {args.seconds} s per level, closed-loop users; requests in "
        f"flight at the time limit finish and count (--stop-timeout {STOP_TIMEOUT_S})",
        f"load average at the end: {record['load_average']}",
    ]
    header = ["users", "requests", "failures", "req/s", "tokens/s", "p50 ms", "p99 ms"]
    table = markdown_table(
        header,
        [
            [
                r["users"],
                r["requests"],
                r["failures"],
                r["requests_per_s"],
                r["tokens_per_s"],
                ms(r["p50_ms"]),
                ms(r["p99_ms"]),
            ]
            for r in rows
        ],
    )
    table += ["", "![throughput and latency against users](locust.png)"]
    write_report(args.out / "summary", record, "Locust: embed over gRPC", notes, table)


if __name__ == "__main__":
    main()
