"""The row-wise operations in torch's ops: the numerical reference of the other tables, and what
runs where no other table does (fp16 on CPU, GPUs without Triton).

The arithmetic is transformers': RMSNorm normalises in fp32, rounds to the model dtype, then
scales by the weight in the model dtype (an fp32 weight with 16-bit rows, Qwen3.5's 1 + weight,
scales in fp32, rounded once); residual sums round to the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import gated_delta

NAME = "torch"
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In-place steps and a reduction instead of x.pow(2): fewer activation-sized tensors.
    dtype = x.dtype
    out = x.to(torch.float32, copy=True)
    mean_sq = torch.linalg.vector_norm(out, dim=-1, keepdim=True).square_().div_(x.shape[-1])
    out.mul_(mean_sq.add_(eps).rsqrt_())
    if weight.dtype != dtype:
        return out.mul_(weight).to(dtype)
    return out.to(dtype).mul_(weight)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the sum is written over x, a sublayer's fresh
    output that the caller hands over."""
    summed = x.add_(residual)
    return rms_norm(summed, weight, eps), summed


def norm_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    weight: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """Heads of x [T, heads * head_dim] (rows may be strided), each RMS-normalised with
    `weight` when given (Qwen3's q/k norm), then rotated by cos/sin [T, head_dim // 2]: a
    contiguous [T, heads, head_dim]; with fp32 tables and 16-bit x the rotation is in fp32,
    rounded once (transformers' vision attention)."""
    heads = x.reshape(x.shape[0], x.shape[1] // head_dim, head_dim)
    if weight is not None:
        heads = rms_norm(heads, weight, eps)
    if cos.dtype != heads.dtype:
        return rotary(heads.to(cos.dtype), cos, sin).to(heads.dtype)
    return rotary(heads, cos, sin)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of x [T, heads, head_dim] by cos/sin [T, head_dim // 2]: the same
    arithmetic as transformers' `x * cos + rotate_half(x) * sin` on the duplicated tables, in
    fewer passes over memory."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    out = torch.empty_like(x)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, c, out=o1).addcmul_(x2, s, value=-1)
    torch.mul(x2, c, out=o2).addcmul_(x1, s)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the packed [T, 2 * inter] projection."""
    gate, up = gate_up.chunk(2, dim=-1)  # in place in the gate half
    return F.silu(gate, inplace=True).mul_(up)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """silu of the causal depthwise convolution of x [T, channels] (rows may be strided) by
    weight [channels, K] (taken in fp32) within each sequence, `position` [T] (int64) each
    row's place in its sequence (zeros before its first row): Qwen3.5's linear attention's;
    summed in fp32 in order of the taps reaching back, rounded once, silu rounded once."""
    kernel = weight.shape[1]
    w = weight.float()
    out = x.float() * w[:, kernel - 1]
    for shift in range(1, kernel):
        if shift >= x.shape[0]:
            break
        seen = (position[shift:] >= shift).unsqueeze(1)
        past = x[:-shift].float() * w[:, kernel - 1 - shift]
        out[shift:] += past * seen
    return F.silu(out.to(x.dtype))


# Qwen3.5's linear attention in chunks of matrix products (what a GPU runs fast)
gated_delta_rule = gated_delta.gated_delta_rule


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [T, k] as float8_e4m3fn codes and one fp32 scale per row [T, 1], x ~= codes *
    scale: each row's largest magnitude becomes 448, the codes rounded to nearest even. Every
    step is one IEEE fp32 operation (448 / amax divided, not a reciprocal multiplied), so that
    kernels can give the same codes."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min_(1e-12)
    codes = x.to(torch.float32, copy=True).mul_(torch.full_like(amax, FP8_MAX).div_(amax))
    return codes.clamp_(-FP8_MAX, FP8_MAX).to(FP8), amax.div_(FP8_MAX)
