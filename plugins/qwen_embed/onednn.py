"""Linear weights packed for oneDNN once at load: the CPU float route's GEMM.

F.linear on CPU hands oneDNN a plain [out, in] weight, which it reorders into its blocked
layout on every call. Packing once at load is what Inductor's CPU freezing pass does for
dynamic batch sizes (mkldnn._reorder_linear_weight, mkldnn._linear_pointwise) and what vLLM's
CPU backend does with its own oneDNN wrappers. Same arithmetic: bf16 results bit-identical to
F.linear, fp32 within rounding. Measured on a Zen 4 (2 cores, demo model, A/B in one
process): route.py.

oneDNN also plans each GEMM for its row count and keeps the plan in its primitive cache
(~0.45 ms to plan one of the demo model's GEMMs on a Zen 4, ~0.3 MB kept per plan). Varlen
batches bring a new row count nearly every forward, so small batches paid the planning on
every GEMM (a 1-query forward 18 ms instead of 12) and the cache filled with one-off plans.
Row counts from 17 to 512 are therefore padded up to a multiple of 16 (at most 15 rows of
extra work; above 512 rows planning is < 1% of the GEMM), and the launcher bounds the cache
(PRIMITIVE_CACHE_CAPACITY) instead of turning it off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

# The launcher's oneDNN primitive cache size (set before tritonserver starts: oneDNN reads it
# once): room for the padded row counts' plans of every GEMM shape, and a bound on memory.
PRIMITIVE_CACHE_CAPACITY = 256
ROW_STEP, PADDED_ROWS_MAX = 16, 512
# Padding buys nothing where a deployment turned the cache off.
PAD_ROWS = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") != "0"


def planned_rows(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs with: few distinct counts, so oneDNN's cached
    plans are reused; below ROW_STEP rows there are few counts anyway, and padding them would
    cost the most in proportion."""
    if PAD_ROWS and ROW_STEP < rows <= PADDED_ROWS_MAX:
        return -(-rows // ROW_STEP) * ROW_STEP
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
