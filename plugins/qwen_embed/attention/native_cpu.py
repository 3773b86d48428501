"""Native CPU attention (qwen_embed/native): every segment of the batch in one call per layer,
the same numbers for a text whatever shares its batch (csrc/attention.h). A head size without
kernels of its own (Qwen2-VL's and Qwen2.5-VL's vision towers: 80) runs on the next size's,
queries, keys and values padded with zeros: the scores are the same, the padded outputs zero
and dropped."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import native
from ..segments import AttentionLayout
from .base import AttentionBackend, AttentionSpec

HEAD_DIMS = (32, 64, 128, 256)


def kernel_head_dim(head_dim: int) -> int | None:
    """The head size whose kernels run `head_dim` (itself, or the next, padded: a size
    between the kernels' sizes); None: none."""
    if head_dim < HEAD_DIMS[0]:
        return None
    return next((d for d in HEAD_DIMS if d >= head_dim), None)


# Kernels measured faster than torch's SDPA (docs/tuning.md); `auto` leaves the others to torch.
AUTO_ISAS = ("amx", "avx512bf16", "avx512", "avx2")


def native_problem(device_type: str, dtype: str, head_dim: int, auto: bool = False) -> str | None:
    """Why the native operator cannot run this attention (or, with `auto`, why attn_backend
    "auto" does not choose it), or None."""
    if device_type != "cpu":
        return f"the native operator runs on CPU, not {device_type}"
    if dtype not in native.DTYPE_NAMES:
        return f"the native operator takes float32 or bfloat16, not {dtype}"
    if kernel_head_dim(head_dim) is None:
        return f"the native operator has no kernels for head size {head_dim} (32 to 256)"
    if native.isa() is None:
        return "the native kernels are not built (make setup builds them with a C++ compiler)"
    if auto and native.isa() not in AUTO_ISAS:
        return (
            f"the native {native.isa()} kernels are not measured faster than SDPA; "
            "attn_backend native runs them"
        )
    return None


class NativeAttention(AttentionBackend):
    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        dtype = str(spec.dtype).removeprefix("torch.")
        problem = native_problem(spec.device.type, dtype, spec.head_dim)
        if problem:
            raise RuntimeError(f"attention backend 'native' cannot run: {problem}")
        self.pad = kernel_head_dim(spec.head_dim) - spec.head_dim

    def prepare(self, layout: AttentionLayout) -> None:
        pass  # the operator reads the layout's host offsets directly

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout
    ) -> torch.Tensor:
        if self.pad:
            q, k, v = (F.pad(t, (0, self.pad)) for t in (q, k, v))
        out = torch.ops.qwen_embed.varlen_attention(
            q,
            k,
            v.contiguous(),
            layout.cu_q_host,
            layout.cu_k_host,
            self.spec.causal,
            self.spec.scale,
        )
        return out[..., : self.spec.head_dim] if self.pad else out
