"""flash-attn 2/3 varlen kernel (GPU only, imported lazily)."""

from __future__ import annotations

import torch

from ..batch import VarlenBatch
from .base import AttentionBackend, AttentionSpec


def _import_kernel():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:
        raise RuntimeError(
            "attention backend 'flash_attn' needs the flash-attn package and a CUDA GPU "
            "(pip install '.[gpu]'); use attn_backend='torch' elsewhere"
        ) from e
    return flash_attn_varlen_func


class FlashAttention(AttentionBackend):
    def __init__(self, spec: AttentionSpec):
        if spec.device.type != "cuda":
            raise RuntimeError("attention backend 'flash_attn' runs only on CUDA devices")
        if spec.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("attention backend 'flash_attn' needs dtype float16 or bfloat16")
        super().__init__(spec)
        self._kernel = _import_kernel()

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
