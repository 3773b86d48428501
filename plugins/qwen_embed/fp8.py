"""The fp8 linear route: float8_e4m3fn weights per output channel at load, activations per
token at run time, one scaled GEMM per layer.

`x @ W.T` becomes `(xs * ws) * (q(x) @ q(W).T)`, each q() scaled so that its row's largest
magnitude is 448 (e4m3's largest finite value) and rounded to nearest even, the product
accumulated in fp32 and written in bf16 by `torch._scaled_mm`: cuBLASLt on GPUs with fp8
tensor cores (compute capability 8.9 and later: Ada, Hopper, Blackwell: twice bf16's peak
rate there), in half the weight memory of bf16 layers; torch's own fp8 GEMM on
CPU, slower than the float routes, where the route runs so that its logic is checked (int8.py
is the CPU's quantised route). The activations' codes come from the route's row-op table
(kernels/: one Triton pass per row on CUDA). Scales are per row and per channel, so a text's
vector does not depend on its batch any more than the GEMM's sums do.

The text model's linear layers take it but for those the int8 route keeps in floats, the
attention's values and output projection (int8.quantizes): they lose the most to fp8 too
(docs/tuning.md). Those, embeddings, norms, attention, pooling and a vision tower stay in bf16
(engine._convert_linears).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .kernels import RowOps, reference

ALIGN = 16  # _scaled_mm's input width and output channels on CUDA: multiples of this
WEIGHT_ROWS_AT_ONCE = 4096  # output channels quantised together at load (fp32 temporaries)


@functools.cache
def gpu_runs(device: str) -> bool:
    """Whether `device`, a CUDA device, has fp8 tensor cores and this torch multiplies on them
    with a scale per row and per channel (tried once on a 16 x 16 product)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    codes = torch.ones(16, 16, device=device).to(reference.FP8)
    scale = torch.ones(16, 1, device=device)
    try:
        torch._scaled_mm(
            codes, codes.t(), scale_a=scale, scale_b=scale.t(), out_dtype=torch.bfloat16
        )
    except RuntimeError:
        return False
    return True


def weight_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [n, k] as e4m3 codes [n, k] and fp32 scales [1, n], a block of channels at a
    time (each channel is quantised alone)."""
    parts = [reference.quantize_fp8(rows) for rows in weight.detach().split(WEIGHT_ROWS_AT_ONCE)]
    return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts]).view(1, -1)


class Fp8Weight(nn.Module):
    """A linear layer's weight as e4m3 codes [out, in] with one fp32 scale per output channel;
    its input rows quantised per row by the route's table (`ops.quantize_fp8`)."""

    def __init__(self, weight: torch.Tensor, ops: RowOps = reference):
        super().__init__()
        out_features, in_features = weight.shape
        if out_features % ALIGN or in_features % ALIGN:
            raise ValueError(
                f"quantization 'fp8' needs linear layers whose widths are multiples of {ALIGN}: "
                f"this one is {in_features} -> {out_features}"
            )
        codes, scale = weight_codes(weight)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.ops = ops

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape, out_features = x.shape, self.codes.shape[0]
        rows = x.reshape(-1, shape[-1])
        if rows.shape[0]:
            codes, scale = self.ops.quantize_fp8(rows)
            out = torch._scaled_mm(
                codes, self.codes.t(), scale_a=scale, scale_b=self.scale, out_dtype=x.dtype
            )
        else:
            out = rows.new_empty(0, out_features)
        if bias is not None:
            out.add_(bias.to(out.dtype))
        return out.view(*shape[:-1], out_features)
