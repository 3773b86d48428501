"""Reference backend: PyTorch SDPA, one call per sequence; runs on CPU and GPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..batch import VarlenBatch
from .base import AttentionBackend


class TorchAttention(AttentionBackend):
    # PyTorch's CPU flash kernel walks one head at a time: with dense rows per head the bench
    # model ran 1.5-2.5% faster in bf16 (Zen 4) than on token-major [T, heads, dim] views.
    head_major = True

    def prepare(self, batch: VarlenBatch) -> None:
        bounds, start = [], 0
        for n in batch.seq_lens:
            bounds.append((start, start + n))
            start += n
        self._bounds = bounds

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        gqa = self.spec.num_heads != self.spec.num_kv_heads
        # Slices of the flat stream seen as [1, heads, len, dim]: no padding, no mask tensor.
        # (The 4-D form takes PyTorch's fused CPU kernel; 3-D inputs fall back to the math path.)
        for start, end in self._bounds:
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].unsqueeze(0).transpose(1, 2),
                k[start:end].unsqueeze(0).transpose(1, 2),
                v[start:end].unsqueeze(0).transpose(1, 2),
                is_causal=self.spec.causal,
                scale=self.spec.scale,
                enable_gqa=gqa,
            )[0].transpose(0, 1)
        return out
