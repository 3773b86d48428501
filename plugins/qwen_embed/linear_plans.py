"""The plan of a forward's Qwen3.5 linear-attention layers (models/qwen3_5.py): its sequences
from empty states (gated_delta.SequencePlan), or going on from prefixes' states (`PrefixSteps`:
shared prefixes, late chunking's read-outs)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .gated_delta import SequencePlan
from .segments import ForwardContext, PrefixEntry, ReadoutSegments, SegmentPlan


def _plan_of(lengths, device, cuts=()) -> SequencePlan:
    return SequencePlan.build(torch.from_numpy(np.cumsum([0, *lengths])), device, cuts)


@dataclass(frozen=True)
class PrefixSteps:
    """A forward whose sequences go on from prefixes (segments.SegmentPlan's shared prefixes;
    late chunking's read-outs, each after its text up to its chunk's end) as a linear-attention
    layer computes it, in two passes: the rows [0, prefix_rows) as sequences from empty states
    (`prefixes` their plan, its cuts where the states the second pass reads are exported),
    then every other sequence's rows (`own`), each from its prefix's state (`start`: its row
    of [an empty state, the cached prefixes' states, the exported ones]). A sequence's
    convolution reaches back into its prefix's last kernel - 1 inputs (all of a shorter
    prefix's): it reads the rows `conv_rows` of [the cached prefixes' kept inputs, this
    forward's], at `conv_position`, and keeps `conv_own` of them. `new`: the prefixes computed
    here for the cache (entry, its rows' end), their final states the first exports."""

    prefix_rows: int
    prefixes: SequencePlan | None
    own: SequencePlan
    new: tuple[tuple[PrefixEntry, int], ...]
    cached: tuple[PrefixEntry, ...]
    start: torch.Tensor
    conv_rows: torch.Tensor
    conv_position: torch.Tensor
    conv_own: torch.Tensor

    @classmethod
    def build(cls, plan: SegmentPlan, kernel: int, device) -> PrefixSteps:
        """A forward sharing prefixes: the new ones computed first, cut at their ends."""
        reach = kernel - 1
        new = [(entry, row + len(entry.ids)) for entry, row in plan.new]
        cached = list(plan.used)
        bank = {id(e): 1 + i for i, e in enumerate(cached + [e for e, _ in new])}
        kept = {id(e): i * reach for i, e in enumerate(cached)}  # where their inputs lie
        base = len(cached) * reach  # this forward's rows, after the cached inputs
        kept.update((id(e), base + end - reach) for e, end in new)
        lens = [len(e.ids) for e, _ in new]
        return cls._of(
            lens,
            list(enumerate(lens)),
            plan.layout.q_lens[len(new) :],
            [0 if e is None else bank[id(e)] for e in plan.prefixes],
            [0 if e is None else kept[id(e)] for e in plan.prefixes],
            [0 if e is None else reach for e in plan.prefixes],
            base,
            new,
            cached,
            device,
        )

    @classmethod
    def for_readouts(cls, q_lens, readouts: ReadoutSegments, kernel: int, device) -> PrefixSteps:
        """Late chunking's forward: the texts' rows first, cut at their chunks' ends, then each
        read-out segment from its text's state there."""
        texts = q_lens[: readouts.texts]
        text_start = np.cumsum([0, *texts])[:-1]
        back = np.minimum(kernel - 1, readouts.end)
        return cls._of(
            texts,
            list(zip(readouts.text, readouts.end, strict=True)),
            q_lens[readouts.texts :],
            1 + np.arange(len(readouts.end)),
            text_start[readouts.text] + readouts.end - back,
            back,
            0,
            (),
            (),
            device,
        )

    @classmethod
    def _of(cls, first_lens, cuts, own_lens, start, back_at, back, base, new, cached, device):
        """From the first pass's sequence lengths and cuts, and per other sequence: its length,
        its start state, where its prefix's last inputs lie and how many it reads."""
        prefix_rows = int(sum(first_lens))
        own_lens, back, back_at = (np.asarray(a, dtype=np.int64) for a in (own_lens, back, back_at))
        own_starts = base + prefix_rows + np.cumsum([0, *own_lens[:-1]])
        # each sequence's segment of the convolution's rows: its prefix's inputs, then its own
        sizes = back + own_lens
        within = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        tail = within < np.repeat(back, sizes)
        rows = np.where(
            tail, np.repeat(back_at, sizes) + within, np.repeat(own_starts - back, sizes) + within
        )

        def tensor(a):
            return torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device)

        return cls(
            prefix_rows,
            _plan_of(first_lens, device, cuts) if prefix_rows else None,
            _plan_of(own_lens, device),
            tuple(new),
            tuple(cached),
            tensor(start),
            tensor(rows),
            tensor(np.where(tail, 0, within)),
            tensor(np.flatnonzero(~tail)),
        )


def linear_plan(ctx: ForwardContext, kernel: int) -> SequencePlan | PrefixSteps:
    """A forward's plan for its linear-attention layers."""
    layout, device = ctx.layout, ctx.layout.cu_q.device
    if ctx.plan is not None:
        return PrefixSteps.build(ctx.plan, kernel, device)
    if ctx.readouts is not None:
        return PrefixSteps.for_readouts(layout.q_lens, ctx.readouts, kernel, device)
    if layout.kv_index is not None or layout.q_lens != layout.k_lens:
        raise ValueError("linear attention reads whole sequences: keys must be each one's own")
    return SequencePlan.build(layout.cu_q_host, device)
