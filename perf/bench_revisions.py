"""This checkout against another revision, end to end in process: short queries and documents.

    python bench_revisions.py --base REV [--model-dir .cache/qwen3-0.6b-shape]
        [--quantization none int8] [--pairs 4]

A kernel change has `bench_kernels.py native_ab` (both builds in one process); a change to the
engine anywhere, Python or native, can only be timed by running each revision's own code. The
base revision is checked out once into .cache/revisions/<commit>/ (a git worktree, its native
kernels built there), and each pair is two processes, one per revision, the order alternating,
each loading the model (dtype auto) and timing bench_engine's workloads: 1-text calls of its
short queries (8-40 ids; 32 queries, three passes, the median ms per call: what one client's
query waits for) and --documents texts of --document-tokens ids (256; more for a change to
attention, whose share grows with a text's length) in one call (tokens/s, the best of two). The
report gives each pair's figures per quantization, their medians and the median of the pairs'
ratios (base / checkout time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import (
    REPO,
    RESULTS,
    ensure_model,
    markdown_table,
    named_revision,
    new_record,
    write_report,
)

QUERIES = 32
DOCUMENT_TOKENS = 256  # ids per document unless --document-tokens says otherwise


def measure(
    model_dir: str, quantization: str, documents: int, document_tokens: int = DOCUMENT_TOKENS
) -> dict:
    """One revision's figures, in this process (qwen_embed from the first entry of sys.path:
    bench_engine, imported here, takes that revision's)."""
    import qwen_embed
    from qwen_embed import Encoder

    from bench_engine import workload

    encoder = Encoder.from_pretrained(model_dir, dtype="auto", quantization=quantization)
    queries = workload("short", QUERIES, seed=0, uniform_len=0)
    for query in queries[:4]:
        encoder.embed([query])
    call_seconds = []
    for _ in range(3):
        for query in queries:
            start = time.perf_counter()
            encoder.embed([query])
            call_seconds.append(time.perf_counter() - start)
    texts = workload("uniform", documents, seed=1, uniform_len=document_tokens)
    tokens = sum(map(len, texts))
    encoder.embed(texts[:1])
    rates = []
    for _ in range(2):
        start = time.perf_counter()
        encoder.embed(texts)
        rates.append(tokens / (time.perf_counter() - start))
    return {
        "query_ms": statistics.median(call_seconds) * 1e3,
        "documents_tok_s": max(rates),
        "code": qwen_embed.__file__,
    }


def base_plugins(revision: str) -> Path:
    """The base revision's plugins/ in a worktree under .cache/revisions/, kernels built."""
    commit = subprocess.run(
        ["git", "rev-parse", revision], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    tree = REPO / ".cache" / "revisions" / commit
    if not tree.exists():  # a tree removed by hand stays registered until pruned
        subprocess.run(["git", "worktree", "prune"], cwd=REPO, check=True)
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), commit], cwd=REPO, check=True
        )
    plugins = tree / "plugins"
    subprocess.run([sys.executable, "-m", "qwen_embed.native.build"], cwd=plugins, check=True)
    return plugins


def run_one(plugins: Path, model_dir: str, quantization: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--measure", str(plugins), "--model-dir", model_dir]
    command += ["--quantization", quantization, "--documents", str(args.documents)]
    command += ["--document-tokens", str(args.document_tokens)]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    if not Path(figures.pop("code")).is_relative_to(plugins):
        raise SystemExit(f"a measuring process ran another revision's qwen_embed than {plugins}")
    return figures


def speedups(base: dict, mine: dict) -> tuple[float, float]:
    """The checkout's gain on each figure: base / checkout time per query, checkout / base
    tokens/s on documents."""
    return base["query_ms"] / mine["query_ms"], mine["documents_tok_s"] / base["documents_tok_s"]


def table_rows(quantization: str, pairs: list[dict]) -> list[list]:
    rows = []
    for pair, f in enumerate(pairs, 1):
        base, mine = f["base"], f["checkout"]
        query, documents = speedups(base, mine)
        rows.append(
            [quantization, pair, f"{base['query_ms']:.2f}", f"{mine['query_ms']:.2f}"]
            + [f"{query:.3f}", f"{base['documents_tok_s']:.0f}"]
            + [f"{mine['documents_tok_s']:.0f}", f"{documents:.3f}"]
        )
    medians = {
        side: {key: statistics.median(f[side][key] for f in pairs) for key in pairs[0][side]}
        for side in ("base", "checkout")
    }
    ratios = [speedups(f["base"], f["checkout"]) for f in pairs]
    rows.append(
        [quantization, "median", f"{medians['base']['query_ms']:.2f}"]
        + [f"{medians['checkout']['query_ms']:.2f}"]
        + [f"{statistics.median(r[0] for r in ratios):.3f}"]
        + [f"{medians['base']['documents_tok_s']:.0f}"]
        + [f"{medians['checkout']['documents_tok_s']:.0f}"]
        + [f"{statistics.median(r[1] for r in ratios):.3f}"]
    )
    return rows


def compare(args: argparse.Namespace) -> None:
    model_dir = str(ensure_model(Path(args.model_dir), 28))
    base = named_revision(args.base)
    plugins = {"base": base_plugins(args.base), "checkout": REPO / "plugins"}
    rows, results = [], {}
    for quantization in args.quantization:
        pairs = []
        for pair in range(args.pairs):
            order = list(plugins) if pair % 2 == 0 else list(plugins)[::-1]
            figures = {
                side: run_one(plugins[side], model_dir, quantization, args) for side in order
            }
            print(quantization, pair + 1, figures, flush=True)
            pairs.append(figures)
        results[quantization] = pairs
        rows += table_rows(quantization, pairs)
    header = ["quantization", "pair", "base ms per query", "checkout ms", "base / checkout"]
    header += ["base documents tokens/s", "checkout tokens/s", "checkout / base"]
    record = new_record(base=base, model_dir=model_dir, pairs=results)
    notes = [
        f"base: {base}; model {model_dir}, dtype auto; {QUERIES} queries of 8-40 ids one"
        f" call each (3 passes, median ms per call) and {args.documents} documents of"
        f" {args.document_tokens} ids in one call (best of 2); {args.pairs} pairs of processes, one"
        " per revision, the order alternating"
    ]
    title = "This checkout vs a base revision, end to end"
    write_report(args.out, record, title, notes, markdown_table(header, rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", default="HEAD", help="git revision to compare against")
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "qwen3-0.6b-shape"))
    p.add_argument("--quantization", nargs="+", default=["none", "int8"])
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--document-tokens", type=int, default=DOCUMENT_TOKENS)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--out", default=str(RESULTS / "revisions"))
    p.add_argument("--measure", metavar="PLUGINS", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:  # one side of a pair: that revision's qwen_embed first on the path
        sys.path.insert(0, args.measure)
        figures = measure(
            args.model_dir, args.quantization[0], args.documents, args.document_tokens
        )
        print(json.dumps(figures))
        return
    compare(args)


if __name__ == "__main__":
    main()
