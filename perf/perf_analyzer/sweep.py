"""perf_analyzer sweeps against a real tritonserver on the demo model; CSVs and a summary.

    perf/perf_analyzer/install.sh                        # once: perf_analyzer 2.51 + libraries
    .venv/bin/python perf/perf_analyzer/sweep.py         # the whole plan (slow on 2 CPU cores)
    .venv/bin/python perf/perf_analyzer/sweep.py --quick # the ratio pair and a short sweep
    .venv/bin/python perf/perf_analyzer/sweep.py --resume        # only levels without a CSV
    .venv/bin/python perf/perf_analyzer/sweep.py --summary-only  # rebuild summary.md

Plan: `embed` at 1, 8 and 32 texts per request and `encoder` (packed token ids, what the
tokenizer model produces) at 8, each at concurrency 1..64, gRPC; then `embed` with 1 text per
request in request-rate mode. perf_analyzer 2.51 fixes the texts per request with `-b` (the
batch dimension of TEXT [n, 1]); it fills a request from n consecutive entries of the input
file, so requests still differ. Every level is a separate perf_analyzer run on an idle server
(pending requests drained), measured over 3 count windows of at least max(4, concurrency)
requests; the stability test is effectively off (-s 100000, i.e. windows may differ 1000x)
because it rarely passes on a shared 2-core CPU (at concurrency 1 a window with one 1024-token
text is 50x slower than one of short texts), and 2.51 writes no result at all for an
unstable level. Each level's CSV and its metadata (command, load average, wall time) go to
perf/results/perf_analyzer/; the summary is rebuilt from all of them, so --resume can finish
an interrupted sweep.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # make_inputs.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/harness.py, workload.py
from harness import RESULTS, new_record, stamp, write_report  # noqa: E402
from make_inputs import DEFAULT_OUT as INPUTS  # noqa: E402
from make_inputs import write_inputs  # noqa: E402

from qwen_embed_deploy.serving.config import DEMO_MODEL_DIR, REPO  # noqa: E402
from qwen_embed_deploy.triton import TritonServer  # noqa: E402

PERF_ANALYZER = REPO / ".cache" / "perf_analyzer" / "perf_analyzer"
OUT = RESULTS / "perf_analyzer"
CONCURRENCY = [1, 2, 4, 8, 16, 32, 64]
RATIO_LEVEL = 32  # the target: 1-text requests at c=32 >= 0.85x tokens/s of 32-text requests
TARGET = 0.85


def plan(quick: bool, rates: list[float]) -> list[dict]:
    """Levels in priority order: the ratio pair first, so a cut-short run still answers it."""
    levels = [("embed", 1, RATIO_LEVEL), ("embed", 32, RATIO_LEVEL)]
    rate_runs = [{"model": "embed", "texts": 1, "rate": r} for r in rates]
    if quick:
        levels += [("embed", n, c) for n in (1, 8) for c in (1, 8)]
        levels += [("encoder", 8, c) for c in (1, 8)]
    else:
        levels += [("embed", 1, c) for c in CONCURRENCY]
        # Interleaved, so a sweep cut short still compares the ensemble with the encoder alone.
        levels += [(model, 8, c) for c in CONCURRENCY for model in ("embed", "encoder")]
        levels += [("embed", 32, c) for c in CONCURRENCY]  # the slowest: 3 x c x 32 texts each
    seen, runs = set(), []
    for model, n, c in levels:
        if (model, n, c) not in seen:
            seen.add((model, n, c))
            runs.append({"model": model, "texts": n, "concurrency": c})
    # Request-rate levels are cheap: after the 1-text sweep, before the batched ones.
    cut = 1 + max(i for i, r in enumerate(runs) if r["model"] == "embed" and r["texts"] == 1)
    return runs[:cut] + rate_runs + runs[cut:]


def run_name(run: dict) -> str:
    load = f"c{run['concurrency']}" if "concurrency" in run else f"rate{run['rate']:g}"
    return f"{run['model']}_n{run['texts']}_{load}"


def metric_sum(server: TritonServer, name: str) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    return sum(float(x) for x in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)", text, re.M))


def busy(server: TritonServer) -> float:
    """Requests queued anywhere, and inside an encoder's execute (no longer queued)."""
    return metric_sum(server, "nv_inference_pending_request_count") + metric_sum(
        server, "qwen_embed_executing_requests"
    )


def wait_idle(server: TritonServer, timeout: float = 900) -> None:
    # Requests left by one level, queued or running, would slow the next one down.
    deadline = time.monotonic() + timeout
    while busy(server) and time.monotonic() < deadline:
        time.sleep(1)


def embedded(server: TritonServer) -> tuple[float, float]:
    return (
        metric_sum(server, "qwen_embed_texts_total"),
        metric_sum(server, "qwen_embed_tokens_total"),
    )


