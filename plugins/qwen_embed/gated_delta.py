"""Qwen3.5's linear attention over a flat varlen batch: the causal depthwise convolution and the
gated delta rule, each sequence starting from an empty state.

The gated delta rule keeps a state S [key dim, value dim] per head; at token t

    S = exp(g_t) S,   S = S + beta_t k_t (v_t - S^T k_t)^T,   o_t = S^T q_t

with q and k L2-normalised (q also scaled by 1/sqrt(key dim)). It is computed in chunks of
CHUNK tokens (the WY form of DeltaNet's papers): inside a chunk with matrix products and one
triangular solve, the state carried from chunk to chunk. Every sequence's chunks are batched
together: the intra-chunk work runs over all chunks at once, and the carry is one step per chunk
index, over the sequences that have a chunk there. All in fp32, as transformers computes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk at most (fla's and transformers' size)
L2_EPS = 1e-6


@dataclass(frozen=True)
class SequencePlan:
    """How a forward's rows fall into sequences and chunks; the same for every layer.

    `position` [T]: each row's place in its sequence (the convolution's causal mask);
    `chunks` [N, chunk]: the rows of each chunk, T (a zero row) past a sequence's end, ordered
    by chunk index, then by sequence, longest first, so that `steps` (start, count) slices the
    chunks of each index and their sequences are the first `count` states."""

    position: torch.Tensor
    chunks: torch.Tensor
    steps: tuple[tuple[int, int], ...]
    sequences: int
    chunk: int

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, device) -> SequencePlan:
        """From host cu_seqlens [n + 1]; chunks of CHUNK tokens, or of the longest sequence's
        length rounded up to 8 where all are shorter (short texts padded less)."""
        bounds = cu_seqlens.numpy().astype(np.int64)
        starts, lens = bounds[:-1], np.diff(bounds)
        total = int(bounds[-1])
        chunk = min(CHUNK, -(-int(lens.max()) // 8) * 8)
        counts = -(-lens // chunk)
        order = np.argsort(-counts, kind="stable")
        offsets = np.arange(chunk)
        rows, steps, at = [], [], 0
        for c in range(int(counts.max())):
            active = order[: int((counts > c).sum())]
            within = c * chunk + offsets
            valid = within[None, :] < lens[active, None]
            rows.append(np.where(valid, starts[active, None] + within[None, :], total))
            steps.append((at, len(active)))
            at += len(active)
        position = np.arange(total) - np.repeat(starts, lens)
        return cls(
            torch.from_numpy(position).to(device),
            torch.from_numpy(np.concatenate(rows)).to(device),
            tuple(steps),
            len(lens),
            chunk,
        )


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, plan: SequencePlan) -> torch.Tensor:
    """silu of the causal depthwise convolution of x [T, channels] by weight [channels, K]
    within each sequence (zeros before its first row), summed in fp32 and rounded once."""
    kernel = weight.shape[1]
    w = weight.float()
    out = x.float() * w[:, kernel - 1]
    for shift in range(1, kernel):
        if shift >= x.shape[0]:
            break
        seen = (plan.position[shift:] >= shift).unsqueeze(1)
        past = x[:-shift].float() * w[:, kernel - 1 - shift]
        out[shift:] += past * seen
    return F.silu(out.to(x.dtype))


def _l2_normalised(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _chunked(x: torch.Tensor, plan: SequencePlan) -> torch.Tensor:
    """Rows [T, ...] -> [N, heads, chunk, ...] by the plan's chunks (zeros past the ends)."""
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return padded[plan.chunks].transpose(1, 2).contiguous()


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    plan: SequencePlan,
) -> torch.Tensor:
    """The rule's outputs [T, value heads, value dim] in fp32, from q, k [T, key heads, key
    dim], v [T, value heads, value dim], the log decays g and the rates beta [T, value heads]."""
    repeat = v.shape[1] // k.shape[1]
    q = _l2_normalised(q.float()) * q.shape[-1] ** -0.5
    k = _l2_normalised(k.float())
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    q, k, v = (_chunked(t, plan) for t in (q, k, v.float()))  # [N, H, C, d]
    g, beta = (_chunked(t.float(), plan) for t in (g, beta))  # [N, H, C]
    cum = g.cumsum(-1)
    lower = torch.ones(plan.chunk, plan.chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    # (I + strictly lower (beta k k^T decay)) solved against the rates' values and keys
    system = (k_beta @ k.transpose(-1, -2)) * decay
    rates = torch.cat([v * beta.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rates, upper=False, unitriangular=True)
    values, keys = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    inside = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_decayed = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    # The carry: a sequence's first chunk reads no state, its last writes none (a text of one
    # chunk, most of an embedding batch's, has no carry at all)
    state = q.new_empty(plan.sequences, q.shape[1], q.shape[-1], v.shape[-1])
    out = torch.empty_like(values)
    for step, (start, count) in enumerate(plan.steps):
        at = slice(start, start + count)
        if step == 0:
            fresh = values[at]
            out[at] = inside[at] @ fresh
        else:
            s = state[:count]
            fresh = values[at] - keys[at] @ s
            out[at] = q_decayed[at] @ s + inside[at] @ fresh
        going_on = plan.steps[step + 1][1] if step + 1 < len(plan.steps) else 0
        if going_on:
            ahead = slice(start, start + going_on)
            written = k_decayed[ahead].transpose(-1, -2) @ fresh[:going_on]
            if step > 0:
                written += state[:going_on] * chunk_decay[ahead]
            state[:going_on] = written
    total, heads, width = plan.position.shape[0], out.shape[1], out.shape[-1]
    result = out.new_empty(total + 1, heads, width)  # the last row takes the padding
    result[plan.chunks.reshape(-1)] = out.transpose(1, 2).reshape(-1, heads, width)
    return result[:total]
