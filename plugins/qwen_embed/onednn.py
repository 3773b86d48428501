"""Linear weights packed for oneDNN once at load: the CPU float route's GEMM.

F.linear on CPU hands oneDNN a plain [out, in] weight, which it reorders into its blocked
layout on every call. Packing once at load is what Inductor's CPU freezing pass does for
dynamic batch sizes (mkldnn._reorder_linear_weight, mkldnn._linear_pointwise) and what vLLM's
CPU backend does with its own oneDNN wrappers. Same arithmetic: bf16 results bit-identical to
F.linear, fp32 within rounding.

oneDNN also plans each GEMM for its row count and keeps the plan in its primitive cache.
Varlen batches bring a new row count nearly every forward, so small forwards would pay the
planning on every GEMM and fill the cache with one-off plans. Row counts from 17 to 512 are
therefore padded up to a few planned counts (planned_rows; above 512 rows planning is a small
share of the GEMM), and the launcher bounds the cache (PRIMITIVE_CACHE_CAPACITY). A row's
result does not depend on the padding. A single row runs as two: oneDNN's one-row fp32 path
sums in another order than its GEMM, so a text alone would get other numbers than in a batch.
Measurements: docs/tuning.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import native

# Row counts up to UNPADDED_ROWS run as they are (few counts anyway); above, up to each limit,
# they are padded to a multiple of its step: steps grow with the count so that the padding
# stays a small share of the rows, since a GEMM's time grows with its rows.
UNPADDED_ROWS = 16
ROW_STEPS = ((32, 2), (64, 4), (256, 8), (512, 16))  # (up to rows, step)
PADDED_ROWS_MAX = ROW_STEPS[-1][0]
# The launcher's oneDNN primitive cache size (set before tritonserver starts: oneDNN reads it
# once): room for the planned counts' plans of every GEMM shape of a Qwen model with last-layer
# pruning (q|k|v, o, gate|up, down, q, k|v), and a bound on memory.
PRIMITIVE_CACHE_CAPACITY = 512


def planned_rows(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs with: few distinct counts, so oneDNN's cached
    plans are reused, each close above the real count; never one row."""
    if rows == 1:
        return 2
    if UNPADDED_ROWS < rows <= PADDED_ROWS_MAX:
        step = next(step for limit, step in ROW_STEPS if rows <= limit)
        return -(-rows // step) * step
    return rows


def available() -> bool:
    """This torch build has oneDNN (x86 and most ARM wheels do)."""
    return torch.backends.mkldnn.is_available()


class PackedWeight(nn.Module):
    """A linear layer's weight in oneDNN's layout; `forward(x, bias)` is `F.linear`."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.dtype = weight.dtype
        self.out_features = weight.shape[0]
        # An opaque oneDNN tensor: kept as a plain attribute, out of state_dict and .to().
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != self.dtype:  # bf16 activations, fp32-held bf16 weights (layers.linear)
            return self.forward(x2.to(self.dtype), bias).to(x.dtype).view(*shape[:-1], -1)
        rows = x2.shape[0]
        if (padded := planned_rows(rows)) != rows:
            x2 = F.pad(x2, (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise(x2, self.packed, bias, "none", [], "")
        return out[:rows].view(*shape[:-1], self.out_features)


def brgemm_runs() -> bool:
    """The native bf16 operator runs here (built, AVX-512, torch's oneDNN)."""
    return native.isa() is not None and torch.ops.qwen_embed.bf16_supported()


class BrgemmWeight(nn.Module):
    """A bf16 linear weight for the batch-invariant route (settings.batch_invariant): the native
    operator on oneDNN's brgemm micro-kernel (AMX tiles where the CPU has them) takes the whole
    input width in one call per block of rows, so a row's result is the same at any row count,
    which oneDNN's own GEMM is not on AMX CPUs. Packed once, [n_pad / 64, k / 2, 64, 2]."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features = weight.shape[0]
        self.packed = native.pack_panels(weight.detach().to(torch.bfloat16), 2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        bias = None if bias is None else bias.float()
        return torch.ops.qwen_embed.bf16_linear(x, self.packed, bias, self.out_features)
