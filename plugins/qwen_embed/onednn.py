"""Linear weights packed for oneDNN once at load: the CPU float route's GEMM.

F.linear on CPU hands oneDNN a plain [out, in] weight, which it reorders into its blocked
layout on every call. Packing once at load is what Inductor's CPU freezing pass does for
dynamic batch sizes (mkldnn._reorder_linear_weight, mkldnn._linear_pointwise) and what vLLM's
CPU backend does with its own oneDNN wrappers. Same arithmetic: bf16 results bit-identical to
F.linear, fp32 within rounding.

GEMMs run on planned row counts (row_plans.py): few counts, so oneDNN's cached plans repeat,
and never one row.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from . import native
from .row_plans import planned_rows


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


class NativeBf16Weight(nn.Module):
    """A bf16 linear weight for the batch-invariant route (settings.batch_invariant): the native
    operator (our AMX tile or AVX512_BF16 panel kernel, elsewhere oneDNN's brgemm) takes the whole
    input width in one call per block of rows, so a row's result is the same at any row count,
    which oneDNN's own GEMM is not on AMX CPUs. Packed once, [n_pad / panel, k / 2, panel, 2]
    (native.bf16_panel: 16 channels for the tile kernel, else 64)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.dtype = torch.bfloat16
        self.out_features = weight.shape[0]
        panel = native.bf16_panel(weight.shape[1])
        self.packed = native.pack_panels(weight.detach().to(torch.bfloat16), 2, panel)
        self.gates = native.gates(panel, self.out_features)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        bias = None if bias is None else bias.float()
        return torch.ops.qwen_embed.bf16_linear(x, self.packed, bias, self.out_features)

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a gate|up projection (forward's halves), in the GEMM's store
        where `gates`: the bits of the row ops' silu_mul on forward's output."""
        return torch.ops.qwen_embed.bf16_linear(x, self.packed, None, self.out_features, gated=True)

    def merged(self, a: torch.Tensor, b: torch.Tensor) -> NativeBf16Weight:
        """A copy with a low-rank pair merged: the weights plus b @ a, summed in fp32 and
        rounded once (as a fine-tune merged at load), added in the packed layout."""
        merged = copy.copy(self)
        merged.packed = torch.ops.qwen_embed.bf16_merge_pair(self.packed, a.float(), b.float())
        return merged
