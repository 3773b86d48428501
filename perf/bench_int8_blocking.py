"""How the int8 route's GEMM is best cut on this CPU: blockings of the native int8 operator
(quantised rows, the brgemm micro-kernel's integer sums, the rescale) per GEMM shape and row
count, against the float route's bf16 GEMM (oneDNN's packed) of the same shape.

    python bench_int8_blocking.py [--rows 20 128 1024 16384] [--rounds 3]

The operator (ops.cpp int8_linear) makes one whole-K micro-kernel call per task and panel of
64 channels, so every blocking gives a row the same bits (checked against the default for each):
rows and channels per task, and whether consecutive tasks share channels or rows. Per shape of
the route's int8 layers (Qwen3-Embedding-0.6B's widths) and row count: every blocking once
(best of 3), then the 4 fastest, the default and the bf16 GEMM taking turns (as
bench_bf16_blocking.py). The default is the operator's own (96 rows x 1,024 channels,
channels outermost).
"""

from __future__ import annotations

import itertools

import torch
from bench_bf16_blocking import arguments, compare, label, report, schema_blocking

from qwen_embed import int8, native
from qwen_embed.cpu import keep_freed_memory
from qwen_embed.onednn import PackedWeight

SHAPES = {"qk": (3072, 1024), "gate_up": (6144, 1024), "down": (1024, 3072)}


def default_blocking() -> tuple:
    return (native.PANEL, *schema_blocking(torch.ops.qwen_embed.int8_linear))


def blockings() -> list[tuple]:
    return list(itertools.product((native.PANEL,), (32, 96, 256), (256, 512, 1024), (True, False)))


def measure(name: str, m: int, rounds: int) -> dict:
    n, k = SHAPES[name]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g).bfloat16()
    layer, bf16 = int8.Int8Weight(w), PackedWeight(w.bfloat16())

    def call(b: tuple):
        _, rows, channels, channels_outer = b
        return lambda: torch.ops.qwen_embed.int8_linear(
            x,
            layer.packed,
            layer.offset,
            layer.scale,
            None,
            n,
            layer.rotation,
            rows,
            channels,
            channels_outer,
        )

    shape = f"{name} {n}x{k}"
    return compare(shape, m, call, blockings(), default_blocking(), lambda: bf16(x), rounds)


def main() -> None:
    args = arguments(__doc__, "int8_blocking")
    keep_freed_memory()  # as the engine does: no page faults in the timings
    if not int8.native_kernel():
        raise SystemExit("the native int8 operator does not run here (AVX512_VNNI and oneDNN)")
    rows = [measure(name, m, args.rounds) for m in args.rows for name in SHAPES]
    title = "The int8 route's GEMM: blockings"
    report(args, rows, title, "bf16 GEMM", label(default_blocking()))


if __name__ == "__main__":
    main()
