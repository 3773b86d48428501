"""Reference backend: PyTorch SDPA, one call per segment; runs on CPU and GPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..segments import AttentionLayout
from .base import AttentionBackend


class TorchAttention(AttentionBackend):
    # PyTorch's CPU flash kernel walks one head at a time: with dense rows per head the bench
    # model ran 1.5-2.5% faster in bf16 (Zen 4) than on token-major [T, heads, dim] views.
    head_major = True

    def prepare(self, layout: AttentionLayout) -> None:
        bounds, qs, ks = [], 0, 0
        for q_len, k_len in zip(layout.q_lens, layout.k_lens, strict=True):
            bounds.append((qs, qs + q_len, ks, ks + k_len))
            qs, ks = qs + q_len, ks + k_len
        layout.state["torch"] = bounds

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layout: AttentionLayout) -> torch.Tensor:  # fmt: skip
        out = torch.empty_like(q)
        gqa = self.spec.num_heads != self.spec.num_kv_heads
        causal = self.spec.causal
        # Slices of the flat stream seen as [1, heads, len, dim]: no padding.
        # (The 4-D form takes PyTorch's fused CPU kernel; 3-D inputs fall back to the math path.)
        for q0, q1, k0, k1 in layout.state["torch"]:
            n_q, n_k = q1 - q0, k1 - k0
            mask = None
            if causal and 1 < n_q < n_k:  # the last n_q of n_k positions: bottom-right causal
                mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
            out[q0:q1] = F.scaled_dot_product_attention(
                q[q0:q1].unsqueeze(0).transpose(1, 2),
                k[k0:k1].unsqueeze(0).transpose(1, 2),
                v[k0:k1].unsqueeze(0).transpose(1, 2),
                attn_mask=mask,
                is_causal=causal and n_q == n_k,  # n_q == 1 < n_k: the last query sees all
                scale=self.spec.scale,
                enable_gqa=gqa,
            )[0].transpose(0, 1)
        return out
