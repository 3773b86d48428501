"""flashinfer ragged prefill (GPU only, imported lazily); planned once per batch."""

from __future__ import annotations

import torch

from ..batch import VarlenBatch
from .base import AttentionBackend, AttentionSpec

_WORKSPACE_BYTES = 128 * 1024 * 1024


def _import_flashinfer():
    try:
        import flashinfer
    except ImportError as e:
        raise RuntimeError(
            "attention backend 'flashinfer' needs the flashinfer-python package and a CUDA GPU "
            "(pip install '.[gpu]'); use attn_backend='torch' elsewhere"
        ) from e
    return flashinfer


class FlashInferAttention(AttentionBackend):
    def __init__(self, spec: AttentionSpec):
        if spec.device.type != "cuda":
            raise RuntimeError("attention backend 'flashinfer' runs only on CUDA devices")
        if spec.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("attention backend 'flashinfer' needs dtype float16 or bfloat16")
        super().__init__(spec)
        flashinfer = _import_flashinfer()
        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=spec.device)
        self._wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")

    def prepare(self, batch: VarlenBatch) -> None:
        # Same indptr for queries and keys: every sequence attends only to itself.
        self._wrapper.plan(
            batch.cu_seqlens,
            batch.cu_seqlens,
            self.spec.num_heads,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            causal=self.spec.causal,
            sm_scale=self.spec.scale,
            q_data_type=self.spec.dtype,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._wrapper.run(q, k, v)
