"""flash-attn 2 varlen kernel (GPU only, imported lazily)."""

from __future__ import annotations

import torch

from ..batch import VarlenBatch
from .base import AttentionBackend, AttentionSpec, import_gpu_kernel


class FlashAttention(AttentionBackend):
    def __init__(self, spec: AttentionSpec):
        flash_attn = import_gpu_kernel(spec, "flash_attn", "flash_attn", "flash-attn")
        super().__init__(spec)
        self._kernel = flash_attn.flash_attn_varlen_func

    def prepare(self, batch: VarlenBatch) -> None:
        self._cu_seqlens = batch.cu_seqlens
        self._max_seqlen = batch.max_seqlen

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # GQA is native: k/v keep num_kv_heads.
        return self._kernel(
            q,
            k,
            v,
            cu_seqlens_q=self._cu_seqlens,
            cu_seqlens_k=self._cu_seqlens,
            max_seqlen_q=self._max_seqlen,
            max_seqlen_k=self._max_seqlen,
            softmax_scale=self.spec.scale,
            causal=self.spec.causal,
        )
