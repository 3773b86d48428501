"""Long documents: one text of 8K, 16K and 32K tokens through the engine, tokens/s and peak
memory, each length in a fresh process; then the same text with late chunking.

    python bench_long.py [--model-dir .cache/demo-model] [--lengths 8192 16384 32768]
        [--chunk-size 512]

Per length: a process loads the encoder (dtype auto, the default max_batch_tokens of 16,384,
so the longer texts are forwards of their own) and embeds one text of random ids ending with
<|endoftext|>, --reps times after a warm-up call; it reports the best tokens/s and the
process's peak resident memory (VmHWM) after loading and after the forwards. Then the text
with late chunking (`embed_chunks`, chunks of --chunk-size tokens, one read-out row each), timed
the same way, and the peak memory after it. Results: perf/results/long.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from harness import RESULTS, best_seconds, markdown_table, new_record, status_mib, write_report

from bench_peers import REPO, ensure_model


def measure(model_dir: str, length: int, reps: int, chunk_size: int) -> dict:
    from qwen_embed import ChunkedText, Encoder
    from qwen_embed_deploy.demo import ENDOFTEXT_ID

    rng = np.random.default_rng(length)
    ids = rng.integers(0, ENDOFTEXT_ID, size=length - 1).tolist() + [ENDOFTEXT_ID]
    with Encoder.from_pretrained(model_dir, prefix_reuse=False) as enc:
        loaded = status_mib("VmHWM")
        best = best_seconds(lambda: enc.embed([ids]), reps)
        plain_peak = status_mib("VmHWM")
        starts = np.arange(0, length - 1, chunk_size)
        spans = np.stack([starts, np.minimum(starts + chunk_size, length - 1)], axis=1)
        text = ChunkedText(np.array(ids), spans, tail=1)
        chunked = best_seconds(lambda: enc.embed_chunks([text]), reps)
        return {
            "tokens": length,
            "tokens_per_s": length / best,
            "seconds": best,
            "peak_rss_loaded_mib": loaded,
            "peak_rss_mib": plain_peak,
            "chunks": len(spans),
            "chunked_tokens_per_s": length / chunked,
            "chunked_peak_rss_mib": status_mib("VmHWM"),
            "route": enc.route.describe(),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "demo-model"))
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunk-size", type=int, default=512, help="late chunking's chunk tokens")
    p.add_argument("--out", default=str(RESULTS / "long"))
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the per-length child process
    args = p.parse_args()
    model_dir = str(ensure_model(Path(args.model_dir).resolve(), 3))
    if args.one:
        print(json.dumps(measure(model_dir, args.one, args.reps, args.chunk_size)))
        return
    results = []
    for length in args.lengths:
        child = [sys.executable, __file__, "--model-dir", model_dir, "--reps", str(args.reps)]
        child += ["--chunk-size", str(args.chunk_size)]
        run = subprocess.run([*child, "--one", str(length)], capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(run.stderr)
        results.append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    base = results[0]["tokens_per_s"]
    rows = [
        [
            f"{r['tokens']:,}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['tokens_per_s'] / base:.2f}",
            f"{r['seconds']:.2f}",
            f"{r['peak_rss_loaded_mib']:.0f}",
            f"{r['peak_rss_mib']:.0f}",
            f"{r['chunks']}",
            f"{r['chunked_tokens_per_s']:.0f}",
            f"{r['chunked_tokens_per_s'] / r['tokens_per_s']:.2f}",
            f"{r['chunked_peak_rss_mib']:.0f}",
        ]
        for r in results
    ]
    header = ["text tokens", "tokens/s", f"vs {results[0]['tokens']:,}", "seconds"]
    header += ["peak RSS loaded MiB", "peak RSS after MiB", "chunks"]
    header += ["chunked tokens/s", "chunked vs plain", "peak RSS after chunked MiB"]
    record = new_record(
        model_dir=model_dir, reps=args.reps, chunk_size=args.chunk_size, results=results
    )
    notes = [f"route: {results[0]['route']}", "one text per call, best of --reps after a warm-up"]
    write_report(args.out, record, "One long text", notes, markdown_table(header, rows))


if __name__ == "__main__":
    main()
