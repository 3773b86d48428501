"""Whether a row of a packed oneDNN GEMM comes out the same at any row count, and what forcing
one row count would cost, on the demo model's GEMM shapes (Qwen3-Embedding-0.6B's widths).

    python bench_gemm_rows.py [--dtypes bfloat16 float32]

Per shape and dtype: the row counts (1 to 1,024) whose rows equal the same rows of a 1,024-row
call, bitwise; then the cost of running every GEMM as fixed 256-row calls (which makes a row's
result independent of its batch: a fixed shape takes one kernel): a 20-row forward padded to
256 rows, and 1,024 rows as four 256-row calls, each against the plain call (best of 20).

bf16 also on the native operator over oneDNN's brgemm micro-kernel (onednn.NativeBf16Weight, AMX
tiles where the CPU has them: the GEMM of batch_invariant "on"): the whole K in one call per
block of rows, so a row's sums never depend on the rows beside it. The same row counts are checked,
and its 20 and 1,024 rows timed against the packed GEMM.
"""

from __future__ import annotations

import argparse

import torch
from harness import RESULTS, best_seconds, markdown_table, new_record, write_report

from qwen_embed.onednn import NativeBf16Weight, PackedWeight, brgemm_runs

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
FIXED = 256


def best_ms(call) -> float:
    return best_seconds(call, 20) * 1e3


def measure(name: str, dtype: torch.dtype) -> dict:
    out_features, in_features = SHAPES[name]
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=g).to(dtype)
    layer = PackedWeight(weight)
    x = torch.randn(1024, in_features, generator=g).to(dtype)
    full = layer(x)
    counts = [*range(1, 65), *range(72, 1025, 8)]
    differ = [m for m in counts if not torch.equal(layer(x[:m]), full[:m])]
    padded = torch.zeros(FIXED, in_features, dtype=dtype)
    padded[:20] = x[:20]
    brgemm = {}
    if dtype == torch.bfloat16 and brgemm_runs():
        probe = NativeBf16Weight(weight)
        whole = probe(x)
        exact = x.float() @ weight.float().T
        brgemm = {
            "brgemm_counts_differing": sum(
                not torch.equal(probe(x[:m]), whole[:m]) for m in counts
            ),
            # against the fp32 product, beside the packed GEMM's
            "brgemm_max_abs": float((whole.float() - exact).abs().max()),
            "max_abs": float((full.float() - exact).abs().max()),
            "brgemm_rows20_ms": best_ms(lambda: probe(x[:20])),
            "brgemm_rows1024_ms": best_ms(lambda: probe(x)),
        }
    row = {
        "shape": f"{name} {out_features}x{in_features}",
        "dtype": str(dtype).removeprefix("torch."),
        "counts_tested": len(counts),
        "counts_differing": len(differ),
        "differing": f"{differ[0]}..{differ[-1]}" if differ else "none",
        "rows20_ms": best_ms(lambda: layer(x[:20])),
        "rows20_padded_ms": best_ms(lambda: layer(padded)),
        "rows1024_ms": best_ms(lambda: layer(x)),
        "rows1024_fixed_ms": best_ms(
            lambda: [layer(x[i : i + FIXED]) for i in range(0, 1024, FIXED)]
        ),
        **brgemm,
    }
    print(row, flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--out", default=str(RESULTS / "gemm_rows"))
    args = p.parse_args()
    rows = [measure(name, getattr(torch, d)) for d in args.dtypes for name in SHAPES]
    table = markdown_table(
        [
            "GEMM",
            "dtype",
            "row counts differing from a 1,024-row call",
            "20 rows ms",
            f"padded to {FIXED}",
            "1,024 rows ms",
            f"as {FIXED}-row calls",
        ],
        [
            [
                r["shape"],
                r["dtype"],
                f"{r['counts_differing']} of {r['counts_tested']} ({r['differing']})",
                f"{r['rows20_ms']:.3f}",
                f"{r['rows20_padded_ms']:.3f} ({r['rows20_padded_ms'] / r['rows20_ms']:.1f}x)",
                f"{r['rows1024_ms']:.3f}",
                f"{r['rows1024_fixed_ms']:.3f} ({r['rows1024_fixed_ms'] / r['rows1024_ms']:.2f}x)",
            ]
            for r in rows
        ],
    )
    probed = [r for r in rows if "brgemm_rows20_ms" in r]
    if probed:
        table += [
            "",
            "bf16 on the brgemm operator (onednn.NativeBf16Weight), against the packed GEMM:",
            "",
            *markdown_table(
                [
                    "GEMM",
                    "row counts differing",
                    "20 rows ms (x packed)",
                    "1,024 rows ms (x packed)",
                    "max-abs vs fp32: packed / brgemm",
                ],
                [
                    [
                        r["shape"],
                        f"{r['brgemm_counts_differing']} of {r['counts_tested']}",
                        f"{r['brgemm_rows20_ms']:.3f} "
                        f"({r['brgemm_rows20_ms'] / r['rows20_ms']:.2f}x)",
                        f"{r['brgemm_rows1024_ms']:.3f} "
                        f"({r['brgemm_rows1024_ms'] / r['rows1024_ms']:.2f}x)",
                        f"{r['max_abs']:.3g} / {r['brgemm_max_abs']:.3g}",
                    ]
                    for r in probed
                ],
            ),
        ]
    notes = [
        f"{torch.get_num_threads()} threads; onednn.PackedWeight (never one row: planned_rows)"
    ]
    record = new_record(rows=rows)
    write_report(
        args.out, record, "GEMM rows and row counts (oneDNN, packed weights)", notes, table
    )


if __name__ == "__main__":
    main()
