"""Late chunking: one forward over a whole text returns one vector per chunk (a token span), each
computed in the context of the text around it.

A chunk is pooled the way the model pools a whole text:
- Causal models pooled at the last token (Qwen3-Embedding): a chunk's vector is the one the
  model gives the text cut after the chunk. Such a model reads a text out at the special tokens
  its tokenizer appends (Qwen3-Embedding's EOS, the row it was trained to pool), so each chunk
  gets read-out rows: those tokens, placed right after the chunk's last token, attending to the
  text's keys up to there and to themselves. No row of the text attends to them, so the text's
  own rows are those of a plain forward, and a chunk that ends the text gives the whole text's
  vector. A tokenizer that appends nothing pools the chunk's last token itself.
- Bidirectional or mean-pooled models (gte-Qwen2): every token already sees the whole text; a
  chunk's vector is the mean of its tokens' hidden states.

Read-out rows attend through a masked dense product (one row per chunk and appended token),
beside the backend's varlen attention over the texts. A forward holds whole texts; one longer
than the token budget runs alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .batch import VarlenBatch, flatten
from .segments import AttentionLayout, ForwardContext

READ_BLOCK = 64  # read-out rows per dense attention product


@dataclass(frozen=True)
class ChunkedText:
    """A text's token ids as the tokenizer made them (head + text + `tail` appended special
    tokens) and its chunks, (start, end) token spans over the ids before the tail."""

    ids: np.ndarray
    spans: np.ndarray  # int64 [k, 2]
    tail: int = 0

    def forward_ids(self, readout: bool) -> np.ndarray:
        """The text's own rows in a forward: without its appended tokens where those are the
        read-out (they then follow each chunk instead); whole otherwise (a bidirectional
        model's tokens see them)."""
        return self.ids[: len(self.ids) - self.tail] if readout else self.ids

    def rows(self, readout: bool) -> int:
        """Rows this text takes in a forward (its token budget)."""
        return len(self.forward_ids(readout)) + (len(self.spans) * self.tail if readout else 0)


def check_chunks(index: int, ids: np.ndarray, spans, tail: int) -> ChunkedText:
    """Validate one text's chunks (ValueError naming them and the limit)."""
    if not 0 <= tail < len(ids):
        raise ValueError(f"chunks[{index}]: tail must be in 0..{len(ids) - 1}, got {tail}")
    arr = np.asarray(spans, dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2 or len(arr) == 0:
        raise ValueError(f"chunks[{index}] must be a non-empty list of (start, end) token spans")
    limit = len(ids) - tail
    bad = np.flatnonzero((arr[:, 0] < 0) | (arr[:, 1] <= arr[:, 0]) | (arr[:, 1] > limit))
    if bad.size:
        start, end = arr[bad[0]]
        raise ValueError(
            f"chunks[{index}][{bad[0]}] = ({start}, {end}): a span must have "
            f"0 <= start < end <= {limit} (the text's tokens)"
        )
    return ChunkedText(np.asarray(ids), arr, tail)


class Readouts:
    """The read-out rows of one forward (after every text's rows) and whom they attend to."""

    def __init__(self, first_row: int, groups: list[tuple[torch.Tensor, torch.Tensor]]):
        self.first_row = first_row
        # per text: (key rows: its own rows, then its read-out rows; mask [reads, keys])
        self.groups = groups
        self.reads = sum(mask.shape[0] for _, mask in groups)

    def attend(self, backend, q, k, v, layout: AttentionLayout) -> torch.Tensor:
        scale = backend.spec.scale
        if q.shape[0] == self.reads:  # the pruned last layer: only the read-out rows ask
            return self._dense(q, k, v, scale)
        n = self.first_row
        texts = backend.forward(q[:n], k[:n], v[:n], layout)
        return torch.cat([texts, self._dense(q[n:], k, v, scale)])

    def _dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        out = torch.empty_like(q)
        heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
        start = 0
        for keys, mask in self.groups:
            kg = k.index_select(0, keys).float().permute(1, 2, 0).unsqueeze(1)
            vg = v.index_select(0, keys).float().permute(1, 0, 2).unsqueeze(1)
            # Blocks of read-out rows bound the scores' memory on long texts with many chunks.
            for a in range(0, mask.shape[0], READ_BLOCK):
                m = mask[a : a + READ_BLOCK]
                r = m.shape[0]
                # grouped heads without copying keys: [kv_heads, group, reads, d]
                qg = q[start + a : start + a + r].float().view(r, kv_heads, heads // kv_heads, d)
                scores = (qg.permute(1, 2, 0, 3) @ kg) * scale
                probs = scores.masked_fill_(~m, float("-inf")).softmax(-1)
                rows = (probs @ vg).permute(2, 0, 1, 3).reshape(r, heads, d)
                out[start + a : start + a + r] = rows
            start += mask.shape[0]
        return out


class ChunkForward:
    """What one forward over chunked texts computes, and how its chunks are pooled."""

    def __init__(
        self, texts: Sequence[ChunkedText], readout: bool, prune: bool, device: torch.device
    ):
        ids, cu = flatten([t.forward_ids(readout) for t in texts])
        starts = cu[:-1].tolist()
        extra_ids, extra_positions, groups = [], [], []
        self.pool_ranges: list[list[tuple[int, int]]] = []  # per text, per chunk: rows
        row = int(cu[-1])
        for text, start in zip(texts, starts, strict=True):
            body, ends = len(text.forward_ids(readout)), text.spans[:, 1]
            if not readout:  # mean of the chunk's rows
                self.pool_ranges.append([(start + a, start + b) for a, b in text.spans])
            elif text.tail == 0:  # the chunk's last token
                self.pool_ranges.append([(start + b - 1, start + b) for b in ends])
            else:
                tail, t = text.ids[body:], text.tail
                reads = len(ends) * t
                extra_ids.append(np.tile(tail, len(ends)))
                extra_positions.append((ends[:, None] + np.arange(t)).reshape(-1))
                self.pool_ranges.append(
                    [(row + (c + 1) * t - 1, row + (c + 1) * t) for c in range(len(ends))]
                )
                groups.append(_readout_group(start, body, row, ends, t, device))
                row += reads
        batch = VarlenBatch.from_flat(ids, cu, device)
        layout = AttentionLayout.for_batch(batch)
        self.readouts = Readouts(int(cu[-1]), groups) if groups else None
        # Last-layer pruning where every pooled row is a read-out row (one appended token):
        # the last layer then computes only those rows beyond keys/values.
        self.pruned = prune and self.readouts is not None and all(t.tail == 1 for t in texts)
        last, last_rows = None, None
        if self.pruned:
            last, last_rows = layout, torch.arange(int(cu[-1]), row, device=device)
        if self.readouts is not None:
            positions = batch.positions.cpu().numpy()
            lens = [*batch.seq_lens, row - int(cu[-1])]
            batch = VarlenBatch.from_rows(
                np.concatenate([ids.numpy(), *extra_ids]).astype(np.int64),
                np.concatenate([positions, *extra_positions]).astype(np.int64),
                lens,
                device,
            )
        self.context = ForwardContext(batch, layout, last, last_rows, None, self.readouts)

    def pool(self, hidden: torch.Tensor) -> list[np.ndarray]:
        """Final hidden states of every row (pruned: of the read-out rows) -> per text, its
        chunks' vectors float32 [k, H]."""
        if self.pruned:
            counts = [len(ranges) for ranges in self.pool_ranges]
            return [part.float().cpu().numpy() for part in hidden.split(counts)]
        out = []
        for ranges in self.pool_ranges:
            rows = [hidden[a:b].float().mean(0) for a, b in ranges]
            out.append(torch.stack(rows).cpu().numpy())
        return out


def _readout_group(start, body, first, ends, tail, device):
    """Key rows and mask of one text's read-outs: read-out j of chunk c sees the text's rows
    before the chunk's end and the chunk's read-outs up to j."""
    reads = len(ends) * tail
    keys = np.concatenate([start + np.arange(body), first + np.arange(reads)])
    chunk = np.repeat(np.arange(len(ends)), tail)
    mask = np.zeros((reads, body + reads), dtype=bool)
    mask[:, :body] = np.arange(body)[None, :] < ends[chunk][:, None]
    own = np.arange(reads)
    mask[:, body:] = (chunk[:, None] == chunk[None, :]) & (own[None, :] <= own[:, None])
    return torch.from_numpy(keys).to(device), torch.from_numpy(mask).to(device)