def warm_up(server: TritonServer) -> None:
    # The first forward pays one-off costs (allocations, thread pools): keep them out of level 1.
    server.embed_http(["warm up", "the server " * 200], timeout=300)


def perf_analyzer_command(run: dict, url: str, csv_path: Path, min_requests: int) -> list[str]:
    load = run.get("concurrency") or 1
    cmd = [
        str(PERF_ANALYZER),
        "-m",
        run["model"],
        "-i",
        "grpc",
        "-u",
        url,
        # -b is the batch dimension: TEXT [n, 1], each of the n rows from its own input entry.
        "-b",
        str(run["texts"]),
        "--input-data",
        str(INPUTS / f"{run['model']}.json"),
        "--measurement-mode",
        "count_windows",
        "--measurement-request-count",
        str(max(min_requests, load)),
        "-s",
        "100000",
        "-r",
        "3",
        "-f",
        str(csv_path),
        "--verbose-csv",
    ]
    if "concurrency" in run:
        # An explicit end gives one synchronous thread per concurrent request.
        return cmd + ["--concurrency-range", f"{load}:{load}:1"]
    return cmd + [
        "--request-rate-range",
        f"{run['rate']:g}:{run['rate']:g}:1",
        "--request-distribution",
        "poisson",
        "--max-threads",
        "16",
    ]


def run_level(server: TritonServer, run: dict, out: Path, min_requests: int) -> dict:
    name = run_name(run)
    wait_idle(server)
    texts_before, tokens_before = embedded(server)
    cmd = perf_analyzer_command(run, server.grpc_url, out / f"{name}.csv", min_requests)
    load_before = os.getloadavg()
    started = time.perf_counter()
    csv_path = out / f"{name}.csv"
    csv_path.unlink(missing_ok=True)
    with tempfile.TemporaryFile("w+") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, text=True)
        # After writing the CSV, 2.51 still waits for every request in flight: at 32 x 32
        # texts that is one more multi-minute execute. The result is in; stop waiting.
        while proc.poll() is None:
            if csv_path.exists():
                time.sleep(3)
                proc.terminate()
            time.sleep(1)
        log_file.seek(0)
        # 2.51 prints a "Checking tensor" line per input entry: keep only the rest.
        log = "\n".join(
            x for x in log_file.read().splitlines() if not x.startswith("Checking tensor")
        )
    (out / f"{name}.log").write_text(log + "\n")
    # perf_analyzer walks the input file from its start, so a short level sends a subset of
    # the texts: count the tokens the encoder embedded for this level (drained to the end).
    wait_idle(server)
    texts_after, tokens_after = embedded(server)
    sent = texts_after - texts_before
    meta = {
        **run,
        "name": name,
        "returncode": proc.returncode,
        "command": " ".join(["perf_analyzer", *cmd[1:]]).replace(str(REPO) + "/", ""),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "wall_s": time.perf_counter() - started,
        "date": stamp(),
        "tokens_per_text": (tokens_after - tokens_before) / sent if sent else None,
    }
    (out / f"{name}.json").write_text(json.dumps(meta, indent=2))
    return meta


def read_level(out: Path, meta: dict, file_mean_tokens: float) -> dict | None:
    path = out / f"{meta['name']}.csv"
    if not path.exists():
        return None
    with path.open() as f:
        row = next(csv.DictReader(f), None)
    if row is None:
        return None
    texts_per_s = float(row["Inferences/Second"])  # perf_analyzer counts -b rows as inferences
    mean_tokens = meta.get("tokens_per_text") or file_mean_tokens
    return {
        **meta,
        "infer_per_s": texts_per_s,
        "requests_per_s": texts_per_s / meta["texts"],
        "texts_per_s": texts_per_s,
        "tokens_per_s": texts_per_s * mean_tokens,
        "mean_tokens": mean_tokens,
        "p50_ms": float(row["p50 latency"]) / 1000,
        "p99_ms": float(row["p99 latency"]) / 1000,
    }


def summarize(out: Path, lengths: dict, note: str) -> dict:
    rows, failed = [], []
    for path in sorted(out.glob("*_n*_*.json")):
        meta = json.loads(path.read_text())
        row = read_level(out, meta, lengths["mean_tokens"])
        (rows if row else failed).append(row or meta)
    key = {(r["model"], r["texts"], r.get("concurrency")): r for r in rows}
    one, many = key.get(("embed", 1, RATIO_LEVEL)), key.get(("embed", 32, RATIO_LEVEL))
    ratio = one["tokens_per_s"] / many["tokens_per_s"] if one and many else None
    summary = new_record(
        loadavg_at_summary=os.getloadavg(),
        note=note,
        input_lengths=lengths,
        ratio_1_vs_32_at_c32=ratio,
        target=TARGET,
        levels=rows,
        failed=failed,
    )
    notes, table = markdown(summary)
    write_report(out / "summary", summary, TITLE, notes, table)
    return summary


TITLE = "perf_analyzer 2.51 against the demo model (gRPC)"


