"""Segment plans beside VarlenBatch: compute a shared prefix once, and the last layer only where
it is read.

With causal attention the hidden states (so the keys and values) of a prefix do not depend on
what follows it. Sequences of one forward batch that begin with the same token ids (found on the
ids, so exact whatever BPE did at a prompt boundary) share that prefix: it is computed once as
its own segment, and each sequence computes only its remaining tokens, at their true positions,
attending to the prefix's keys/values plus its own. Prefixes also persist across batches in a
bounded LRU cache of per-layer keys/values (`PrefixCache`); a stream of one-text requests finds
its shared prefix through a short history of recent sequences. Every rank of a tensor-parallel
group builds the same plan from the same ids and the same cache history, so hit/miss decisions
agree without communication.

Last-layer pruning: with last-token pooling only one row per sequence is read after the final
layer, so that layer computes keys/values for every token but everything else only for those
rows (`AttentionLayout.last_rows`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from .batch import VarlenBatch, to_device

if TYPE_CHECKING:
    from .media import MediaForward

MIN_PREFIX_TOKENS = 8  # shorter common prefixes are not worth a segment
HISTORY = 64  # recent sequences a new one is compared with to discover a shared prefix
BASE = -1  # the adapter of rows that add none (an adapter is its index in lora.AdapterSwitch)


@dataclass(frozen=True)
class AttentionLayout:
    """Which key/value rows each query segment attends to (causal: bottom-right aligned).

    `q_lens` split the query rows and `k_lens` the key rows; `kv_index` (None: the keys are
    this batch's rows in order) gathers each segment's keys/values, prefix first, from
    [cached prefixes ..., this batch]."""

    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    cu_q: torch.Tensor  # int32 [s + 1] on the device
    cu_k: torch.Tensor
    cu_q_host: torch.Tensor
    cu_k_host: torch.Tensor
    kv_index: torch.Tensor | None
    state: dict = field(default_factory=dict, compare=False)  # per-backend kernel plans

    @classmethod
    def build(cls, q_lens, k_lens, kv_index: np.ndarray, device) -> AttentionLayout:
        """A segment plan's layout: keys gathered by `kv_index` (host)."""
        cu_q = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
        cu_k = torch.tensor(np.concatenate([[0], np.cumsum(k_lens)]), dtype=torch.int32)
        return cls(
            tuple(int(n) for n in q_lens),
            tuple(int(n) for n in k_lens),
            to_device(cu_q, device),
            to_device(cu_k, device),
            cu_q,
            cu_k,
            to_device(torch.from_numpy(kv_index), device),
        )

    @classmethod
    def for_batch(cls, batch: VarlenBatch, last_only: bool = False) -> AttentionLayout:
        """No prefix shared: each sequence attends to itself, on the batch's own cu_seqlens;
        `last_only` (last-layer pruning): one query row per sequence, its last."""
        lens, cu, cu_host = batch.seq_lens, batch.cu_seqlens, batch.cu_seqlens_host
        if not last_only:
            return cls(lens, lens, cu, cu, cu_host, cu_host, None)
        cu_q = torch.arange(len(lens) + 1, dtype=torch.int32)
        return cls((1,) * len(lens), lens, to_device(cu_q, cu.device), cu, cu_q, cu_host, None)

    @property
    def max_q(self) -> int:
        return max(self.q_lens)

    @property
    def max_k(self) -> int:
        return max(self.k_lens)


class PrefixEntry:
    """A prefix's keys/values per layer, computed with the weights of adapter `space` (in a
    linear-attention layer, models/qwen3_5.py: its final state and last convolution inputs)."""

    def __init__(self, ids: tuple[int, ...], num_layers: int, space: int = BASE):
        self.ids = ids
        self.space = space
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers


class PrefixCache:
    """Per-layer keys/values of prefixes, keyed by their token ids, least recently used out.

    Sizes are counted in tokens x `bytes_per_token` plus `bytes_per_entry` (a linear-attention
    layer's state, whatever the prefix's length), the same on every TP rank, so every rank
    evicts the same entries. Capacity 0 keeps nothing (in-batch sharing still works). Entries
    and the history of recent sequences are indexed by their first MIN_PREFIX_TOKENS ids, in
    the space of the weights that computed them (a sequence's adapter, lora.py; BASE: none):
    one budget and one order of use for all."""

    def __init__(
        self, capacity_bytes: int, bytes_per_token: int, num_layers: int, bytes_per_entry: int = 0
    ):
        self.capacity_bytes = capacity_bytes
        self.bytes_per_token = bytes_per_token
        self.bytes_per_entry = bytes_per_entry
        self.num_layers = num_layers
        Key = tuple[int, tuple[int, ...]]  # (space, ids)
        self.entries: OrderedDict[Key, PrefixEntry] = OrderedDict()
        self._by_head: dict[Key, set[tuple[int, ...]]] = {}
        # head -> the latest sequence that began with it, whole (int32): a shared prefix may be
        # as long as the texts, and only the whole sequence tells it from a repeated text.
        self.history: OrderedDict[Key, np.ndarray] = OrderedDict()
        self.tokens = 0
        self.hits = 0
        self.lookups = 0
        self.evictions = 0

    @property
    def bytes_in_use(self) -> int:
        return self.tokens * self.bytes_per_token + len(self.entries) * self.bytes_per_entry

    def fits(self, length: int) -> bool:
        return length * self.bytes_per_token + self.bytes_per_entry <= self.capacity_bytes

    def find(
        self, space: int, seq: np.ndarray, head: tuple[int, ...], limit: int
    ) -> PrefixEntry | None:
        """The longest prefix of `seq` (which begins with `head`) of at most `limit` tokens
        cached in `space`."""
        best = None
        for ids in self._by_head.get((space, head), ()):
            n = len(ids)
            if n <= limit and (best is None or n > len(best.ids)) and _starts_with(seq, ids):
                best = self.entries[space, ids]
        return best

    def touch(self, entry: PrefixEntry) -> None:
        self.entries.move_to_end((entry.space, entry.ids))

    def add(self, entry: PrefixEntry) -> None:
        self.entries[entry.space, entry.ids] = entry
        self._by_head.setdefault((entry.space, entry.ids[:MIN_PREFIX_TOKENS]), set()).add(entry.ids)
        self.tokens += len(entry.ids)
        while self.bytes_in_use > self.capacity_bytes:
            (space, ids), _ = self.entries.popitem(last=False)
            self.tokens -= len(ids)
            self.evictions += 1
            heads = self._by_head[space, ids[:MIN_PREFIX_TOKENS]]
            heads.discard(ids)
            if not heads:
                del self._by_head[space, ids[:MIN_PREFIX_TOKENS]]

    def recent(self, space: int, head: tuple[int, ...]) -> np.ndarray | None:
        return self.history.get((space, head))

    def remember(self, space: int, head: tuple[int, ...], seq: np.ndarray) -> None:
        self.history[space, head] = seq.astype(np.int32)
        self.history.move_to_end((space, head))
        if len(self.history) > HISTORY:
            self.history.popitem(last=False)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _starts_with(seq: np.ndarray, ids: tuple[int, ...]) -> bool:
    return len(seq) >= len(ids) and seq[: len(ids)].tolist() == list(ids)


@dataclass
class SegmentPlan:
    """What one forward computes. Rows of the computed stream: first the prefix segments that
    are computed here (cache misses), then each sequence's own tokens."""

    input_ids: np.ndarray  # int64 [T_computed]
    positions: np.ndarray  # int64 [T_computed]
    layout: AttentionLayout
    kv_index: np.ndarray  # host copy of layout.kv_index
    pool_rows: np.ndarray  # int64 [n]: each sequence's last row (what last pooling reads)
    source: np.ndarray  # int64 [T_computed]: each computed row's row in the flat batch
    used: list[PrefixEntry]  # cached prefixes whose keys/values come first in every layer
    new: list[tuple[PrefixEntry, int]]  # prefixes computed here: (entry, first row) to store
    received_tokens: int
    prefixes: list[PrefixEntry | None]  # each sequence's prefix (of `used` or `new`), or none

    @property
    def computed_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep this layer's keys/values of the prefixes computed here (for the cache)."""
        for entry, row in self.new:
            rows = slice(row, row + len(entry.ids))
            entry.kv[layer] = (k[rows].clone(), v[rows].clone())

    def gather(self, layer: int, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout):
        """Each segment's keys/values, cached prefixes' first: what `layout` indexes."""
        if self.used:
            k = torch.cat([e.kv[layer][0] for e in self.used] + [k])
            v = torch.cat([e.kv[layer][1] for e in self.used] + [v])
        return k.index_select(0, layout.kv_index), v.index_select(0, layout.kv_index)

    def commit(self, cache: PrefixCache) -> None:
        """After a forward completed: keep the prefixes it computed (least recently used out)."""
        for entry, _ in self.new:
            if cache.fits(len(entry.ids)) and all(kv is not None for kv in entry.kv):
                cache.add(entry)

    def last_layout(self, device) -> AttentionLayout:
        """Last-layer pruning: one query row per sequence, attending to everything it sees
        (the sequences' key segments, past the prefix segments computed here)."""
        first = len(self.new)
        index = self.kv_index[int(self.layout.cu_k_host[first]) :]
        return AttentionLayout.build(
            np.ones(len(self.pool_rows), dtype=np.int64), self.layout.k_lens[first:], index, device
        )


def plan_segments(
    flat: np.ndarray,
    bounds: list[int],
    cache: PrefixCache,
    device,
    visual_starts: list[int] | None = None,
    spaces: np.ndarray | None = None,
) -> SegmentPlan | None:
    """Group the sequences of a flat batch (`flat` ids, split at `bounds`, its cu_seqlens) by
    shared prefixes (in this batch, in the cache, or with a recent sequence) and lay out the
    computed rows; None when nothing is shared. Deterministic given the ids and the cache. A
    prefix ends by each sequence's `visual_starts` (its first image or video token;
    placeholders are the same ids whatever the pixels), and leaves it at least one token of
    its own. Sequences share a prefix only within one of `spaces` (each sequence's adapter;
    None: all BASE): other weights, other keys and values."""
    # Arrays for the arithmetic; token ids as tuples only where they key a prefix.
    seqs = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    heads = [tuple(seq[:MIN_PREFIX_TOKENS].tolist()) for seq in seqs]
    n = len(seqs)
    space_of = [BASE] * n if spaces is None else [int(a) for a in spaces]
    starts = visual_starts or [len(seq) for seq in seqs]
    limits = [min(len(seq) - 1, start) for seq, start in zip(seqs, starts, strict=True)]
    Key = tuple[int, tuple[int, ...]]  # (space, prefix ids), as the cache keys them
    prefix_of: list[Key | None] = [None] * n
    cached: dict[Key, PrefixEntry] = {}
    for i, seq in enumerate(seqs):
        cache.lookups += 1
        entry = cache.find(space_of[i], seq, heads[i], limits[i])
        if entry is not None:
            cache.hits += 1
            cache.touch(entry)
            prefix_of[i] = (entry.space, entry.ids)
            cached[prefix_of[i]] = entry
    # In-batch sharing (and discovery against recent sequences) among the others, grouped by
    # their space and first MIN_PREFIX_TOKENS tokens.
    groups: dict[Key, list[int]] = {}
    for i, seq in enumerate(seqs):
        if prefix_of[i] is None and len(seq) > MIN_PREFIX_TOKENS:
            groups.setdefault((space_of[i], heads[i]), []).append(i)
    for (space, head), members in groups.items():
        limit = min(limits[i] for i in members)
        if len(members) > 1:
            length = min(_common_prefix(seqs[members[0]], seqs[i]) for i in members[1:])
        else:  # alone: a prefix shared with a recent sequence, worth computing if kept
            seq, recent = seqs[members[0]], cache.recent(space, head)
            length = 0 if recent is None else min(_common_prefix(seq, recent), starts[members[0]])
            # Only where the two go on differently: a repeated text (or one that is the start
            # of another) is not a shared prefix, and caching whole texts would churn the cache.
            if recent is None or not cache.fits(length) or length >= min(len(seq), len(recent)):
                length = 0
        length = min(length, limit)
        if length >= MIN_PREFIX_TOKENS:
            common = (space, tuple(seqs[members[0]][:length].tolist()))
            for i in members:
                prefix_of[i] = common
    for space, head, seq in zip(space_of, heads, seqs, strict=True):
        cache.remember(space, head, seq)
    if not any(prefix_of):
        return None
    # Layout: cached prefixes' keys first (in `used` order), then this batch's computed rows.
    used = list(cached.values())
    offsets, total = {}, 0
    for key, entry in cached.items():
        offsets[key] = total
        total += len(entry.ids)
    new_prefixes = sorted(
        {p for p in prefix_of if p is not None and p not in cached},
        key=lambda p: (p[0], len(p[1]), p[1]),  # an adapter's rows together
    )
    ids, positions, q_lens, k_lens, kv_index, new, source = [], [], [], [], [], [], []
    row = 0
    num_layers = cache.num_layers
    flat_starts = np.asarray(bounds)
    lens = np.diff(flat_starts)
    first_with: dict[Key, int] = {}  # a sequence whose rows a new prefix's are
    for i, p in enumerate(prefix_of):
        first_with.setdefault(p, i)
    entry_of = dict(cached)
    for p in new_prefixes:
        space, prefix = p
        offsets[p] = total + row
        entry_of[p] = PrefixEntry(prefix, num_layers, space)
        new.append((entry_of[p], row))
        ids.append(seqs[first_with[p]][: len(prefix)])
        positions.append(np.arange(len(prefix)))
        source.append(flat_starts[first_with[p]] + np.arange(len(prefix)))
        q_lens.append(len(prefix))
        k_lens.append(len(prefix))
        kv_index.append(total + row + np.arange(len(prefix)))
        row += len(prefix)
    # Each sequence's own rows, all at once over the flat batch: a row is the sequence's own
    # past its prefix; its keys are the prefix's rows, then its own computed rows.
    shared = np.array([len(p[1]) if p else 0 for p in prefix_of])
    own = lens - shared
    at = np.arange(len(flat)) - np.repeat(flat_starts[:-1], lens)  # position in its sequence
    shared_of_row = np.repeat(shared, lens)
    mine = at >= shared_of_row
    first_own = total + row + np.concatenate([[0], np.cumsum(own)[:-1]])
    prefix_at = np.array([offsets[p] if p else 0 for p in prefix_of])
    keys = np.where(
        mine,
        np.repeat(first_own, lens) + at - shared_of_row,
        np.repeat(prefix_at, lens) + at,
    )
    ids.append(flat[mine])
    positions.append(at[mine])
    source.append(np.flatnonzero(mine))
    q_lens += own.tolist()
    k_lens += lens.tolist()
    kv_index.append(keys)
    pool_rows = row + np.cumsum(own) - 1
    index = np.concatenate(kv_index).astype(np.int64)
    return SegmentPlan(
        input_ids=np.concatenate(ids).astype(np.int64),
        positions=np.concatenate(positions).astype(np.int64),
        layout=AttentionLayout.build(q_lens, k_lens, index, device),
        kv_index=index,
        pool_rows=pool_rows,
        source=np.concatenate(source).astype(np.int64),
        used=used,
        new=new,
        received_tokens=len(flat),
        prefixes=[entry_of[p] if p else None for p in prefix_of],
    )


@dataclass(frozen=True)
class AdapterRows:
    """Which adapter each row of a forward adds to its linear layers (lora.py): runs
    (adapter, start, stop) over the computed rows, and over the pooled rows, which the pruned
    last layer computes beyond keys/values; rows of no run add none. A layer's row count tells
    which: where the counts are equal every sequence computes one row, its pooled one, in
    sequence order both ways, so the runs agree."""

    computed: tuple[tuple[int, int, int], ...]
    pooled: tuple[tuple[int, int, int], ...]
    num_computed: int
    num_pooled: int

    @classmethod
    def of(cls, computed: np.ndarray, pooled: np.ndarray) -> AdapterRows | None:
        """From each computed row's and each sequence's adapter (BASE: none); None where no
        row adds one."""
        if (pooled == BASE).all():
            return None
        return cls(_runs(computed), _runs(pooled), len(computed), len(pooled))

    def runs(self, rows: int) -> tuple[tuple[int, int, int], ...]:
        if rows == self.num_computed:
            return self.computed
        if rows == self.num_pooled:
            return self.pooled
        raise ValueError(
            f"a linear layer of {rows} rows in a forward of {self.num_computed} computed and "
            f"{self.num_pooled} pooled rows: whose adapters are they?"
        )


def _runs(adapters: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    """(adapter, start, stop) of each run of equal adapters but BASE."""
    cuts = np.flatnonzero(np.diff(adapters)) + 1
    starts, stops = np.concatenate([[0], cuts]), np.concatenate([cuts, [len(adapters)]])
    return tuple(
        (int(adapters[a]), int(a), int(b))
        for a, b in zip(starts, stops, strict=True)
        if adapters[a] != BASE
    )


@dataclass(frozen=True)
class ReadoutSegments:
    """Late chunking's read-out segments (chunking.py) as a recurrent layer reads them: a
    forward's first `texts` segments are its texts' own rows, and each later segment goes on
    from text `text[i]` after its first `end[i]` rows (its chunk's end)."""

    texts: int
    text: np.ndarray  # int64 [read-out segments]
    end: np.ndarray


@dataclass
class ForwardContext:
    """Everything a forward needs besides the weights: the rows to compute, how they attend,
    and (pruning) which rows the last layer computes beyond keys/values."""

    batch: VarlenBatch  # the computed rows: ids and true positions
    layout: AttentionLayout
    last: AttentionLayout | None  # None: the last layer computes every row
    last_rows: torch.Tensor | None  # [n] rows the last layer keeps, in sequence order
    plan: SegmentPlan | None  # None: no prefix shared (a plain batch, or late chunking's)
    media: MediaForward | None = None  # the batch's images and video (media.py)
    adapters: AdapterRows | None = None  # the adapters rows add (lora.py); None: none
    readouts: ReadoutSegments | None = None  # late chunking's read-out segments, where any

    def keys(self, layer: int, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout):
        """Each segment's keys/values as `layout` reads them: gathered where its segments
        share rows (prefixes, cached or computed here; late chunking's read-outs)."""
        if self.plan is not None:
            self.plan.store(layer, k, v)
            return self.plan.gather(layer, k, v, layout)
        if layout.kv_index is None:
            return k, v
        return k.index_select(0, layout.kv_index), v.index_select(0, layout.kv_index)

    @property
    def received_tokens(self) -> int:
        return self.plan.received_tokens if self.plan else self.batch.num_tokens

    @property
    def computed_tokens(self) -> int:
        return self.batch.num_tokens


class Planner:
    """One per model shard (every TP rank has its own, fed the same batches): the prefix cache
    and the switches. `prefix_reuse` needs causal attention and last-token pooling; `prune`
    needs last-token pooling; `readout` (late chunking reads chunks out at the appended
    tokens, chunking.py): causal attention and last-token pooling."""

    def __init__(
        self,
        *,
        prefix_reuse: bool,
        prune: bool,
        readout: bool,
        cache_bytes: int,
        bytes_per_token: int,
        num_layers: int,
        device: torch.device,
        bytes_per_entry: int = 0,
    ):
        self.prefix_reuse = prefix_reuse
        self.prune = prune
        self.readout = readout
        self.device = device
        self.cache = PrefixCache(cache_bytes, bytes_per_token, num_layers, bytes_per_entry)

    def plan(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        every_row: bool = False,
        media: MediaForward | None = None,
        adapters: np.ndarray | None = None,
    ) -> ForwardContext:
        """A flat host batch (batch.flatten's form, what every TP rank holds) -> what the
        forward computes; `every_row`: the final hidden states of every token (per-token
        vectors), so neither a shared prefix nor the last layer is skipped. With `media` a
        shared prefix ends before a text's first visual. `adapters`: each sequence's (lora.py,
        BASE for none; None: none at all)."""
        plan = None
        if self.prefix_reuse and not every_row:
            bounds = cu_seqlens.tolist()
            starts = None if media is None else media.visual_starts(bounds)
            flat = input_ids.numpy()
            plan = plan_segments(flat, bounds, self.cache, self.device, starts, adapters)
        rows_of = None
        if adapters is not None:
            lens = np.diff(cu_seqlens.numpy())
            per_row = np.repeat(adapters, lens)
            rows_of = AdapterRows.of(per_row if plan is None else per_row[plan.source], adapters)
        if plan is None:  # nothing shared: the plain varlen batch
            batch = VarlenBatch.from_flat(input_ids, cu_seqlens, self.device)
            layout = AttentionLayout.for_batch(batch)
            if not self.prune or every_row:
                return ForwardContext(batch, layout, None, None, None, media, rows_of)
            last = AttentionLayout.for_batch(batch, last_only=True)
            rows = batch.cu_seqlens[1:].long() - 1
            return ForwardContext(batch, layout, last, rows, None, media, rows_of)
        batch = VarlenBatch.from_rows(
            plan.input_ids, plan.positions, plan.layout.q_lens, self.device
        )
        last = plan.last_layout(self.device) if self.prune else None
        rows = to_device(torch.from_numpy(plan.pool_rows), self.device)
        media = None if media is None else media.computed(plan.source)
        return ForwardContext(batch, plan.layout, last, rows, plan, media, rows_of)

    def commit(self, ctx: ForwardContext) -> None:
        if ctx.plan is not None:
            ctx.plan.commit(self.cache)
