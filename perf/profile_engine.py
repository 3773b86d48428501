"""Where the engine's time goes: torch.profiler over embed() of the mixed workload.

    python perf/profile_engine.py [--model-dir .cache/demo-model] [--dtype float32]
                                  [--texts 64] [--texts-per-call N ...] [--rounds 3]
                                  [--device cuda]

Writes the operators by self time (perf/results/profile.md and .json), grouped into GEMMs,
attention and the rest, so optimisation starts from a measurement. With several
--texts-per-call the same texts are embedded in calls of each size (a Triton execute holds a few
requests' texts; the engine alone takes them all at once): tokens/s per size, the sizes taking
turns for --rounds rounds unprofiled, then one profiled pass each, milliseconds per group.
On a GPU the report adds the kernels: GPU time per group, launches per layer, and the share of
the profiled pass the GPU sat idle.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from harness import RESULTS, markdown_table, new_record, write_report
from torch.profiler import ProfilerActivity, profile

from qwen_embed import Encoder
from qwen_embed.settings import QUANTIZATIONS
from qwen_embed_deploy.serving.config import DEMO_MODEL_DIR

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
        "qwen_embed::bf16_linear",
        "qwen_embed::f32_linear",
    ),
    "row-wise kernels (native)": ("qwen_embed::",),
}


KERNEL_GROUPS = {  # CUDA kernel name fragments, as GROUPS
    "attention": ("flash", "fmha", "attention"),
    "GEMM (linear layers)": ("gemm", "nvjet", "cutlass", "xmma", "cublas"),
    "fused row kernels (Triton)": ("_rms_norm_rows", "_norm_rotary_heads", "_silu_mul_rows"),
    "copies": ("memcpy", "memset", "copy"),
}


def group_of(key: str, groups: dict = GROUPS) -> str:
    return next((g for g, keys in groups.items() if any(k in key for k in keys)), "everything else")


def kernel_profile(prof, wall_s: float, layers: int, forwards: int) -> dict:
    """GPU time per kernel group, launches, and how much of the wall time no kernel ran."""
    from torch.autograd import DeviceType

    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    grouped = dict.fromkeys([*KERNEL_GROUPS, "everything else"], 0.0)
    by_name: dict[str, list] = {}
    for e in kernels:
        ms = e.time_range.elapsed_us() / 1e3
        grouped[group_of(e.name.lower(), KERNEL_GROUPS)] += ms
        entry = by_name.setdefault(e.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += ms
    busy = sum(grouped.values())
    return {
        "kernel_ms": grouped,
        "kernel_busy_ms": busy,
        "idle_share": max(0.0, 1 - busy / (wall_s * 1e3)),
        "launches": len(kernels),
        "launches_per_layer": len(kernels) / max(1, layers * forwards),
        "top_kernels": [
            {"name": n, "calls": c, "ms": ms}
            for n, (c, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
        ],
    }


def passes(encoder, seqs: list, per_call: int):
    """One pass over `seqs` in calls of `per_call` texts."""

    def run():
        for i in range(0, len(seqs), per_call):
            encoder.embed(seqs[i : i + per_call])

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(DEMO_MODEL_DIR))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    p.add_argument("--texts", type=int, default=64)
    p.add_argument("--texts-per-call", type=int, nargs="+", help="default: all in one call")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--cuda-graph-tokens", type=int, help="default: the setting's default")
    p.add_argument("--out", type=Path, default=RESULTS / "profile")
    args = p.parse_args()
    seqs = workload("mixed", args.texts, 0, 0)
    tokens = sum(map(len, seqs))
    sizes = args.texts_per_call or [len(seqs)]
    gpu = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
    graphs = {} if args.cuda_graph_tokens is None else {"cuda_graph_tokens": args.cuda_graph_tokens}
    with Encoder.from_pretrained(
        args.model_dir,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        **graphs,
    ) as encoder:
        route = encoder.route.describe()
        runs = {size: passes(encoder, seqs, size) for size in sizes}
        encoder.embed(seqs[:4])
        seconds = {size: [] for size in sizes}
        for _ in range(args.rounds if len(sizes) > 1 else 0):
            for size, run in runs.items():
                started = time.perf_counter()
                run()
                seconds[size].append(time.perf_counter() - started)
        profiles = {}
        for size, run in runs.items():
            forwards = encoder.stats["forwards"] if gpu else 0
            with profile(activities=activities) as prof:
                started = time.perf_counter()
                run()
                wall = time.perf_counter() - started
            events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
            kernels = None
            if gpu:
                forwards = encoder.stats["forwards"] - forwards
                kernels = kernel_profile(prof, wall, encoder.config.num_layers, forwards)
            profiles[size] = (wall, events, kernels)
    per_size = []
    for size, (wall, events, kernels) in profiles.items():
        grouped = dict.fromkeys([*GROUPS, "everything else"], 0.0)
        for e in events:
            grouped[group_of(e.key)] += e.self_cpu_time_total / 1e3
        timed = statistics.median(seconds[size]) if seconds[size] else None
        per_size.append(
            {
                "texts_per_call": size,
                "tokens_per_s": tokens / timed if timed else None,
                "round_seconds": seconds[size],
                "profiled_wall_ms": wall * 1e3,
                "group_ms": grouped,
                "gpu": kernels,
                "operators": [
                    {"name": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3}
                    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]
                ],
            }
        )
    first = per_size[0]
    total = sum(first["group_ms"].values())
    record = new_record(
        dtype=args.dtype,
        device=args.device,
        route=route,
        quantization=args.quantization,
        texts=len(seqs),
        tokens=tokens,
        shares={g: t / total for g, t in first["group_ms"].items()},
        operators=first["operators"],
        per_call_size=per_size,
    )
    notes = [
        f"work: embed() of {len(seqs)} mixed texts, {tokens} tokens, {args.dtype}, "
        f"quantization {args.quantization}, in calls of {', '.join(map(str, sizes))} texts",
        f"route: {route}",
        "self CPU time on the calling thread (an operator's wall time, its OpenMP threads inside "
        "it), one profiled pass per size",
    ]
    table = markdown_table(
        ["where", *[f"{r['texts_per_call']} texts/call: ms (share)" for r in per_size]],
        [
            [g]
            + [
                f"{r['group_ms'][g]:.1f} ({r['group_ms'][g] / sum(r['group_ms'].values()):.1%})"
                for r in per_size
            ]
            for g in first["group_ms"]
        ]
        + [["profiled pass, wall ms"] + [f"{r['profiled_wall_ms']:.1f}" for r in per_size]],
    )
    if len(sizes) > 1:
        best = max(r["tokens_per_s"] for r in per_size)
        table += [""] + markdown_table(
            ["texts per call", "tokens/s (median of rounds, unprofiled)", "x the best"],
            [
                [
                    r["texts_per_call"],
                    f"{r['tokens_per_s']:.0f}",
                    f"{r['tokens_per_s'] / best:.2f}x",
                ]
                for r in per_size
            ],
        )
    table += [""] + markdown_table(
        ["operator", "calls", "self ms", "share"],
        [
            [f"`{o['name']}`", o["calls"], f"{o['self_ms']:.1f}", f"{o['self_ms'] / total:.1%}"]
            for o in first["operators"]
        ],
    )
    for r in per_size if gpu else []:
        k = r["gpu"]
        table += [
            "",
            f"GPU, {r['texts_per_call']} texts per call: {k['launches']} kernel launches "
            f"({k['launches_per_layer']:.1f} per layer per forward), kernels busy "
            f"{k['kernel_busy_ms']:.1f} ms of {r['profiled_wall_ms']:.1f} ms wall "
            f"(idle {k['idle_share']:.1%})",
            "",
        ]
        table += markdown_table(
            ["kernels", "GPU ms", "share"],
            [
                [g, f"{ms:.1f}", f"{ms / max(k['kernel_busy_ms'], 1e-9):.1%}"]
                for g, ms in k["kernel_ms"].items()
            ]
            + [[f"`{t['name']}` x{t['calls']}", f"{t['ms']:.1f}", ""] for t in k["top_kernels"]],
        )
    write_report(args.out, record, "Engine profile (torch.profiler, self CPU time)", notes, table)


if __name__ == "__main__":
    main()
