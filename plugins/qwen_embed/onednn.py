"""Linear weights packed for oneDNN once at load: the CPU float route's GEMM.

F.linear on CPU hands oneDNN a plain [out, in] weight, which it reorders into its blocked
layout on every call; with oneDNN's primitive cache off (the launcher's setting: with plain
weights the cache grew by megabytes per new token count) it also plans the GEMM anew each
call. Packing once at load is what Inductor's CPU freezing pass does for dynamic batch sizes
(mkldnn._reorder_linear_weight, mkldnn._linear_pointwise) and what vLLM's CPU backend does
with its own oneDNN wrappers. Same arithmetic: bf16 results bit-identical to F.linear, fp32
within rounding. Measured on a Zen 4 (2 cores, demo model, A/B in one process): route.py.
"""

from __future__ import annotations

import torch
from torch import nn


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
        out = torch.ops.mkldnn._linear_pointwise(x2, self.packed, bias, "none", [], "")
        return out.view(*shape[:-1], self.out_features)
