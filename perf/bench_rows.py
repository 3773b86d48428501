"""The row-wise ops of a decoder layer against the memory bound: GB/s of each native kernel,
and of a plain copy of the same bytes on the same machine.

    python bench_rows.py [--tokens 2048 16384] [--dtypes bfloat16 float32]

Two sizes by default: 2,048 tokens, where most ops' bytes fit a server's last-level cache
(the kernels' arithmetic shows), and 16,384, which stream from memory. Bytes are what an op
must read and write once (inputs, outputs, cos/sin tables), on the demo model's widths
(Qwen3-Embedding-0.6B: hidden 1024, 16 query / 8 kv heads of 128, MLP 3072). The copy moves
as many bytes (read + write), so both meet the same caches; glibc keeps freed memory as the
engine has it (cpu.keep_freed_memory), so neither pays first-touch page faults.
"""

from __future__ import annotations

import argparse

import torch
from harness import RESULTS, best_seconds, markdown_table, new_record, write_report

from qwen_embed import native
from qwen_embed.cpu import keep_freed_memory
from qwen_embed.layers import rms_norm, silu_mul

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 1024, 16, 8, 128, 3072


def ops(tokens: int, dtype: torch.dtype) -> dict:
    """name -> (call, bytes it reads and writes)"""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    e = torch.finfo(dtype).bits // 8
    x, residual, w = rand(tokens, HIDDEN), rand(tokens, HIDDEN), rand(HIDDEN)
    qkv = rand(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q, k = qkv[:, : HEADS * HEAD_DIM], qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM]
    cos, sin, norm_w = rand(tokens, HEAD_DIM // 2), rand(tokens, HEAD_DIM // 2), rand(HEAD_DIM)
    gate_up = rand(tokens, 2 * MLP)
    rope = torch.ops.qwen_embed.rope
    table = tokens * HEAD_DIM * e  # cos and sin
    return {
        "rms_norm": (lambda: rms_norm(x, w, 1e-6), 2 * x.numel() * e),
        "residual add": (lambda: x.add_(residual), 3 * x.numel() * e),
        "q norm + rotary": (
            lambda: rope(q, cos, sin, HEAD_DIM, norm_w, 1e-6),
            2 * q.numel() * e + table,
        ),
        "k norm + rotary": (
            lambda: rope(k, cos, sin, HEAD_DIM, norm_w, 1e-6),
            2 * k.numel() * e + table,
        ),
        "silu(gate) * up": (lambda: silu_mul(gate_up), 3 * tokens * MLP * e),
    }


def best_of_both(call, nbytes: int, reps: int) -> tuple[float, float]:
    """Bytes per second of `call` and of a copy that reads and writes `nbytes` in all, each the
    best of `reps`, the two taking turns so that both meet the same moments of a shared host."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    op = copy = float("inf")
    for _ in range(reps):
        op = min(op, best_seconds(call, 1))
        copy = min(copy, best_seconds(lambda: dst.copy_(src), 1))
    return nbytes / op, nbytes / copy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 16384])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--reps", type=int, default=30, help="at 16,384 tokens; more at fewer")
    p.add_argument("--out", default=str(RESULTS / "rows"))
    args = p.parse_args()
    keep_freed_memory()
    if native.isa() is None:
        raise SystemExit("the native kernels are not built (make setup)")
    rows = []
    for tokens, dtype_name in ((t, d) for t in args.tokens for d in args.dtypes):
        dtype = getattr(torch, dtype_name)
        for name, (call, nbytes) in ops(tokens, dtype).items():
            rate, copy = best_of_both(call, nbytes, args.reps * max(1, 16384 // tokens))
            rows.append(
                {
                    "tokens": tokens,
                    "op": name,
                    "dtype": dtype_name,
                    "MB": nbytes / 1e6,
                    "GBps": rate / 1e9,
                    "copy_GBps": copy / 1e9,
                    "of_copy": rate / copy,
                }
            )
            print(rows[-1], flush=True)
    record = new_record(
        tokens=args.tokens, isa=native.isa(), threads=torch.get_num_threads(), rows=rows
    )
    notes = [
        f"work: {', '.join(map(str, args.tokens))} tokens, demo model widths; native kernels "
        f"{native.isa()}, {torch.get_num_threads()} threads; best of {args.reps} at 16,384 "
        "tokens and proportionally more at fewer, the op and the copy taking turns",
    ]
    table = markdown_table(
        ["tokens", "op", "dtype", "MB moved", "GB/s", "copy of the same bytes GB/s", "of copy"],
        [
            [
                f"{r['tokens']:,}",
                r["op"],
                r["dtype"],
                f"{r['MB']:.0f}",
                f"{r['GBps']:.1f}",
                f"{r['copy_GBps']:.1f}",
                f"{r['of_copy']:.0%}",
            ]
            for r in rows
        ],
    )
    write_report(args.out, record, "Row-wise ops against a copy of the same bytes", notes, table)


if __name__ == "__main__":
    main()
