"""The fp32 GEMM of CPUs with AVX2 and no AVX-512: our native operator
(native/csrc/gemm/floats_avx2.cpp) on weights packed once at load.

There oneDNN's GEMM on packed weights loses to MKL's plain F.linear on documents and MKL's
packs the weights on every call, which costs it the short queries; the native operator keeps
both wins. Each output is one chain of multiply-adds in input order, so a row's result is the
same at any row count without padding rows (onednn.PackedWeight pads to planned counts).
A layer whose weights are all bf16 values (a 16-bit checkpoint's, served in fp32) keeps them in
bf16, widened exactly as the operator loads them: the same products, half the memory and half
the bytes each forward reads. Measurements: docs/tuning.md.
"""

from __future__ import annotations

import torch
from torch import nn

from . import native

PANEL = 16  # channels per packed panel (gemm.h kFloatPanel): two AVX2 vectors


def runs() -> bool:
    """The operator runs here: the native build is loaded and the CPU has AVX2 and FMA."""
    return native.isa() is not None and torch.ops.qwen_embed.avx2_supported()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """Weights [n, k] as the operator reads them, [n_pad / 16, k, 16]: in bf16 where every
    value is one (each depth's channels in the order 0, 8, 1, 9, ..., 7, 15: gemm.h), else fp32."""
    held = weight.to(torch.bfloat16)
    if weight.dtype != torch.bfloat16 and not torch.equal(held.float(), weight.float()):
        return native.pack_panels(weight.float(), 1, PANEL).squeeze(-1)
    panels = native.pack_panels(held, 1, PANEL).squeeze(-1)  # [n_pad / 16, k, 16]
    halves = panels.unflatten(-1, (2, PANEL // 2)).transpose(-1, -2)
    return halves.flatten(-2).contiguous()


class Avx2F32Weight(nn.Module):
    """A linear layer's weight packed for the operator (`pack`); `forward(x, bias)` is
    `F.linear` in fp32 (16-bit activations, of fp32-held 16-bit weights, widened and rounded
    back, as layers.linear does)."""

    # 16-bit weights go to `pack` as they are (bf16 values stay in bf16): nothing to widen first
    takes_16_bit_weights = True

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.dtype = torch.float32
        self.out_features = weight.shape[0]
        # A plain attribute, as the other packed weights: out of state_dict and .to().
        self.packed = pack(weight.detach())

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        bias = None if bias is None else bias.float()
        out = torch.ops.qwen_embed.f32_linear(x.float(), self.packed, bias, self.out_features)
        return out.to(x.dtype)
