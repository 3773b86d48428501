"""Elementwise ops compiled by Inductor (fused.py) vs eager, on one encoder in one process.

    python bench_fused.py [--model-dir .cache/bench-model-4l] [--texts 128] [--dtypes ...]

Per dtype: one encoder loaded with the ops compiled, then switched between its compiled and
eager forwards in turns (perf/workload.alternate: the machine's drift falls on both); the
mixed workload (80% 16-64 tokens, 20% 256-1024), prefix reuse off. Reports the best tokens/s
of each, their ratio and the min cosine between the two. Then per forward size (the workload's
short texts 1-16 per forward, its mixed texts 8 and 32 per forward): ms per forward with the
compiled ops in every forward vs eager, which is where fused.COMPILED_MIN_ROWS comes from.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from qwen_embed import Encoder
from qwen_embed.fused import COMPILED_MIN_ROWS

from bench_engine import workload
from bench_peers import REPO, ensure_model
from workload import RESULTS, alternate, alternate_forwards, new_record, write_report


def by_forward_size(enc: Encoder, ids: list[list[int]], rounds: int) -> list[dict]:
    """Compiled ops in every forward (compiled_min_rows 0) vs eager, in turns; best of
    `rounds`, 12 forwards of each size."""
    model, rows = enc.model, []
    short = [x for x in ids if len(x) <= 64]
    cases = [("short", short, n) for n in (1, 2, 4, 8, 16)] + [
        ("mixed", ids, 8),
        ("mixed", ids, 32),
    ]

    def use(compiled: bool):
        def switch():
            model.compiled_elementwise, model.compiled_min_rows = compiled, 0

        return switch

    try:
        for name, texts, size in cases:
            chunks = [texts[i : i + size] for i in range(0, len(texts) - size + 1, size)][:12]
            best = alternate_forwards(
                enc, chunks, {"compiled": use(True), "eager": use(False)}, rounds
            )
            rows.append(
                {
                    "texts": name,
                    "per_forward": size,
                    "rows": sum(len(x) for c in chunks for x in c) / len(chunks),
                    "compiled_ms": best["compiled"] * 1e3,
                    "eager_ms": best["eager"] * 1e3,
                }
            )
            print(rows[-1], flush=True)
    finally:
        model.compiled_elementwise, model.compiled_min_rows = True, COMPILED_MIN_ROWS
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-model-4l"))
    p.add_argument("--layers", type=int, default=4, help="layers when building --model-dir")
    p.add_argument("--texts", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--out", default=str(RESULTS / "fused"))
    args = p.parse_args()
    model_dir = ensure_model(Path(args.model_dir).resolve(), args.layers)
    ids = workload("mixed", args.texts, 0, 0)
    rows = []
    for dtype in args.dtypes:
        began = time.perf_counter()
        with Encoder.from_pretrained(
            model_dir, dtype=dtype, prefix_reuse=False, compile_elementwise=True
        ) as enc:
            load_s = time.perf_counter() - began
            runs = alternate(
                enc,
                ids,
                {
                    "compiled": lambda m=enc.model: setattr(m, "compiled_elementwise", True),
                    "eager": lambda m=enc.model: setattr(m, "compiled_elementwise", False),
                },
                rounds=args.rounds,
            )
            sizes = by_forward_size(enc, ids, args.rounds)
        on, off = runs["compiled"], runs["eager"]
        cos = float((on["vectors"] * off["vectors"]).sum(1).min())
        rows.append(
            {
                "dtype": dtype,
                "compiled_tok_s": on["tok_s"],
                "eager_tok_s": off["tok_s"],
                "ratio": on["tok_s"] / off["tok_s"],
                "load_s": load_s,
                "min_cosine": cos,
                "by_forward_size": sizes,
            }
        )
        print(rows[-1], flush=True)
    table = [
        "| dtype | tokens/s compiled | eager | compiled / eager | min cosine | load s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        table.append(
            f"| {r['dtype']} | {r['compiled_tok_s']:.0f} | {r['eager_tok_s']:.0f} | "
            f"{r['ratio']:.3f} | {r['min_cosine']:.6f} | {r['load_s']:.1f} |"
        )
    table += [
        "",
        "Per forward size (compiled ops in every forward vs eager; short = the texts "
        "of <= 64 tokens):",
        "",
        "| dtype | texts per forward | rows per forward | ms compiled | ms eager "
        "| eager speed-up |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        for f in r["by_forward_size"]:
            table.append(
                f"| {r['dtype']} | {f['per_forward']} {f['texts']} | {f['rows']:.0f} | "
                f"{f['compiled_ms']:.1f} | {f['eager_ms']:.1f} | "
                f"{f['compiled_ms'] / f['eager_ms']:.3f} |"
            )
    note = (
        f"model: {model_dir.name}; {args.texts} mixed texts, {sum(map(len, ids))} tokens; "
        f"best of {args.rounds} alternating rounds per variant, one encoder per dtype"
    )
    write_report(
        args.out, new_record(rows=rows), "Compiled elementwise ops vs eager", [note], table
    )


if __name__ == "__main__":
    main()
