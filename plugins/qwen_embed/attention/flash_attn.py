"""flash-attn 2 varlen kernel (GPU only, imported lazily)."""

from __future__ import annotations

import torch

from ..segments import AttentionLayout
from .base import AttentionBackend, AttentionSpec, import_gpu_kernel


class FlashAttention(AttentionBackend):
    def __init__(self, spec: AttentionSpec):
        flash_attn = import_gpu_kernel(spec, "flash_attn", "flash_attn", "flash-attn")
        super().__init__(spec)
        self._kernel = flash_attn.flash_attn_varlen_func

    def prepare(self, layout: AttentionLayout) -> None:
        pass  # the kernel reads the layout's device cu_seqlens directly

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout
    ) -> torch.Tensor:
        # GQA is native: k/v keep num_kv_heads. flash-attn >= 2.1 aligns the causal mask
        # bottom-right when a segment has fewer queries than keys (a shared prefix's keys first).
        return self._kernel(
            q,
            k,
            v,
            cu_seqlens_q=layout.cu_q,
            cu_seqlens_k=layout.cu_k,
            max_seqlen_q=layout.max_q,
            max_seqlen_k=layout.max_k,
            softmax_scale=self.spec.scale,
            causal=self.spec.causal,
        )
