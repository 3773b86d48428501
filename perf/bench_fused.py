"""Elementwise ops compiled by Inductor (fused.py) vs eager, on one encoder in one process.

    python bench_fused.py [--model-dir .cache/bench-model-4l] [--texts 128] [--dtypes ...]

Per dtype: one encoder loaded with the ops compiled, then switched between its compiled and
eager forwards in turns (perf/workload.alternate: the machine's drift falls on both); the
mixed workload (80% 16-64 tokens, 20% 256-1024), prefix reuse off. Reports the best tokens/s
of each, their ratio and the min cosine between the two.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from qwen_embed import Encoder

from bench_engine import workload
from bench_peers import REPO, ensure_model
from workload import RESULTS, alternate, new_record, write_report


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
        with Encoder.from_pretrained(model_dir, dtype=dtype, prefix_reuse=False,
                                     compile_elementwise=True) as enc:  # fmt: skip
            load_s = time.perf_counter() - began
            runs = alternate(enc, ids, {
                "compiled": lambda m=enc.model: setattr(m, "compiled_elementwise", True),
                "eager": lambda m=enc.model: setattr(m, "compiled_elementwise", False),
            }, rounds=args.rounds)  # fmt: skip
        on, off = runs["compiled"], runs["eager"]
        cos = float((on["vectors"] * off["vectors"]).sum(1).min())
        rows.append({"dtype": dtype, "compiled_tok_s": on["tok_s"], "eager_tok_s": off["tok_s"],
                     "ratio": on["tok_s"] / off["tok_s"], "load_s": load_s,
                     "min_cosine": cos})  # fmt: skip
        print(rows[-1], flush=True)
    table = ["| dtype | tokens/s compiled | eager | compiled / eager | min cosine | load s |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        table.append(f"| {r['dtype']} | {r['compiled_tok_s']:.0f} | {r['eager_tok_s']:.0f} | "
                     f"{r['ratio']:.3f} | {r['min_cosine']:.6f} | {r['load_s']:.1f} |")  # fmt: skip
    note = (
        f"model: {model_dir.name}; {args.texts} mixed texts, {sum(map(len, ids))} tokens; "
        f"best of {args.rounds} alternating rounds per variant, one encoder per dtype"
    )
    write_report(args.out, new_record(rows=rows), "Compiled elementwise ops vs eager",
                 [note], table)  # fmt: skip


if __name__ == "__main__":
    main()
