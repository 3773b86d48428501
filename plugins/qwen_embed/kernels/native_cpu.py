"""The row-wise operations on the native CPU kernels (native/: one pass over memory each, fp32
arithmetic, rounded once); what they do not take (fp16, mixed dtypes) runs in torch's ops."""

from __future__ import annotations

import torch

from .. import gated_delta, native
from . import reference

NAME = "native"


def _norm_weight(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernels take this norm weight: of x's dtype, or fp32 with bf16 x."""
    fp32_weight = x.dtype == torch.bfloat16 and weight.dtype == torch.float32
    return native.handles(x, None if fp32_weight else weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _norm_weight(x, weight):
        return torch.ops.qwen_embed.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # one pass: the sum rounded once, as torch's add rounds it, so the same bits either way
    same_rows = x.shape == residual.shape and x.is_contiguous() and residual.is_contiguous()
    if same_rows and native.handles(x, residual) and _norm_weight(x, weight):
        return torch.ops.qwen_embed.add_rms_norm(x, residual, weight, eps), x
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
    # fp32 tables (the vision tower's) rotate bf16 rows without a norm
    fp32_tables = x.dtype == torch.bfloat16 and cos.dtype == torch.float32 and weight is None
    if native.handles(x, weight) and (fp32_tables or native.handles(x, cos)):
        return torch.ops.qwen_embed.rope(
            x, cos, sin, head_dim, weight, 0.0 if weight is None else eps
        )
    return reference.norm_rotary(x, cos, sin, head_dim, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if native.handles(gate_up):
        return torch.ops.qwen_embed.silu_mul(gate_up)
    return reference.silu_mul(gate_up)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    if native.handles(x):
        return torch.ops.qwen_embed.gelu_tanh(x)
    return reference.gelu_tanh(x)


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    if native.handles(x):
        return torch.ops.qwen_embed.causal_conv_silu(x, weight, position)
    return reference.causal_conv_silu(x, weight, position)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    plan: gated_delta.SequencePlan,
    states: torch.Tensor | None = None,
    exports: torch.Tensor | None = None,
) -> torch.Tensor:
    # a recurrence over rows, a head's state block in L1 at a time: no chunks, no solves
    if native.handles(v, q, k):
        scale = q.shape[-1] ** -0.5
        return torch.ops.qwen_embed.gated_delta_rule(
            q,
            k,
            v,
            g.float(),
            beta.float(),
            plan.cu_seqlens,
            states,
            plan.cut_rows,
            exports,
            scale,
            gated_delta.L2_EPS,
        )
    return reference.gated_delta_rule(q, k, v, g, beta, plan, states, exports)


# fp8 codes on CPU are for checking the fp8 route (fp8.py), not for speed: torch's ops.
quantize_fp8 = reference.quantize_fp8
