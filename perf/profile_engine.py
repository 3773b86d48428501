"""Where the engine's time goes: torch.profiler over one embed() of the mixed workload.

    python perf/profile_engine.py [--model-dir .cache/demo-model] [--dtype float32]

Writes the operators by self time (perf/results/profile.md and .json), grouped into GEMMs, attention
and the rest, so optimisation starts from a measurement.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness import RESULTS, markdown_table, new_record, write_report
from torch.profiler import ProfilerActivity, profile

from qwen_embed import Encoder
from qwen_embed.serving.config import DEMO_MODEL_DIR
from qwen_embed.settings import QUANTIZATIONS

from bench_engine import workload

GROUPS = {  # operator name fragments -> what they are; the first group that matches wins
    "attention": (
        "qwen_embed::varlen_attention",
        "scaled_dot_product",
        "flash",
        "_efficient_attention",
        "aten::bmm",
    ),
    "GEMM (linear layers)": (
        "aten::addmm",
        "aten::mm",
        "aten::linear",
        "aten::matmul",
        "mkldnn::",
        "_int_mm",
        "qwen_embed::int8_linear",
    ),
    "row-wise kernels (native)": ("qwen_embed::",),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(DEMO_MODEL_DIR))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    p.add_argument("--texts", type=int, default=64)
    p.add_argument("--out", type=Path, default=RESULTS / "profile")
    args = p.parse_args()
    seqs = workload("mixed", args.texts, 0, 0)
    with Encoder.from_pretrained(
        args.model_dir, dtype=args.dtype, quantization=args.quantization
    ) as encoder:
        encoder.embed(seqs[:4])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            encoder.embed(seqs)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    grouped = dict.fromkeys([*GROUPS, "everything else"], 0.0)
    for e in events:
        group = next(
            (g for g, keys in GROUPS.items() if any(k in e.key for k in keys)), "everything else"
        )
        grouped[group] += e.self_cpu_time_total
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]
    tokens = sum(map(len, seqs))
    record = new_record(
        dtype=args.dtype,
        quantization=args.quantization,
        texts=len(seqs),
        tokens=tokens,
        shares={g: t / total for g, t in grouped.items()},
        operators=[
            {"name": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3} for e in top
        ],
    )
    notes = [
        f"work: one embed() of {len(seqs)} mixed texts, {tokens} tokens, {args.dtype}, "
        f"quantization {args.quantization}"
    ]
    table = markdown_table(
        ["where", "share"], [[g, f"{t / total:.1%}"] for g, t in grouped.items()]
    )
    table += [""] + markdown_table(
        ["operator", "calls", "self ms", "share"],
        [
            [
                f"`{e.key}`",
                e.count,
                f"{e.self_cpu_time_total / 1e3:.1f}",
                f"{e.self_cpu_time_total / total:.1%}",
            ]
            for e in top
        ],
    )
    write_report(args.out, record, "Engine profile (torch.profiler, self CPU time)", notes, table)


if __name__ == "__main__":
    main()
