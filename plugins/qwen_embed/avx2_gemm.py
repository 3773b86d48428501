"""The fp32 GEMM of CPUs with AVX2 and no AVX-512: our native operator
(native/csrc/gemm/floats_avx2.cpp) on weights packed once at load.

There oneDNN's GEMM on packed weights loses to MKL's plain F.linear on documents and MKL's
packs the weights on every call, which costs it the short queries; the native operator keeps
both wins. Each output is one chain of multiply-adds in input order, so a row's result is the
same at any row count without padding rows (onednn.PackedWeight pads to planned counts).
Measurements: docs/tuning.md.
"""

from __future__ import annotations

import torch
from torch import nn

from . import native

PANEL = 16  # channels per packed panel (gemm.h kFloatPanel): two AVX2 vectors


def runs() -> bool:
    """The operator runs here: the native build is loaded and the CPU has AVX2 and FMA."""
    return native.isa() is not None and torch.ops.qwen_embed.avx2_supported()


class Avx2F32Weight(nn.Module):
    """A linear layer's weight packed for the operator, [n_pad / 16, k, 16];
    `forward(x, bias)` is `F.linear` in fp32 (16-bit activations, of fp32-held 16-bit weights,
    widened and rounded back, as layers.linear does)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.dtype = torch.float32
        self.out_features = weight.shape[0]
        # A plain attribute, as the other packed weights: out of state_dict and .to().
        self.packed = native.pack_panels(weight.detach().float(), 1, PANEL).squeeze(-1)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        bias = None if bias is None else bias.float()
        out = torch.ops.qwen_embed.f32_linear(x.float(), self.packed, bias, self.out_features)
        return out.to(x.dtype)
