"""The int8 linear route: weights per output channel at load, activations per token at run time.

`x @ W.T` becomes `(xs * ws) * (q(x) @ q(W).T)`, with q() symmetric int8 and the product
accumulated in int32 by `torch._int_mm` (oneDNN's VNNI/AMX int8 GEMM on x86). The quantisation
before and the rescale after are elementwise passes over activation-sized tensors that cost as
much as the int8 GEMM saves when run as separate eager ops, so both are compiled (compiled.py:
Inductor fuses each into one loop; eager where compiling fails, still exact, only slower).
Embeddings, norms, attention, pooling and the MLP's down projection stay in floats: the down
projection's input, silu(gate) * up, has the heaviest-tailed tokens of any linear input, so
per-token int8 loses the most there (docs/tuning.md).
"""

from __future__ import annotations

import torch
from torch import nn

from .compiled import CompiledSet

_QMAX = 127.0
FLOAT_LAYERS = ("mlp.down_proj",)  # module names (endings) the int8 route keeps in floats


def quantizes(module_name: str) -> bool:
    return not module_name.endswith(FLOAT_LAYERS)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q int8 [rows, k], scale fp32 [rows, 1]) with x ~= q * scale."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / _QMAX
    return torch.round(x.float() / scale).clamp(-_QMAX, _QMAX).to(torch.int8), scale


def _rescale(
    acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    return (acc.float() * x_scale * w_scale).to(dtype)


def _warmup() -> None:
    weight, w_scale = torch.ones(8, 16, dtype=torch.int8), torch.ones(1, 8)
    for rows in (2, 1):  # 1 row is specialised separately by dynamic shapes
        for dtype in (torch.float32, torch.bfloat16):
            q, s = KERNELS.quantize(torch.ones(rows, 16, dtype=dtype))
            KERNELS.rescale(torch._int_mm(q, weight.t()), s, w_scale, dtype)


KERNELS = CompiledSet("int8 route", {"quantize": quantize_rows, "rescale": _rescale}, _warmup)


class Int8Weight(nn.Module):
    """A linear layer's weight as int8 [out, in] plus one fp32 scale per output channel."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        q, scale = quantize_rows(weight.detach())
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale.view(1, -1))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, x_scale = KERNELS.quantize(x2)
        out = KERNELS.rescale(torch._int_mm(xq, self.qweight.t()), x_scale, self.scale, x.dtype)
        if bias is not None:
            out.add_(bias.to(out.dtype))
        return out.view(*shape[:-1], out.shape[-1])
