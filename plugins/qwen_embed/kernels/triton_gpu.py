"""The row-wise operations as Triton-language kernels, for CUDA tensors: each one pass over
memory with fp32 arithmetic in registers, where torch's ops take several kernels and fp32
round trips through memory. The residual add is fused into the RMSNorm that follows it, and
the q/k norm into the rotary embedding, which reads its heads in place in the q|k|v rows.

The same rounding points as transformers (reference.py): a residual sum rounds to the model
dtype before it is normalised; a normalised row rounds to the model dtype before the weight
scales it. Imported only where a route takes this table (CUDA with the `triton` package, which
PyPI's CUDA torch depends on), or by tests, which run the kernels on CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1 set before this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference

NAME = "triton"


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 x rounded to `dtype`, to nearest even: bf16 from the bits, as torch rounds (Triton's
    interpreter truncates a bf16 cast; the GPU's cast and this agree)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _rms_norm_rows(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    x_stride,
    residual_stride,
    out_stride,
    width,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_NORMED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x_row = x_ptr + row * x_stride + cols
    x = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        summed = _round(x + r.to(tl.float32), x_ptr.dtype.element_ty)
        tl.store(x_row, summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / width + eps)
    dtype = out_ptr.dtype.element_ty
    normed = x * inv_rms
    if ROUND_NORMED:  # a weight of the rows' dtype scales the rounded value (an fp32 one: not)
        normed = _round(normed, dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, _round(normed * w, dtype), mask=mask)


@triton.jit
def _norm_rotary_heads(
    x_ptr,
    cos_ptr,
    sin_ptr,
    weight_ptr,
    out_ptr,
    x_stride,
    cos_stride,
    sin_stride,
    heads,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """One token's heads: each half of a head is a [heads, half] tile."""
    token = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, HEADS_BLOCK)[:, None]
    c = tl.arange(0, HALF_BLOCK)[None, :]
    mask = (h < heads) & (c < half)
    src = x_ptr + token * x_stride + h * HEAD_DIM + c
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if HAS_NORM:
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
        w1 = tl.load(weight_ptr + c, mask=c < half, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + half + c, mask=c < half, other=0.0).to(tl.float32)
        x1 = _round(_round(x1 * inv_rms[:, None], dtype).to(tl.float32) * w1, dtype)
        x2 = _round(_round(x2 * inv_rms[:, None], dtype).to(tl.float32) * w2, dtype)
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    cos = tl.load(cos_ptr + token * cos_stride + c, mask=c < half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * sin_stride + c, mask=c < half, other=0.0).to(tl.float32)
    dst = out_ptr + token * heads * HEAD_DIM + h * HEAD_DIM + c
    tl.store(dst, _round(x1 * cos - x2 * sin, dtype), mask=mask)
    tl.store(dst + half, _round(x2 * cos + x1 * sin, dtype), mask=mask)