def markdown(s: dict) -> tuple[list[str], list[str]]:
    """The notes and the tables of a sweep's summary."""
    ln = s["input_lengths"]
    pct = ", ".join(f"{k} {v:.0f}" for k, v in ln["percentiles"].items())
    ratio = s["ratio_1_vs_32_at_c32"]
    verdict = (
        "not measured"
        if ratio is None
        else (
            f"**{ratio:.2f}x** ({'meets' if ratio >= s['target'] else 'misses'} the target "
            f">= {s['target']})"
        )
    )
    notes = [
        f"load average (1/5/15 min) when summarised: "
        f"{', '.join(f'{x:.2f}' for x in s['loadavg_at_summary'])}; per level below",
        s["note"] or None,
        f"input data (seed {ln['seed']}, {ln['texts']} texts, {ln['mix']}, one token per "
        f"word): tokens per text incl. <|endoftext|>: mean {ln['mean_tokens']:.1f}, "
        f"min {ln['min_tokens']}, {pct}, max {ln['max_tokens']}; "
        f"{100 * ln['share_over_256_tokens']:.0f}% over 256 tokens",
        "texts/s = perf_analyzer's infer/sec (it counts each of the `-b` rows); tokens/s = "
        "texts/s x tokens/text, the mean over the texts the encoder embedded during that level "
        "(server metrics; perf_analyzer walks the input file from its start, so short levels "
        "send a subset), else the input file's mean",
        f"target: 1-text requests at concurrency {RATIO_LEVEL} >= {s['target']}x the tokens/s "
        f"of 32-text requests at concurrency {RATIO_LEVEL}: {verdict}",
    ]
    lines = [
        "| model | texts/request | load | requests/s | texts/s | tokens/text | tokens/s | p50 ms "
        "| p99 ms | load avg (1 min) before | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    order = sorted(
        s["levels"],
        key=lambda r: (r["model"], r["texts"], "rate" in r, r.get("concurrency") or r.get("rate")),
    )
    for r in order:
        load = f"c={r['concurrency']}" if "concurrency" in r else f"{r['rate']:g} req/s"
        lines.append(
            f"| {r['model']} | {r['texts']} | {load} | {r['requests_per_s']:.2f} "
            f"| {r['texts_per_s']:.2f} | {r['mean_tokens']:.0f} "
            f"| {r['tokens_per_s']:.0f} | {r['p50_ms']:.0f} "
            f"| {r['p99_ms']:.0f} | {r['loadavg_before'][0]:.2f} "
            f"| {r['wall_s']:.0f} |"
        )
    if s["failed"]:
        lines += [
            "",
            "No result (see the .log beside each): "
            + ", ".join(f"{m['name']} (rc {m['returncode']})" for m in s["failed"]),
        ]
    lines += [
        "",
        "Commands (one per level, the server on free ports; `perf_analyzer` is "
        "`.cache/perf_analyzer/perf_analyzer`):",
        "",
        "```",
    ]
    lines += [r["command"] for r in order] + ["```"]
    return [n for n in notes if n], lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="ratio pair + concurrency 1 and 8 only")
    p.add_argument("--resume", action="store_true", help="skip levels that already have a CSV")
    p.add_argument("--summary-only", action="store_true")
    p.add_argument(
        "--rates",
        type=float,
        nargs="*",
        default=[0.5, 1, 2],
        help="request-rate mode levels (requests/s of 1 text)",
    )
    p.add_argument("--min-requests", type=int, default=4, help="requests per count window")
    p.add_argument("--texts", type=int, default=1024, help="distinct texts in the input data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path, default=DEMO_MODEL_DIR)
    p.add_argument("--note", default="", help="a line for the summary, e.g. what else ran")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    lengths = write_inputs(args.texts, args.seed, INPUTS, args.model_dir)
    if not args.summary_only:
        if not PERF_ANALYZER.exists():
            sys.exit("perf_analyzer missing: run perf/perf_analyzer/install.sh first")
        runs = plan(args.quick, args.rates)
        if args.resume:
            runs = [r for r in runs if not (args.out / f"{run_name(r)}.csv").exists()]
        # Stop the server on Ctrl-C or kill even when started in the background (where
        # SIGINT is ignored) or by make: the context manager then shuts tritonserver down.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))
        env = {"QWEN_EMBED_MODEL_DIR": str(args.model_dir.resolve())}
        log_path = PERF_ANALYZER.parent / "tritonserver.log"
        with TritonServer(env=env, log_path=log_path) as server:
            warm_up(server)
            for run in runs:
                meta = run_level(server, run, args.out, args.min_requests)
                print(
                    f"{meta['name']}: rc {meta['returncode']}, {meta['wall_s']:.0f} s", flush=True
                )
                summarize(args.out, lengths, args.note)  # after each level: partial is kept
    summarize(args.out, lengths, args.note)
    print((args.out / "summary.md").read_text())


if __name__ == "__main__":
    main()
