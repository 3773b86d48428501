"""Pooling by multi-head attention (PMA): CodeFuse's code embedders (C2LLM, CodeFuse-CGE).

One learned seed S [width] attends over a text's final hidden states X [t, hidden], as their
remote code's `PMA` with `MAB_POST` computes it (config.AttentionPoolingSpec):
  q = fc_q(S), k = fc_k(X), v = fc_v(X), split into heads of width / heads columns;
  a = softmax over the text's tokens of q.k / sqrt(width)   (the whole width, not a head's)
  o = ln0(S + concat over heads of a.v);  vector = ln1(o + relu(fc_o(o)))
The seed is the same for every text, so each head's scores are a dot product of X with a
fixed vector (fc_k's rows of that head applied to its slice of q): no key matrix is built.
A forward's texts are pooled together, a softmax per text over its own rows (`lengths`), as
every pooling here, without a Python loop over texts. Rank 0 holds it in fp32 (heads.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import AttentionPoolingSpec
from .heads import checkpoint_parameter

PREFIX = "mha_pma."  # its tensors in the checkpoint


class AttentionPooling(nn.Module):
    def __init__(self, spec: AttentionPoolingSpec, hidden_size: int):
        super().__init__()
        width = spec.width
        self.num_heads = spec.num_heads
        self.layer_norm = spec.layer_norm
        self.seed = checkpoint_parameter(torch.empty(1, 1, width), PREFIX + "S")
        inputs = {"fc_q": width, "fc_k": hidden_size, "fc_v": hidden_size, "fc_o": width}
        for name, size in inputs.items():
            weight = checkpoint_parameter(torch.empty(width, size), f"{PREFIX}mab.{name}.weight")
            setattr(self, f"{name}_weight", weight)
            setattr(self, f"{name}_bias", self._vector(f"{name}.bias"))
        for name in ("ln0", "ln1") if spec.layer_norm else ():
            setattr(self, f"{name}_weight", self._vector(f"{name}.weight"))
            setattr(self, f"{name}_bias", self._vector(f"{name}.bias"))

    def _vector(self, name: str) -> nn.Parameter:
        return checkpoint_parameter(torch.empty(self.seed.shape[-1]), f"{PREFIX}mab.{name}")

    @property
    def width(self) -> int:
        return self.seed.shape[-1]

    def forward(self, rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """rows [R, hidden]: the texts' final hidden states one after another; lengths [n]
        (int64, on rows' device, each > 0) -> float32 [n, width]."""
        x = rows.float()
        n, heads, width = len(lengths), self.num_heads, self.width
        seed = self.seed.reshape(width)
        q = F.linear(seed, self.fc_q_weight, self.fc_q_bias).view(heads, -1)
        # q_h . (W_h x + b_h) = x . (W_h^T q_h) + b_h . q_h, for each head h
        key_weight = self.fc_k_weight.view(heads, -1, x.shape[1])
        readers = torch.einsum("hdk,hd->kh", key_weight, q)
        offsets = (self.fc_k_bias.view(heads, -1) * q).sum(-1)
        scores = (x @ readers + offsets) / math.sqrt(width)  # [R, heads]
        text = torch.repeat_interleave(torch.arange(n, device=x.device), lengths)
        at = text.unsqueeze(1).expand(-1, heads)
        top = torch.full((n, heads), -math.inf, device=x.device)
        top = top.scatter_reduce(0, at, scores, "amax")
        weights = torch.exp(scores - top[text])
        totals = torch.zeros(n, heads, device=x.device).index_add_(0, text, weights)
        weights = weights / totals[text]
        values = F.linear(x, self.fc_v_weight, self.fc_v_bias).view(len(x), heads, -1)
        attended = torch.zeros(n, heads, values.shape[2], device=x.device)
        attended.index_add_(0, text, weights.unsqueeze(2) * values)
        out = self._norm(seed + attended.reshape(n, width), "ln0")
        return self._norm(out + F.relu(F.linear(out, self.fc_o_weight, self.fc_o_bias)), "ln1")

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if not self.layer_norm:
            return x
        weight, bias = getattr(self, f"{name}_weight"), getattr(self, f"{name}_bias")
        return F.layer_norm(x, (self.width,), weight, bias)


def build_pooler(config, route) -> AttentionPooling | None:
    """Rank 0's pooler where the route pools by attention, else None (batch.pool)."""
    if route.pooling != "attention":
        return None
    return AttentionPooling(config.attention_pooling, config.hidden_size)
