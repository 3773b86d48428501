"""Flattened variable-length batches: the token-budget planners, the flat batch on the
device, pooling over it, and the copies that keep a GPU busy.

A batch is one token stream: no padding anywhere. Sequence i owns tokens
`cu_seqlens[i]:cu_seqlens[i + 1]`; its last token is at `cu_seqlens[i + 1] - 1`. Pooling reads
it without a Python loop over sequences, then `finish` applies Matryoshka truncation and L2
normalisation.

Copies: inputs go up from pinned memory without blocking the host (a copy from pageable memory
makes the host wait until the GPU has finished everything queued before it, so the next batch
could not be planned while the current one runs); results come back into pinned memory and are
waited for only when the host reads them, after the next forward is queued. On CPU both are the
tensors themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .settings import POOLING_METHODS


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`; to a GPU from pinned memory, without waiting for the copy."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostResult:
    """A tensor's copy on its way to the host: `numpy()` waits for it (a GPU tensor's copy is
    queued behind the work that makes it)."""

    def __init__(self, t: torch.Tensor):
        self._done = None
        if t.device.type == "cuda":
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = t

    def numpy(self) -> np.ndarray:
        if self._done is not None:
            self._done.synchronize()
        return self._host.numpy()


class HostRows:
    """Rows of `out` on their way from queued forwards: each forward's result is read when the
    next one is queued (a GPU never waits for the host to read results or plan the next
    batch), the last one's by `result()`, which returns `out`."""

    def __init__(self, out: np.ndarray):
        self._out = out
        self._last: tuple[list[int], HostResult] | None = None

    def add(self, rows: list[int], result: HostResult) -> None:
        self._read()
        self._last = rows, result

    def result(self) -> np.ndarray:
        self._read()
        return self._out

    def _read(self) -> None:
        if self._last is not None:
            rows, result = self._last
            self._out[rows] = result.numpy()
            self._last = None


@dataclass(frozen=True)
class VarlenBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, restarting at 0 for every sequence
    cu_seqlens: torch.Tensor  # [n + 1] int32
    cu_seqlens_host: torch.Tensor  # the same on the host, for kernels that plan on the CPU
    seq_lens: tuple[int, ...]  # host copy, for backends that loop over sequences

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def from_flat(
        cls, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, device: torch.device | str
    ) -> VarlenBatch:
        """Build from host tensors (the form TP ranks receive); positions are derived here."""
        cu = cu_seqlens.numpy().astype(np.int64)
        lens = np.diff(cu)
        positions = np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1], lens)
        return cls(
            input_ids=to_device(input_ids, device),
            positions=to_device(torch.from_numpy(positions), device),
            cu_seqlens=to_device(cu_seqlens, device),
            cu_seqlens_host=cu_seqlens,
            seq_lens=tuple(int(n) for n in lens),
        )

    @classmethod
    def from_rows(
        cls, input_ids: np.ndarray, positions: np.ndarray, seg_lens, device: torch.device | str
    ) -> VarlenBatch:
        """Rows with given positions (a segment plan's: a sequence after a shared prefix starts
        past 0); `seg_lens` split them into the plan's query segments."""
        cu = torch.tensor(np.concatenate([[0], np.cumsum(seg_lens)]), dtype=torch.int32)
        return cls(
            input_ids=to_device(torch.from_numpy(input_ids), device),
            positions=to_device(torch.from_numpy(positions), device),
            cu_seqlens=to_device(cu, device),
            cu_seqlens_host=cu,
            seq_lens=tuple(int(n) for n in seg_lens),
        )


def flatten(sequences: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-empty int sequences -> host (input_ids int64 [T], cu_seqlens int32 [n + 1])."""
    lens = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    if lens.size == 0 or lens.min() <= 0:
        raise ValueError("a varlen batch needs at least one sequence and no empty sequence")
    cu = np.zeros(lens.size + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences])
    return torch.from_numpy(ids), torch.from_numpy(cu)


def plan_batches(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Group sequence indices into forward batches of at most `max_batch_tokens` tokens.

    Longest first so each batch holds similar lengths; a sequence longer than the budget
    runs alone rather than being refused.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    return _pack(order, lengths, max_batch_tokens)


def plan_requests(tokens: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Group requests (their token counts) into consecutive encoder calls of at most
    `max_batch_tokens` tokens, fewest tokens first: a request is answered as soon as its call
    ends, so a short request never waits for a long one that came in the same execute. A
    request over the budget is a call of its own."""
    order = sorted(range(len(tokens)), key=lambda i: tokens[i])
    return _pack(order, tokens, max_batch_tokens)


def _pack(order: list[int], sizes: Sequence[int], budget: int) -> list[list[int]]:
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i in order:
        if current and total + sizes[i] > budget:
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += sizes[i]
    if current:
        groups.append(current)
    return groups


def pool(hidden: torch.Tensor, batch: VarlenBatch, method: str, pooler=None) -> torch.Tensor:
    """hidden [T, H] -> [n, H] float32 (`pooler`'s width for "attention": the checkpoint's
    attention_pooling.AttentionPooling), without a Python loop over sequences."""
    if method == "attention":
        return pooler(hidden, torch.diff(batch.cu_seqlens).long())
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


def pool_spans(hidden: torch.Tensor, spans: np.ndarray, pooler=None) -> torch.Tensor:
    """hidden [T, H] -> the mean of each span of rows (`spans`: host [n, 2], start and end,
    non-empty), float32 [n, H]; with `pooler` (attention_pooling.AttentionPooling), its
    pooling of each span's rows instead."""
    lengths = spans[:, 1] - spans[:, 0]
    of_span = np.repeat(np.arange(len(spans)), lengths)
    # each row's place in its span, added to the span's start: no loop over the spans
    rows = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    rows += spans[of_span, 0]
    picked = hidden[to_device(torch.from_numpy(rows), hidden.device)]
    if pooler is not None:
        return pooler(picked, to_device(torch.from_numpy(lengths), hidden.device))
    sums = torch.zeros(len(spans), hidden.shape[1], device=hidden.device, dtype=torch.float32)
    sums.index_add_(0, to_device(torch.from_numpy(of_span), hidden.device), picked.float())
    return sums / to_device(torch.from_numpy(lengths).float(), hidden.device).unsqueeze(1)


def finish(pooled: torch.Tensor, *, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """Matryoshka: truncate first, then normalise the truncated vector."""
    if dimensions is not None:
        pooled = pooled[:, :dimensions]
    return F.normalize(pooled, p=2, dim=-1) if normalize else pooled