@triton.jit
def _silu_mul_rows(gate_up_ptr, out_ptr, gate_up_stride, out_stride, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * gate_up_stride + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * gate_up_stride + width + cols, mask=mask, other=0.0)
    gate = gate.to(tl.float32)
    out = gate * tl.sigmoid(gate) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, _round(out, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_silu_rows(
    x_ptr,
    taps_ptr,
    position_ptr,
    out_ptr,
    x_stride,
    width,
    KERNEL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row's block of channels: the taps reaching back within its sequence, summed in fp32
    in order, rounded, silu rounded (reference.causal_conv_silu)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    position = tl.load(position_ptr + row)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    total = x * tl.load(taps_ptr + (KERNEL - 1) * width + cols, mask=mask, other=0.0)
    for shift in tl.static_range(1, KERNEL):
        seen = mask & (tl.full([BLOCK], shift, tl.int64) <= position)
        past = tl.load(x_ptr + (row - shift) * x_stride + cols, mask=seen, other=0.0)
        tap = tl.load(taps_ptr + (KERNEL - 1 - shift) * width + cols, mask=mask, other=0.0)
        total += past.to(tl.float32) * tap
    dtype = out_ptr.dtype.element_ty
    rounded = _round(total, dtype).to(tl.float32)
    out = rounded * tl.sigmoid(rounded)
    tl.store(out_ptr + row * width + cols, _round(out, dtype), mask=mask)


@triton.jit
def _round_e4m3(x):
    """fp32 x (|x| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, still in
    fp32, so that any cast then is exact (Triton's interpreter truncates): normal values keep
    3 mantissa bits; below 2**-6 the steps are 2**-9, which adding and taking away 1.5 * 2**14
    rounds to."""
    bits = x.to(tl.uint32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    small = ((tl.abs(x) + 24576.0) - 24576.0).to(tl.uint32, bitcast=True)
    small = small | (bits & 0x80000000)  # the sign, a zero's too
    return tl.where(tl.abs(x) < 0.015625, small, normal).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_rows(x_ptr, codes_ptr, scale_ptr, x_stride, width, BLOCK: tl.constexpr):
    """One row: its largest magnitude, then its codes (reference.quantize_fp8's steps)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < width, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    largest = tl.maximum(tl.max(amax, axis=0), 1e-12)
    inverse = tl.math.div_rn(448.0, largest)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < width
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        codes = _round_e4m3(tl.clamp(x * inverse, -448.0, 448.0))
        tl.store(codes_ptr + row * width + cols, codes.to(codes_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, tl.math.div_rn(largest, 448.0))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as 2-D rows with contiguous values (a view where it can be)."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def _norm(x, residual, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if not rows.shape[0]:
        return out.view(x.shape)
    block = triton.next_power_of_2(rows.shape[1])
    _rms_norm_rows[(rows.shape[0],)](
        rows,
        rows if residual is None else residual,
        weight,
        out,
        rows.stride(0),
        0 if residual is None else residual.stride(0),
        out.stride(0),
        rows.shape[1],
        eps,
        HAS_RESIDUAL=residual is not None,
        ROUND_NORMED=weight.dtype == x.dtype,
        BLOCK=block,
        num_warps=_warps(block),
    )
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or x.stride(-1) != 1 or residual.stride(-1) != 1:
        return reference.add_rms_norm(x, residual, weight, eps)
    return _norm(x, residual, weight, eps), x


def norm_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    weight: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    if head_dim % 2 or x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        return reference.norm_rotary(x, cos, sin, head_dim, weight, eps)
    tokens, heads = x.shape[0], x.shape[1] // head_dim
    out = torch.empty(tokens, heads, head_dim, dtype=x.dtype, device=x.device)
    if tokens:
        _norm_rotary_heads[(tokens,)](
            x,
            cos,
            sin,
            x if weight is None else weight,
            out,
            x.stride(0),
            cos.stride(0),
            sin.stride(0),
            heads,
            eps,
            HEAD_DIM=head_dim,
            HALF_BLOCK=triton.next_power_of_2(head_dim // 2),
            HEADS_BLOCK=triton.next_power_of_2(heads),
            HAS_NORM=weight is not None,
        )
    return out


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows = _rows(gate_up)
    width = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(width, SILU_BLOCK))
        _silu_mul_rows[grid](rows, out, rows.stride(0), out.stride(0), width, BLOCK=SILU_BLOCK)
    return out.view(*gate_up.shape[:-1], width)


# torch's CUDA GELU is already one pass over memory, with fp32 arithmetic in registers.
gelu_tanh = reference.gelu_tanh


CONV_BLOCK = 1024


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    rows = _rows(x)
    width = rows.shape[1]
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    taps = weight.float().t().contiguous()  # [K, channels]: each tap's channels in a row
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(width, CONV_BLOCK))
        _conv_silu_rows[grid](
            rows, taps, position, out, rows.stride(0), width, KERNEL=taps.shape[0], BLOCK=CONV_BLOCK
        )
    return out


gated_delta_rule = reference.gated_delta_rule

FP8_BLOCK = 2048  # values of a row per step: a 1,024-wide row in one


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = _rows(x)
    codes = torch.empty(rows.shape, dtype=reference.FP8, device=x.device)
    scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        block = min(FP8_BLOCK, triton.next_power_of_2(rows.shape[1]))
        _fp8_rows[(rows.shape[0],)](
            rows, codes, scale, rows.stride(0), rows.shape[1], BLOCK=block, num_warps=_warps(block)
        )
    return codes, scale
