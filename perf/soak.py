"""Soak: Locust against a real tritonserver for a long while; zero failures and flat memory.

    python perf/soak.py [--seconds 600] [--users 8] [--warmup-fraction 0.25]

The encoder keeps its peak heap for reuse (qwen_embed.cpu.keep_freed_memory), so its RSS rises
in steps each time a forward is bigger than any before, up to the bound set by the encoder's
max_batch_tokens. One full-budget request first takes it to that bound; what grows after that
is a leak. Then samples the resident memory (RSS) of tritonserver plus its Python stub
processes every few seconds. Freed heap beyond one full forward's worth is handed back
(qwen_embed.cpu.HeapTrimmer), so memory saw-tooths below a bound rather than sitting still;
it counts as flat when the highest RSS of the last part of the run is within --max-growth
(fraction) of the highest in the part between warm-up and it (the two halves of the time
after warm-up): a leak raises the peaks. Exit status 1 on any failed request or on growth;
results in perf/results/soak.md (+ .json).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

from harness import RESULTS, new_record, write_report
from run_locust import run_locust

from qwen_embed.settings import EncoderSettings
from qwen_embed_deploy.serving.config import DEMO_MODEL_DIR
from qwen_embed_deploy.triton import TritonServer

from workload import WORDS

PAGE = os.sysconf("SC_PAGE_SIZE")


def tree_rss_mb(root_pid: int) -> float:
    """RSS of a process and its direct children (tritonserver and its stubs), in MiB."""
    pids = [root_pid]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
        except OSError:  # exited while we looked
            continue
        if int(ppid) == root_pid:
            pids.append(int(entry.name))
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        except OSError:
            continue
    return total / 2**20


def fill_batch_budget(server: TritonServer) -> None:
    """One request whose texts fill one encoder forward: 1024-token texts (1023 one-token words
    plus <|endoftext|>), the longest the Locust mix sends, up to the encoder's token budget.
    Each text starts at a different word: identical texts would share one prefix segment and
    the forward would compute a single text, not the full budget."""
    count = EncoderSettings().max_batch_tokens // 1024
    server.embed_http(
        [" ".join(WORDS[(i + t) % len(WORDS)] for i in range(1023)) for t in range(count)]
    )


def soak(
    seconds: int,
    users: int,
    warmup_fraction: float,
    max_growth: float,
    out: Path,
    texts_per_request: int = 8,
    model_repository: Path | None = None,
) -> dict:
    model_dir = os.environ.get("QWEN_EMBED_MODEL_DIR", str(DEMO_MODEL_DIR))
    out.parent.mkdir(parents=True, exist_ok=True)
    samples: list[tuple[float, float]] = []
    done = threading.Event()
    repo = {"model_repository": model_repository} if model_repository else {}
    with TritonServer(env={"QWEN_EMBED_MODEL_DIR": model_dir}, **repo) as server:
        pid = server.status()["server_pid"]
        loaded = tree_rss_mb(pid)
        fill_batch_budget(server)
        start = time.monotonic()

        def sample():
            while not done.wait(max(1.0, seconds / 120)):
                samples.append((time.monotonic() - start, tree_rss_mb(pid)))

        sampler = threading.Thread(target=sample, daemon=True)
        samples.append((0.0, tree_rss_mb(pid)))
        sampler.start()
        row = run_locust(
            server.grpc_url,
            users,
            seconds,
            out.parent / f"{out.name}-locust",
            ["--texts-per-request", str(texts_per_request)],
        )
        done.set()
        sampler.join()
        samples.append((time.monotonic() - start, tree_rss_mb(pid)))
    warm_end = warmup_fraction * seconds
    split = (warm_end + samples[-1][0]) / 2
    first = max(rss for t, rss in samples if warm_end <= t < split)
    last = max(rss for t, rss in samples if t >= split)
    after_warmup = next(rss for t, rss in samples if t >= warm_end)
    end = samples[-1][1]
    growth = (last - first) / first
    result = new_record(
        model_dir=model_dir,
        seconds=seconds,
        users=users,
        texts_per_request=texts_per_request,
        locust=row,
        rss_mb={
            "loaded": round(loaded, 1),
            "start": round(samples[0][1], 1),
            "after_warmup": round(after_warmup, 1),
            "end": round(end, 1),
            "max": round(max(r for _, r in samples), 1),
            "max_first_half": round(first, 1),
            "max_last_half": round(last, 1),
        },
        growth_after_warmup=round(growth, 4),
        max_growth=max_growth,
        passed=row["failures"] == 0 and row["requests"] > 0 and growth <= max_growth,
        samples=[(round(t, 1), round(r, 1)) for t, r in samples],
    )
    rss = result["rss_mb"]
    notes = [
        f"model: {model_dir}",
        f"load: {users} Locust users, {texts_per_request} mixed texts/request, {seconds} s",
    ]
    lines = [
        f"requests {row['requests']}, failures {row['failures']}, "
        f"{row['tokens_per_s']} tokens/s, p50 {row['p50_ms']:.0f} ms, "
        f"p99 {row['p99_ms']:.0f} ms",
        "",
        f"RSS of tritonserver + stubs (MiB): models loaded {rss['loaded']}, after one "
        f"full-budget forward (the start) {rss['start']}, after warm-up "
        f"({warmup_fraction:.0%} of the time) {rss['after_warmup']}, "
        f"end {rss['end']}, max {rss['max']}; highest after warm-up: "
        f"first half {rss['max_first_half']}, last half {rss['max_last_half']}, "
        f"growth {growth:+.1%} (limit {max_growth:.0%})",
        "",
        f"result: {'PASS' if result['passed'] else 'FAIL'}",
    ]
    write_report(out, result, "Soak", notes, lines)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=int, default=600)
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--warmup-fraction", type=float, default=0.25)
    p.add_argument("--max-growth", type=float, default=0.05)
    p.add_argument("--out", type=Path, default=RESULTS / "soak")
    args = p.parse_args()
    result = soak(args.seconds, args.users, args.warmup_fraction, args.max_growth, args.out)
    print(args.out.with_suffix(".md").read_text())
    raise SystemExit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
