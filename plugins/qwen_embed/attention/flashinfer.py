"""flashinfer ragged prefill (GPU only, imported lazily); planned once per batch."""

from __future__ import annotations

import torch

from ..segments import AttentionLayout
from .base import AttentionBackend, AttentionSpec, import_gpu_kernel
from .flashinfer_limits import FLASHINFER_HEAD_DIMS, flashinfer_problem

_WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttention(AttentionBackend):
    def __init__(self, spec: AttentionSpec):
        if spec.head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(
                f"attention backend 'flashinfer' has kernels for head sizes "
                f"{FLASHINFER_HEAD_DIMS}, not {spec.head_dim}; use flash_attn or torch"
            )
        flashinfer = import_gpu_kernel(spec, "flashinfer", "flashinfer", "flashinfer-python")
        # flashinfer >= 0.2.7 has no has_prebuilt_ops (kernels come from its cubin packages).
        prebuilt = getattr(getattr(flashinfer, "jit", None), "has_prebuilt_ops", None)
        problem = flashinfer_problem(flashinfer.__version__, prebuilt)
        if problem:
            raise RuntimeError(f"attention backend 'flashinfer': {problem}")
        super().__init__(spec)
        # A forward plans up to two layouts (all rows; the last layer's pooled rows): one
        # wrapper each, used in turn.
        self._wrappers = [
            flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=spec.device), "NHD"
            )
            for _ in range(2)
        ]
        self._next = 0

    def prepare(self, layout: AttentionLayout) -> None:
        wrapper = self._wrappers[self._next]
        self._next = 1 - self._next
        # Separate query and key indptrs (a segment may attend to a shared prefix first; causal
        # masks align bottom-right). Host tensors: plan() would copy device ones back.
        wrapper.plan(
            layout.cu_q_host,
            layout.cu_k_host,
            self.spec.num_heads,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            causal=self.spec.causal,
            sm_scale=self.spec.scale,
            q_data_type=self.spec.dtype,
        )
        layout.state["flashinfer"] = wrapper

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout
    ) -> torch.Tensor:
        return layout.state["flashinfer"].run(q, k, v.contiguous())
