"""The decoder layer's elementwise chains: RMSNorm, rotary embedding, SiLU gating.

Each has two versions with the same arithmetic up to rounding: the eager one, hand-ordered
in-place passes (few fresh activation-sized tensors: on CPU each costs page faults), and the
plain formula that Inductor compiles into one loop (compiled.py). The CPU route compiles them
at load (`ELEMENTWISE.ensure_compiled`, warmed up by tiny forwards in engine.py): bf16 embeds
5-7% faster on a Zen 4 (AVX512_BF16) in A/B runs within one process (make perf-fused), fp32
0-1%, where the GEMMs already take most of the time. A compiled call also pays ~60 us of
guard checks and wrappers, 22 calls per forward of a 3-layer model: small forwards run the
eager versions (COMPILED_MIN_ROWS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .compiled import CompiledSet


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers: normalise in fp32, scale in the model dtype. In-place steps and a
    # reduction instead of x.pow(2): each fresh tensor would cost page faults.
    dtype = x.dtype
    out = x.to(torch.float32, copy=True)
    mean_sq = torch.linalg.vector_norm(out, dim=-1, keepdim=True).square_().div_(x.shape[-1])
    out.mul_(mean_sq.add_(eps).rsqrt_())
    return out.to(dtype).mul_(weight)


def rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rotary_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 head_major: bool = False) -> torch.Tensor:  # fmt: skip
    """Neox-style rotation of x [T, heads, head_dim] by cos/sin [T, head_dim // 2].

    The same arithmetic as transformers' `x * cos + rotate_half(x) * sin` on the duplicated
    tables, in fewer passes over memory. `head_major`: the result is a [T, heads, head_dim]
    view of [heads, T, head_dim] storage (each head's rows dense), for kernels that read one
    head at a time; the layout change rides on this pass at no extra copy.
    """
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    if head_major:
        out = x.new_empty(x.shape[1], x.shape[0], x.shape[2]).transpose(0, 1)
    else:
        out = torch.empty_like(x)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, c, out=o1).addcmul_(x2, s, value=-1)
    torch.mul(x2, c, out=o2).addcmul_(x1, s)
    return out


def rotary_formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   head_major: bool = False) -> torch.Tensor:  # fmt: skip
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    # The layout change is written by the same loop.
    return out.transpose(0, 1).contiguous().transpose(0, 1) if head_major else out


def silu_mul_eager(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the packed [T, 2 * inter] projection, in place in its gate half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


def silu_mul_formula(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# Forwards of fewer computed rows run eager even where compiled. bf16 on a Zen 4, 4-layer
# model (perf/results/fused.md): eager 1.09x faster at 42 rows, 1.04x at 86-163, 1.01x at 323;
# compiled 1.01x faster at 646 and 1234 rows, 1.11x at 5033 (demo model, 1 query of ~19 rows
# by hand: eager 1.15x).
COMPILED_MIN_ROWS = 512

ELEMENTWISE = CompiledSet(
    "elementwise ops",
    {"rms_norm": rms_norm_formula, "rotary": rotary_formula, "silu_mul": silu_mul_formula},
    {"rms_norm": rms_norm_eager, "rotary": rotary_eager, "silu_mul": silu_mul_eager},
    on_by_default=False,  # only inside the forward of a model that chose it (QwenModel)
)
