"""flashinfer ragged prefill (GPU only, imported lazily); planned once per batch."""

from __future__ import annotations

import torch

from ..batch import VarlenBatch
from .base import AttentionBackend, AttentionSpec, import_gpu_kernel
from .flashinfer_limits import FLASHINFER_HEAD_DIMS

_WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttention(AttentionBackend):
    def __init__(self, spec: AttentionSpec):
        if spec.head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(
                f"attention backend 'flashinfer' has kernels for head sizes "
                f"{FLASHINFER_HEAD_DIMS}, not {spec.head_dim}; use flash_attn or torch"
            )
        flashinfer = import_gpu_kernel(spec, "flashinfer", "flashinfer", "flashinfer-python")
        super().__init__(spec)
        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=spec.device)
        self._wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")

    def prepare(self, batch: VarlenBatch) -> None:
        # Same indptr for queries and keys: every sequence attends only to itself. Host
        # tensors: plan() copies device ones back to the host (two syncs per batch).
        self._wrapper.plan(
            batch.cu_seqlens_host,
            batch.cu_seqlens_host,
            self.spec.num_heads,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            causal=self.spec.causal,
            sm_scale=self.spec.scale,
            q_data_type=self.spec.dtype,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._wrapper.run(q, k, v)
