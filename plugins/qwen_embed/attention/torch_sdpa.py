"""PyTorch's attention: on GPUs that run it, its varlen FlashAttention over the whole flat
batch (one call per layer); elsewhere (CPU, fp32, older GPUs) SDPA, one call per segment."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..segments import AttentionLayout
from .base import AttentionBackend, AttentionSpec
from .torch_varlen import varlen_problem


class TorchAttention(AttentionBackend):
    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        self._varlen = None
        self._gqa = spec.num_heads != spec.num_kv_heads
        dtype = str(spec.dtype).removeprefix("torch.")
        if varlen_problem(str(spec.device), dtype, spec.head_dim) is None:
            self.use_varlen(torch.ops.aten._flash_attention_forward)

    def use_varlen(self, kernel) -> None:
        """Call `kernel` (`aten::_flash_attention_forward`, torch_varlen.py) for every layer,
        key and value heads as they are: FlashAttention reads fewer key/value heads than query
        heads as groups (GQA, never repeated)."""
        self._varlen = kernel

    def prepare(self, layout: AttentionLayout) -> None:
        if self._varlen is not None:
            return  # it reads the layout's device offsets directly
        # Per segment: its rows and its mask, built once for every layer. A segment with as
        # many queries as keys is plain causal; one query sees all its keys; the last n_q of
        # n_k positions (after a shared prefix) get a bottom-right causal mask.
        segments, qs, ks = [], 0, 0
        device, causal = self.spec.device, self.spec.causal
        for n_q, n_k in zip(layout.q_lens, layout.k_lens, strict=True):
            mask = None
            if causal and 1 < n_q < n_k:
                mask = torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q)
            segments.append((qs, qs + n_q, ks, ks + n_k, causal and n_q == n_k, mask))
            qs, ks = qs + n_q, ks + n_k
        layout.state["torch"] = segments

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout
    ) -> torch.Tensor:
        if self._varlen is not None:
            # FlashAttention aligns the causal mask bottom-right, as a shared prefix needs;
            # varlen_attn makes the same call (no dropout, no debug mask, window (-1, 0)).
            causal = self.spec.causal
            return self._varlen(
                q,
                k,
                v,
                layout.cu_q,
                layout.cu_k,
                layout.max_q,
                layout.max_k,
                0.0,
                causal,
                False,
                scale=self.spec.scale,
                window_size_left=-1,
                window_size_right=0 if causal else -1,
            )[0]
        out = torch.empty_like(q)
        # Slices of the flat stream seen as [1, heads, len, dim]: no padding.
        # (The 4-D form takes PyTorch's fused CPU kernel; 3-D inputs fall back to the math path.)
        for q0, q1, k0, k1, is_causal, mask in layout.state["torch"]:
            out[q0:q1] = F.scaled_dot_product_attention(
                q[q0:q1].unsqueeze(0).transpose(1, 2),
                k[k0:k1].unsqueeze(0).transpose(1, 2),
                v[k0:k1].unsqueeze(0).transpose(1, 2),
                attn_mask=mask,
                is_causal=is_causal,
                scale=self.spec.scale,
                enable_gqa=self._gqa,
            )[0].transpose(0, 1)
        return out
