"""Late chunking: one forward over a whole text returns one vector per chunk (a token span), each
computed in the context of the text around it, through the same segment layout, attention
backends and pooling as any forward.

A chunk is pooled the way the model pools a whole text:
- Causal models pooled at the last token (Qwen3-Embedding): a chunk's vector is the one the
  model gives the text cut after the chunk. Such a model reads a text out at the special tokens
  its tokenizer appends (Qwen3-Embedding's EOS, the row it was trained to pool), so each chunk
  gets read-out rows: those tokens at the positions right after the chunk's last token, as a
  query segment of their own whose keys are the text's rows up to the chunk's end plus its own
  read-out rows (bottom-right causal, as a sequence after a cached prefix). No row of the text
  attends to them, so the text's own rows are those of a plain forward, and a chunk that ends
  the text gives the whole text's vector. A tokenizer that appends nothing pools the chunk's
  last token itself.
- Bidirectional or mean-pooled models (gte-Qwen2): every token already sees the whole text; a
  chunk's vector is the mean of its tokens' hidden states.

A read-out segment's keys are gathered rows (its text's rows repeat once per chunk), so a
forward's gathered keys count in its budget (`cost`); a text whose chunks would gather more than
GATHER_FACTOR x max_batch_tokens keys is split into pieces of consecutive chunks, each a forward
of the text up to its last chunk's end (`pieces`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .batch import VarlenBatch, flatten, pool_spans, to_device
from .segments import AdapterRows, AttentionLayout, ForwardContext, ReadoutSegments

GATHER_FACTOR = 8  # gathered key rows per budget token: about one forward's activations


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

    def readouts(self, readout: bool) -> bool:
        return readout and self.tail > 0

    def rows(self, readout: bool) -> int:
        """Rows this text computes in a forward."""
        extra = len(self.spans) * self.tail if self.readouts(readout) else 0
        return len(self.forward_ids(readout)) + extra

    def keys(self, readout: bool) -> int:
        """Key rows its attention reads: its rows, plus each read-out segment's gathered keys."""
        if not self.readouts(readout):
            return self.rows(readout)
        return self.rows(readout) + int(self.spans[:, 1].sum()) + len(self.spans) * self.tail

    def cost(self, readout: bool) -> int:
        """Its share of a forward's token budget."""
        return max(self.rows(readout), -(-self.keys(readout) // GATHER_FACTOR))

    def pieces(self, readout: bool, budget: int) -> list[tuple[ChunkedText, np.ndarray]]:
        """(piece, indices of its chunks among this text's): this text whole, or groups of its
        chunks by their ends, each within `budget` (at least one chunk each); a piece is the
        text up to its last chunk's end (causal: rows past it do not change the chunk)."""
        if self.cost(readout) <= budget or not self.readouts(readout):
            return [(self, np.arange(len(self.spans)))]
        out, group = [], []
        for c in np.argsort(self.spans[:, 1], kind="stable").tolist():
            if group and self._piece([*group, c]).cost(readout) > budget:
                out.append((self._piece(group), np.array(group)))
                group = []
            group.append(c)
        return [*out, (self._piece(group), np.array(group))]

    def _piece(self, chunks: list[int]) -> ChunkedText:
        spans = self.spans[chunks]
        end = int(spans[:, 1].max())
        ids = np.concatenate([self.ids[:end], self.ids[len(self.ids) - self.tail :]])
        return ChunkedText(ids, spans, self.tail)


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


def pack_texts(texts: Sequence[ChunkedText]) -> torch.Tensor:
    """Chunked texts as one int64 tensor (what tensor-parallel workers receive): per text its
    id count, tail, chunk count, ids, then spans."""
    parts = [[len(texts)]]
    for t in texts:
        parts += [[len(t.ids), t.tail, len(t.spans)], t.ids, t.spans.reshape(-1)]
    return torch.from_numpy(np.concatenate(parts).astype(np.int64))


def unpack_texts(packed: torch.Tensor) -> list[ChunkedText]:
    flat, texts, at = packed.numpy(), [], 1
    for _ in range(int(flat[0])):
        n, tail, k = (int(x) for x in flat[at : at + 3])
        ids = flat[at + 3 : at + 3 + n]
        spans = flat[at + 3 + n : at + 3 + n + 2 * k].reshape(k, 2)
        texts.append(ChunkedText(ids, spans, tail))
        at += 3 + n + 2 * k
    return texts


class ChunkForward:
    """One forward over chunked texts: its rows and segment layout, and how its chunks are
    pooled. Rows: every text's own rows, then every read-out row."""

    def __init__(
        self,
        texts: Sequence[ChunkedText],
        readout: bool,
        prune: bool,
        device: torch.device,
        adapters: np.ndarray | None = None,
    ):
        """`adapters`: each text's (lora.py; segments.BASE: none), or None: none at all."""
        ids, cu = flatten([t.forward_ids(readout) for t in texts])
        starts = cu[:-1].tolist()
        body = int(cu[-1])
        lens = [len(t.forward_ids(readout)) for t in texts]
        q_lens, k_lens, index = list(lens), list(lens), [np.arange(body)]
        extra_ids, extra_positions, read_segments, read_from = [], [], [], []
        extra_rows = [0] * len(texts)  # each text's read-out rows after every body
        self.pool_ranges: list[list[tuple[int, int]]] = []  # per text, per chunk: rows
        row = body
        for k, (text, start) in enumerate(zip(texts, starts, strict=True)):
            ends = text.spans[:, 1]
            if not readout:  # mean of the chunk's rows
                self.pool_ranges.append([(start + a, start + b) for a, b in text.spans])
            elif text.tail == 0:  # the chunk's last token
                self.pool_ranges.append([(start + b - 1, start + b) for b in ends])
            else:
                t = text.tail
                extra_rows[k] = t * len(ends)
                extra_ids.append(np.tile(text.ids[len(text.ids) - t :], len(ends)))
                extra_positions.append((ends[:, None] + np.arange(t)).reshape(-1))
                ranges = []
                for end in ends:  # keys: the text up to the chunk's end, then its read-outs
                    read_segments.append((len(q_lens), row + t - 1))
                    read_from.append((k, int(end)))
                    q_lens.append(t)
                    k_lens.append(int(end) + t)
                    index += [start + np.arange(end), row + np.arange(t)]
                    ranges.append((row + t - 1, row + t))
                    row += t
                self.pool_ranges.append(ranges)
        all_ids = np.concatenate([ids.numpy(), *extra_ids]).astype(np.int64)
        positions = np.concatenate(
            [np.concatenate([np.arange(n) for n in lens]), *extra_positions]
        ).astype(np.int64)
        batch = VarlenBatch.from_rows(all_ids, positions, q_lens, device)
        kv_index = np.concatenate(index)  # host: the last layer's layout is cut from it
        if not read_segments:
            layout = AttentionLayout.for_batch(batch)
        else:
            layout = AttentionLayout.build(q_lens, k_lens, kv_index, device)
        # Last-layer pruning where every chunk is read out: the last layer computes keys and
        # values for every row and the rest only for each chunk's last read-out row.
        self.pruned = prune and len(read_segments) == sum(len(t.spans) for t in texts)
        last, last_rows = None, None
        if self.pruned:
            last, last_rows = self._last_layout(layout, kv_index, read_segments, device)
        rows = None
        if adapters is not None:  # each row, and each chunk, adds its text's adapter
            per_row = np.concatenate([np.repeat(adapters, lens), np.repeat(adapters, extra_rows)])
            per_chunk = np.repeat(adapters, [len(t.spans) for t in texts])
            rows = AdapterRows.of(per_row, per_chunk)
        readouts = None
        if read_from:
            text, end = np.array(read_from, dtype=np.int64).T
            readouts = ReadoutSegments(len(texts), text, end)
        self.context = ForwardContext(
            batch, layout, last, last_rows, None, adapters=rows, readouts=readouts
        )

    @staticmethod
    def _last_layout(layout: AttentionLayout, kv_index: np.ndarray, read_segments, device):
        """One query row per chunk, its last read-out row, attending to its segment's keys."""
        cu_k = layout.cu_k_host.numpy()
        segments = [s for s, _ in read_segments]
        keys = [kv_index[cu_k[s] : cu_k[s + 1]] for s in segments]
        last = AttentionLayout.build(
            np.ones(len(segments), dtype=np.int64),
            [len(k) for k in keys],
            np.concatenate(keys),
            device,
        )
        rows = to_device(torch.tensor([r for _, r in read_segments], dtype=torch.long), device)
        return last, rows

    def pool(self, hidden: torch.Tensor, head, pooler=None) -> list[np.ndarray]:
        """Final hidden states of every row (pruned: of the pooled rows) -> per text, its
        chunks' vectors float32 [k, H], each through `head` (the model's projections). A
        checkpoint's attention pooling (`pooler`) pools each chunk's rows in place of their
        mean."""
        counts = [len(ranges) for ranges in self.pool_ranges]
        if self.pruned:
            pooled = hidden.float()
        else:
            spans = np.array([r for ranges in self.pool_ranges for r in ranges], dtype=np.int64)
            pooled = pool_spans(hidden, spans, pooler)
        return [part.cpu().numpy() for part in head(pooled).split(counts)]
