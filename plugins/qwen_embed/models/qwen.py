"""Qwen2 / Qwen3 decoder stack over a flat varlen token stream.

One implementation for both families: the differences (q/k/v bias, per-head q/k RMSNorm,
head_dim, causal or bidirectional) are flags on ModelConfig. Module names follow Hugging Face
so checkpoint keys map with the small PACKED_MODULES table.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention import AttentionBackend
from ..config import ModelConfig
from ..kernels import RowOps, reference
from ..layers import (
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    SplitProjection,
    TPGroup,
    VocabParallelEmbedding,
    rotary_cos_sin,
    shard_groups,
)
from ..segments import AttentionLayout, ForwardContext, Planner

# checkpoint module name -> (our packed module, shard id)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def check_tp_split(config: ModelConfig, tp_size: int) -> None:
    """Raise a clear error when the heads or MLP cannot be split tp_size ways."""
    problems = []
    if config.num_heads % tp_size:
        problems.append(f"num_attention_heads={config.num_heads}")
    kv = config.num_kv_heads
    if (kv % tp_size) if tp_size <= kv else (tp_size % kv):
        problems.append(f"num_key_value_heads={kv}")
    if config.intermediate_size % tp_size:
        problems.append(f"intermediate_size={config.intermediate_size}")
    if problems:
        raise ValueError(f"tp_size={tp_size} does not divide " + ", ".join(problems))


def qkv_projection(config: ModelConfig, tp: TPGroup, query_width: int) -> ColumnParallelLinear:
    """The packed q|k|v projection: `query_width` values per query head (Qwen3.5's gated
    attention: its queries, then as many gate values); key/value heads replicated where there
    are fewer of them than ranks."""
    d, kv_parts = config.head_dim, min(tp.size, config.num_kv_heads)
    return ColumnParallelLinear(
        config.hidden_size,
        {
            "q": config.num_heads * query_width,
            "k": config.num_kv_heads * d,
            "v": config.num_kv_heads * d,
        },
        tp,
        bias=config.has_qkv_bias,
        shard_parts={"k": kv_parts, "v": kv_parts},
    )


def qkv_groups(apart: dict[str, tuple[str, ...]], pruned: bool) -> tuple[tuple[str, ...], ...]:
    """An attention layer's q|k|v cut around its shards in apart["qkv_proj"], and around q in
    the pruned layer (which projects q for the pooled rows only)."""
    return shard_groups(
        ("q", "k", "v"), set(apart.get("qkv_proj", ())) | ({"q"} if pruned else set())
    )


class QwenAttention(SplitProjection):
    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup,
        backend: AttentionBackend,
        layer_index: int,
        ops: RowOps = reference,
    ):
        super().__init__()
        self.layer_index = layer_index  # where a shared prefix's keys/values are kept
        d = config.head_dim
        self.num_heads = config.num_heads // tp.size
        # kv heads are replicated when there are fewer of them than ranks
        self.num_kv_heads = max(1, config.num_kv_heads // tp.size)
        self.head_dim = d
        self.qkv_proj = qkv_projection(config, tp, d)
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, tp)
        if config.has_qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.has_qk_norm = config.has_qk_norm
        self.eps = config.rms_norm_eps
        self.ops = ops
        self.backend = backend
        self.widths = dict(self.qkv_proj.local)  # this rank's width of each shard
        self._projections(("q", "k", "v"))

    def _project(
        self, x: torch.Tensor, rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (of `rows` only, when given), k and v of x."""
        out = self.shards(x, rows, alone=("q",))
        return out["q"], out["k"], out["v"]

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q [t, heads, d] (of `rows` only, when given), k and v [T, kv heads, d]: the
        token-wise half of attention (no batch layout needed: CUDA graphs capture it)."""
        t, d = x.shape[0], self.head_dim
        q, k, v = self._project(x, rows)
        cos_q, sin_q = (cos, sin) if rows is None else (cos[rows], sin[rows])
        q_norm, k_norm = (
            (self.q_norm.weight, self.k_norm.weight) if self.has_qk_norm else (None, None)
        )
        q = self.ops.norm_rotary(q, cos_q, sin_q, d, q_norm, self.eps)
        k = self.ops.norm_rotary(k, cos, sin, d, k_norm, self.eps)
        return q, k, v.reshape(t, self.num_kv_heads, d)  # v: a view of the q|k|v rows

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        layout: AttentionLayout,
    ) -> torch.Tensor:
        """The attention output [t, heads * d] before the output projection."""
        k, v = ctx.keys(self.layer_index, k, v, layout)
        out = self.backend.forward(q, k, v, layout)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
        layout: AttentionLayout,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Keys/values for every row; queries (and the output) only for `rows` if given."""
        q, k, v = self.project(x, cos, sin, rows)
        return self.o_proj(self.attend(q, k, v, ctx, layout))


class QwenMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, ops: RowOps = reference):
        super().__init__()
        self.ops = ops
        n = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, {"gate": n, "up": n}, tp, bias=False
        )
        self.down_proj = RowParallelLinear(n, config.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_gated(x, self.ops))


class QwenDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup,
        backend: AttentionBackend,
        index: int,
        ops: RowOps = reference,
    ):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, ops)
        self.self_attn = QwenAttention(config, tp, backend, index, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, ops)
        self.mlp = QwenMLP(config, tp, ops)

    def before_attention(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v, the residual stream) from the previous layer's (MLP output, residual)
        (the embeddings and None in the first layer). Each residual add is fused into the norm
        after it and lands in the fresh sublayer output: no new activation-sized tensors."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        return *self.self_attn.project(x, cos, sin, rows), residual

    def after_attention(
        self, attn: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it) from the attention output."""
        x, residual = self.post_attention_layernorm(
            self.self_attn.o_proj(attn), residual if rows is None else residual[rows]
        )
        return self.mlp(x), residual

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
        layout: AttentionLayout,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, residual = self.before_attention(x, residual, cos, sin, rows)
        attn = self.self_attn.attend(q, k, v, ctx, layout)
        return self.after_attention(attn, residual, rows)


class QwenModel(nn.Module):
    """Token ids [T] -> final-norm hidden states [T, hidden] (`final`); no lm_head.

    `planner` turns batches into forward contexts for this shard (segments.Planner);
    `head` (rank 0) turns pooled hidden states into scores or projected vectors (heads.py);
    `ops` is the route's row-op table (kernels/)."""

    packed_modules = PACKED_MODULES

    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup,
        backend: AttentionBackend,
        planner: Planner,
        head: nn.Module | None = None,
        ops: RowOps = reference,
    ):
        super().__init__()
        check_tp_split(config, tp.size)
        self.config = config
        self.backend = backend
        self.planner = planner
        self.head = head
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            QwenDecoderLayer(config, tp, backend, i, ops) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.graphs = None  # cuda_graphs.TokenGraphs, where the route captures them
        self.visual = None  # a multimodal checkpoint's vision tower (engine.build_model sets it)
        self.adapters = None  # lora.AdapterSwitch where a request may name an adapter

    def split_qkv(self, index: int, apart: dict[str, tuple[str, ...]], prune: bool) -> None:
        """Before layer `index`'s weights are repacked: its q|k|v projection cut where the
        route needs. The shards in apart["qkv_proj"] go to layers of their own
        (int8.FLOAT_SHARDS: in floats beside the int8 rest); where the forwards prune
        (ctx.last), the last layer projects q for the pooled rows only (q is half of q|k|v's
        work in Qwen3-Embedding's shapes)."""
        groups = qkv_groups(apart, prune and index == len(self.layers) - 1)
        if len(groups) > 1:
            self.layers[index].self_attn.split_projection(*groups)

    @torch.inference_mode()
    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        """Final-norm hidden states of the computed rows [T, hidden], or with last-layer
        pruning (ctx.last) of the pooled rows only [n, hidden], in sequence order."""
        if self.adapters is not None:
            self.adapters.rows = ctx.adapters
        # the graphs hold the base weights' forward: one with adapters runs eagerly
        graphs = self.graphs if ctx.media is None and ctx.adapters is None else None
        if graphs is not None and (hidden := graphs.forward(ctx)) is not None:
            return hidden
        self.backend.prepare(ctx.layout)
        if ctx.last is not None:
            self.backend.prepare(ctx.last)
        x, cos, sin = self.stem(ctx.batch.input_ids, ctx.batch.positions, ctx.media)
        return self.layers_from(0, x, None, cos, sin, ctx)

    def stem(self, input_ids: torch.Tensor, positions: torch.Tensor, media=None):
        """(embeddings, rotary cos, sin) of the rows; with `media` (media.MediaForward) the
        visuals' tokens at their placeholders and rotary on three axes."""
        x = self.embed_tokens(input_ids)
        head_dim, theta = self.config.head_dim, self.config.rope_theta
        if media is None:
            return x, *rotary_cos_sin(positions, head_dim, theta, x.dtype)
        section, interleaved = media.config.mrope_section, media.config.mrope_interleaved
        cos_sin = rotary_cos_sin(media.positions, head_dim, theta, x.dtype, section, interleaved)
        return media.embed(self.visual, x, self.embed_tokens.tp), *cos_sin

    def layers_from(self, first: int, x, residual, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        """The layers from `first` on and the final norm (the last layer pruned where ctx says)."""
        last = len(self.layers) - 1
        for i in range(first, last + 1):
            if i == last and ctx.last is not None:  # the pooled rows only: no visual tokens
                x, residual = self.layers[i](x, residual, cos, sin, ctx, ctx.last, ctx.last_rows)
            else:
                x, residual = self.layers[i](x, residual, cos, sin, ctx, ctx.layout)
                if ctx.media is not None:
                    x = ctx.media.after_layer(i, x)
        return self.final(x, residual)

    def final(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The model's output from the last layer's (x, residual): the final norm of their sum,
        or the sum itself where the checkpoint's vectors precede the norm (config.final_norm)."""
        return self.norm(x, residual)[0] if self.config.final_norm else x + residual
