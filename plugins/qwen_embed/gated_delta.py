"""Qwen3.5's linear attention over a flat varlen batch: the gated delta rule, each sequence
from an empty state or a given one (a prefix's: linear_plans.py), and the plan of its
sequences (its causal convolution is a row op: kernels/).

The gated delta rule keeps a state S [key dim, value dim] per head; at token t

    S = exp(g_t) S,   S = S + beta_t k_t (v_t - S^T k_t)^T,   o_t = S^T q_t

with q and k L2-normalised (q also scaled by 1/sqrt(key dim)). It is computed in chunks of
CHUNK tokens (the WY form of DeltaNet's papers): inside a chunk with matrix products and
triangular solves, the state carried from chunk to chunk. Every sequence's chunks are batched
together: the intra-chunk work runs over all chunks at once, and the carry is one step per chunk
index, over the sequences that have a chunk there. All in fp32, as transformers computes it.
This chunked form is the reference and what a GPU runs (kernels/: the tables' gated_delta_rule);
the native CPU table runs the per-token recurrence instead (native/csrc/delta_rule.h).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

CHUNK = 64  # tokens per chunk at most (fla's and transformers' size)
L2_EPS = 1e-6


@dataclass(frozen=True)
class SequencePlan:
    """How a forward's rows fall into sequences and chunks; the same for every layer.

    `position` [T]: each row's place in its sequence (the convolution's causal mask);
    `chunks` [N, chunk]: the rows of each chunk, ordered by chunk index, then by sequence,
    longest first (`order`: the sequences so), so that `steps` (start, count) slices the
    chunks of each index and their sequences are the first `count` states; `chunk_of`,
    `offset` [T]: where each row lies in them. A chunk short of `chunk` rows (a sequence's
    last, or one ending at a cut) repeats its last row (no zero row appended to every input),
    `valid` false there: those slots get no decay and no rate, so they change no state, and
    the rule is causal within a chunk, so they reach no row. `exports`: per step with cuts,
    (the states it must write, their rows, the cuts' slots); `cuts` their count.
    `cu_seqlens` and `cut_rows` (each cut's last row), int64 on the host: the sequences and
    cuts as a recurrence over rows (the native CPU kernel) reads them."""

    position: torch.Tensor
    chunks: torch.Tensor
    chunk_of: torch.Tensor
    offset: torch.Tensor
    order: torch.Tensor
    valid: torch.Tensor
    steps: tuple[tuple[int, int], ...]
    sequences: int
    chunk: int
    cu_seqlens: torch.Tensor
    cut_rows: torch.Tensor
    exports: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    cuts: int = 0

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, device, cuts=()) -> SequencePlan:
        """From host cu_seqlens [n + 1]; chunks of CHUNK tokens, or of the longest piece's
        length rounded up to 8 where all are shorter (short texts padded less). `cuts`
        (sequence, rows) pairs: a chunk ends after each sequence's first `rows` rows, and the
        rule exports the state there (gated_delta_rule's `exports`, in the cuts' order)."""
        bounds = cu_seqlens.numpy().astype(np.int64)
        starts, lens = bounds[:-1], np.diff(bounds)
        cut = np.asarray(cuts, dtype=np.int64).reshape(-1, 2)
        cut_ends = starts[cut[:, 0]] + cut[:, 1]
        # pieces: each sequence cut at its cuts; chunks: each piece's rows, chunk at a time
        ends = np.union1d(bounds[1:], cut_ends)
        piece_len = np.diff(ends, prepend=0)
        chunk = min(CHUNK, -(-int(piece_len.max()) // 8) * 8)
        per_piece = -(-piece_len // chunk)
        piece = np.repeat(np.arange(len(ends)), per_piece)
        within = np.arange(len(piece)) - np.repeat(np.cumsum(per_piece) - per_piece, per_piece)
        first = ends[piece] - piece_len[piece] + within * chunk
        size = np.minimum(chunk, ends[piece] - first)
        seq = np.searchsorted(bounds[1:], ends)[piece]
        counts = np.bincount(seq, minlength=len(lens))
        index = np.arange(len(seq)) - np.repeat(np.cumsum(counts) - counts, counts)
        order = np.argsort(-counts, kind="stable")
        rank = np.empty_like(order)  # each sequence's place in every step
        rank[order] = np.arange(len(order))
        active = np.bincount(index)  # sequences with a chunk at each index
        step_start = np.cumsum(active) - active
        slot = step_start[index] + rank[seq]  # each chunk's place among the plan's
        offsets = np.arange(chunk)
        rows = np.empty((len(seq), chunk), dtype=np.int64)
        rows[slot] = np.minimum(first[:, None] + offsets, (first + size - 1)[:, None])
        valid = np.empty((len(seq), chunk), dtype=bool)
        valid[slot] = offsets < size[:, None]
        position = np.arange(bounds[-1]) - np.repeat(starts, lens)
        offset = np.arange(bounds[-1]) - np.repeat(first, size)

        def tensor(a):
            return torch.from_numpy(np.asarray(a)).to(device)

        exports = {}
        if len(cut_ends):
            at = np.searchsorted(first + size, cut_ends)  # the chunk each cut ends
            cut_step, cut_rank = index[at], rank[seq[at]]
            for step in np.unique(cut_step).tolist():
                chosen = np.flatnonzero(cut_step == step)
                states = cut_rank[chosen]
                exports[step] = (int(states.max()) + 1, tensor(states), tensor(chosen))
        return cls(
            *(tensor(a) for a in (position, rows, np.repeat(slot, size), offset, order, valid)),
            tuple(zip(step_start.tolist(), active.tolist(), strict=True)),
            len(lens),
            chunk,
            torch.from_numpy(bounds),
            torch.from_numpy(cut_ends - 1),
            exports,
            len(cut_ends),
        )


def _chunked(x: torch.Tensor, plan: SequencePlan) -> torch.Tensor:
    """Rows [T, heads, ...] -> [N, heads, chunk, ...] in fp32 by the plan's chunks (one gather,
    one converting copy)."""
    rows = x[plan.chunks]  # [N, chunk, heads, ...]
    out = torch.empty(rows.shape[0], rows.shape[2], rows.shape[1], *rows.shape[3:], device=x.device)
    return out.copy_(rows.transpose(1, 2))


def _l2_normalised_(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    inverse = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().add_(L2_EPS).rsqrt_()
    return x.mul_(inverse.mul_(scale) if scale != 1.0 else inverse)


def _solved(system: torch.Tensor, rates: torch.Tensor) -> torch.Tensor:
    """(I + strictly lower system)^-1 rates, per chunk and head."""
    return torch.linalg.solve_triangular(system, rates, upper=False, unitriangular=True)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    plan: SequencePlan,
    states: torch.Tensor | None = None,
    exports: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rule's outputs [T, value heads, value dim] in fp32, from q, k [T, key heads, key
    dim], v [T, value heads, value dim] (rows may be strided), the log decays g and the rates
    beta [T, value heads]. `states` [n, value heads, key dim, value dim] (fp32), where given:
    each sequence's state before its first row (its prefix's); None: every sequence starts
    from an empty state. `exports` [the plan's cuts, value heads, key dim, value dim] (fp32),
    where the plan has cuts: filled with the state at each."""
    repeat = v.shape[1] // k.shape[1]
    q = _l2_normalised_(_chunked(q, plan), q.shape[-1] ** -0.5)  # [N, H, C, d]
    k = _l2_normalised_(_chunked(k, plan))
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    v = _chunked(v, plan)
    past_end = ~plan.valid.unsqueeze(1)
    g, beta = (_chunked(t, plan).masked_fill_(past_end, 0.0) for t in (g, beta))  # [N, H, C]
    cum = g.cumsum(-1)
    lower = torch.ones(plan.chunk, plan.chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill_(~lower, float("-inf")).exp_()
    k_beta = k * beta.unsqueeze(-1)
    system = torch.matmul(k_beta, k.transpose(-1, -2)).mul_(decay)
    values = _solved(system, v.mul_(beta.unsqueeze(-1)))
    inside = torch.matmul(q, k.transpose(-1, -2)).mul_(decay)
    # The carry: without states a sequence's first chunk reads none (the first steps[0][1]
    # chunks) and its last writes none; a text of one chunk, most of an embedding batch's,
    # has no carry at all
    first = plan.steps[0][1] if states is None else 0
    out = values.new_empty(values.shape)
    torch.matmul(inside[:first], values[:first], out=out[:first])
    if len(plan.steps) > 1 or states is not None or plan.cuts:
        _carry(q, k, values, inside, cum, system, k_beta, out, plan, states, exports)
    return out[plan.chunk_of, :, plan.offset]


def _carry(q, k, values, inside, cum, system, k_beta, out, plan: SequencePlan, states, exports):
    """The chunks that read a state, one chunk index at a time: each reads the state its
    sequence's earlier chunks (or `states`) left; all but a sequence's last write it, and
    those ending at a cut too (copied to `exports`)."""
    first = plan.steps[0][1] if states is None else 0
    decayed = cum[first:].exp()
    keys = _solved(system[first:], k_beta[first:].mul_(decayed.unsqueeze(-1)))
    if states is None:
        state = q.new_empty(plan.sequences, k.shape[1], k.shape[-1], values.shape[-1])
    else:
        state = states[plan.order]  # in the plan's order of sequences
    for step, (start, count) in enumerate(plan.steps):
        at = slice(start, start + count)
        if step == 0 and states is None:
            fresh = values[at]
        else:
            later = slice(start - first, start - first + count)
            s = state[:count]
            fresh = values[at] - keys[later] @ s
            q_decayed = q[at] * decayed[later].unsqueeze(-1)
            out[at] = q_decayed @ s + inside[at] @ fresh
        going_on = plan.steps[step + 1][1] if step + 1 < len(plan.steps) else 0
        cut = plan.exports.get(step)
        writes = going_on if cut is None else max(going_on, cut[0])
        if writes:
            ahead = slice(start, start + writes)
            to_end = (cum[ahead, :, -1:] - cum[ahead]).exp().unsqueeze(-1)
            written = (k[ahead] * to_end).transpose(-1, -2) @ fresh[:writes]
            if step > 0 or states is not None:
                written += state[:writes] * cum[ahead, :, -1].exp()[..., None, None]
            state[:writes] = written
        if cut is not None:
            exports[cut[2]] = state[cut[1]]
