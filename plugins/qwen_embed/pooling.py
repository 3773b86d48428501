"""Vectorised pooling over a varlen batch, then Matryoshka truncation and L2 normalisation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import VarlenBatch
from .settings import POOLING_METHODS


def pool(hidden: torch.Tensor, batch: VarlenBatch, method: str) -> torch.Tensor:
    """hidden [T, H] -> [n, H] float32, without a Python loop over sequences."""
    if method == "last":
        return hidden[batch.cu_seqlens[1:].long() - 1].float()
    if method == "cls":  # the first token: a bidirectional encoder's summary row
        return hidden[batch.cu_seqlens[:-1].long()].float()
    if method == "mean":
        lengths = torch.diff(batch.cu_seqlens).long()
        seq_of_token = torch.repeat_interleave(
            torch.arange(batch.num_seqs, device=hidden.device), lengths
        )
        sums = torch.zeros(
            batch.num_seqs, hidden.shape[1], device=hidden.device, dtype=torch.float32
        )
        sums.index_add_(0, seq_of_token, hidden.float())
        return sums / lengths.unsqueeze(1)
    raise ValueError(f"unknown pooling {method!r}; choose one of {POOLING_METHODS}")


def finish(pooled: torch.Tensor, *, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """Matryoshka: truncate first, then normalise the truncated vector."""
    if dimensions is not None:
        pooled = pooled[:, :dimensions]
    return F.normalize(pooled, p=2, dim=-1) if normalize else pooled
