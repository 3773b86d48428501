"""Whether a row of a packed oneDNN GEMM comes out the same at any row count, and what forcing
one row count would cost, on the demo model's GEMM shapes (Qwen3-Embedding-0.6B's widths).

    python bench_gemm_rows.py [--dtypes bfloat16 float32]

Per shape and dtype: the row counts (1 to 1,024) whose rows equal the same rows of a 1,024-row
call, bitwise; then the cost of running every GEMM as fixed 256-row calls (which makes a row's
result independent of its batch: a fixed shape takes one kernel): a 20-row forward padded to
256 rows, and 1,024 rows as four 256-row calls, each against the plain call (best of 20).

bf16 also on oneDNN's brgemm micro-kernel (torch's cpublas::brgemm; AMX tiles where the CPU
has them): the whole K in one call per 32 rows x 64 channels, so a row's sums never depend on
the rows beside it. The same row counts are checked, and its 20 and 1,024 rows timed against
the packed GEMM: what a row-invariant bf16 GEMM would cost. That GEMM is compiled here at run
time (torch.utils.cpp_extension, into .cache/), a probe for this benchmark, not a route.
"""

from __future__ import annotations

import argparse
import functools

import torch
from harness import RESULTS, best_seconds, markdown_table, new_record, write_report

from qwen_embed.onednn import PackedWeight

from bench_peers import REPO

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
FIXED = 256


PANEL = 64  # channels per packed panel of the probe's weights
BRGEMM_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <cstring>

// x [m, k] bf16 times weights packed [n / 64][k / 2][64][2] bf16 -> [m, n] bf16.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1), row_blocks = (m + 31) / 32;
  at::Tensor out = at::empty({m, n}, x.options());
  auto a = reinterpret_cast<const at::BFloat16*>(x.data_ptr());
  auto b = reinterpret_cast<const at::BFloat16*>(packed.data_ptr());
  auto o = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, row_blocks * (n / 64), 1, [&](int64_t begin, int64_t end) {
    float sums[32 * 64];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row = t % row_blocks * 32, col = t / row_blocks * 64;
      const int64_t rows = std::min<int64_t>(32, m - row);
      at::native::cpublas::brgemm(rows, 64, k, k, 64, 64, false, a + row * k, b + col * k, sums);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < 64; ++j) {  // fp32 -> bf16, round to nearest even
          uint32_t u;
          std::memcpy(&u, &sums[r * 64 + j], 4);
          o[(row + r) * n + col + j] = uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
        }
    }
    at::native::cpublas::brgemm_release();
  });
  return out;
}
"""


@functools.cache
def brgemm_module():
    from torch.utils.cpp_extension import load_inline

    build = REPO / ".cache" / "torch_extensions" / "gemm_rows_brgemm"
    build.mkdir(parents=True, exist_ok=True)
    return load_inline(
        "gemm_rows_brgemm",
        BRGEMM_SOURCE,
        functions=["linear"],
        # at::parallel_for is OpenMP code compiled into the extension: without -fopenmp, one thread
        extra_cflags=["-O3", "-mavx2", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
    )


class BrgemmWeight:
    """A bf16 weight packed once for the brgemm probe; calls run `linear` above."""

    def __init__(self, weight: torch.Tensor):
        n, k = weight.shape
        self.n = n
        self.packed = weight.view(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return brgemm_module().linear(x, self.packed, self.n)


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
    if dtype == torch.bfloat16:
        probe = BrgemmWeight(weight)
        whole = probe(x)
        exact = x.float() @ weight.float().T
        brgemm = {
            "brgemm_counts_differing": sum(
                not torch.equal(probe(x[:m]), whole[:m]) for m in counts
            ),
            # against the fp32 product, beside the packed GEMM's: the probe computes the same
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
            "bf16 on the brgemm micro-kernel (whole K per call), against the packed GEMM:",
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
