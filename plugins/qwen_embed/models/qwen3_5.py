"""Qwen3.5's text model over a flat varlen token stream: linear-attention layers (Gated
DeltaNet, gated_delta.py) between full-attention ones, as config.json's `layer_types` says.

What differs from Qwen3 (models/qwen.py), each here once:
- full attention is gated: q_proj gives each head its queries and as many gate values, and the
  attention's output is multiplied by their sigmoid before o_proj; rotary turns the first
  `rotary_dim` values of a head only;
- every RMSNorm but the linear attention's output norm scales by (1 + weight), in fp32
  (`CenteredRMSNorm`);
- a linear-attention layer projects its rates b and decays a, q|k|v (through a causal
  convolution) and its output gate z in one GEMM (`in_proj`), runs the gated delta rule per
  sequence and RMS-normalises each head's output, gated by silu(z), before `out_proj`.
A shared prefix (segments.py) keeps, in a linear-attention layer, its final state and its last
convolution inputs (linear_plans.PrefixSteps) where full attention keeps keys and values; a
late-chunking read-out goes on from its text's state at its chunk's end, the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend
from ..config import LinearAttentionSpec, ModelConfig
from ..gated_delta import SequencePlan
from ..kernels import RowOps, reference
from ..layers import (
    ColumnParallelLinear,
    LowRank,
    RMSNorm,
    RowParallelLinear,
    SplitProjection,
    TPGroup,
    VocabParallelEmbedding,
    copy_exact,
    loaded_parameter,
    rank_slice,
    replicated_loader,
    rotary_cos_sin,
    shard_groups,
)
from ..linear_plans import PrefixSteps, linear_plan
from ..segments import AttentionLayout, ForwardContext, Planner
from .qwen import PACKED_MODULES as QWEN_PACKED
from .qwen import QwenMLP, check_tp_split, qkv_groups, qkv_projection

# checkpoint module name -> (our packed module, shard id); in_proj_qkv is itself q|k|v
PACKED_MODULES = {
    **QWEN_PACKED,
    "in_proj_qkv": ("in_proj", "qkv"),
    "in_proj_z": ("in_proj", "z"),
    "in_proj_b": ("in_proj", "b"),
    "in_proj_a": ("in_proj", "a"),
}
PLAN = "gated_delta"  # the layout's state entry holding its SequencePlan


def _centered_loader(param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
    copy_exact(param, full.float() + 1.0)


class CenteredRMSNorm(RMSNorm):
    """Qwen3.5's RMSNorm, which scales by (1 + weight) in fp32, rounded once: the one is added
    to the weight as it loads, kept in fp32 (rounded to 16 bits, 1 + weight would lose weight's
    low bits), which the row-op tables scale by in fp32."""

    def __init__(self, dim: int, eps: float, ops: RowOps = reference):
        super().__init__(dim, eps, ops)
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = _centered_loader


def _split_qkv(full: torch.Tensor, sizes: list[int], parts: int, rank: int) -> torch.Tensor:
    """This rank's rows of a q|k|v tensor packed along dim 0: its slice of each of the three."""
    return torch.cat([rank_slice(t, 0, rank, parts) for t in full.split(sizes)])


# in_proj's shards in order: those the int8 route keeps in floats (int8.FLOAT_SHARDS) first,
# so that it cuts the projection once, and q|k|v (the convolution's) in a row
IN_SHARDS = ("b", "a", "q", "k", "v", "z")
CONV_SHARDS = ("q", "k", "v")


class InProjection(ColumnParallelLinear):
    """b|a|q|k|v|z of a linear-attention layer in one GEMM; the checkpoint's in_proj_qkv fills
    three shards at once."""

    def __init__(self, hidden: int, spec: LinearAttentionSpec, tp: TPGroup):
        k, v, h = spec.key_dim, spec.value_dim, spec.value_heads
        widths = {"b": h, "a": h, "q": k, "k": k, "v": v, "z": v}
        sizes = {shard: widths[shard] for shard in IN_SHARDS}
        super().__init__(hidden, sizes, tp, bias=False)

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id != "qkv":
            return super()._load(param, full, shard_id)
        for shard, part in self._qkv_parts(full):
            super()._load(param, part, shard)

    def lora_pair(self, pairs: dict[str | None, LowRank]) -> LowRank:
        """As ColumnParallelLinear's, an in_proj_qkv pair taken as one per shard (A each)."""
        if "qkv" in pairs:
            pairs = dict(pairs)
            a, b = pairs.pop("qkv")
            pairs |= {shard: (a, part) for shard, part in self._qkv_parts(b)}
        return super().lora_pair(pairs)

    def _qkv_parts(self, full: torch.Tensor):
        """(shard, its rows) of a checkpoint tensor holding q|k|v's whole rows."""
        sizes = [self.local[s] * self.parts[s] for s in CONV_SHARDS]
        return zip(CONV_SHARDS, full.split(sizes), strict=True)


class GatedDeltaNet(SplitProjection):
    """A linear-attention layer (transformers' Qwen3_5GatedDeltaNet), its heads split across
    tensor-parallel ranks."""

    packed = "in_proj"

    def __init__(self, config: ModelConfig, tp: TPGroup, layer_index: int, ops: RowOps = reference):
        super().__init__()
        spec = config.linear_attention
        self.layer_index = layer_index  # where a shared prefix's entry keeps its state
        self.ops = ops
        self.key_heads = spec.key_heads // tp.size
        self.value_heads = spec.value_heads // tp.size
        self.key_head_dim, self.value_head_dim = spec.key_head_dim, spec.value_head_dim
        self.in_proj = InProjection(config.hidden_size, spec, tp)
        self.widths = dict(self.in_proj.local)
        self._projections(IN_SHARDS)
        sizes = [spec.key_dim, spec.key_dim, spec.value_dim]
        channels = sum(sizes) // tp.size

        def conv_loader(param, full, shard_id=None):  # [channels, 1, K] as q|k|v
            copy_exact(param, _split_qkv(full.squeeze(1), sizes, tp.size, tp.rank))

        def head_loader(param, full, shard_id=None):
            copy_exact(param, rank_slice(full, 0, tp.rank, tp.size))

        self.conv1d = nn.Module()
        self.conv1d.weight = loaded_parameter(channels, spec.conv_kernel, loader=conv_loader)
        self.A_log = loaded_parameter(self.value_heads, loader=head_loader)
        self.dt_bias = loaded_parameter(self.value_heads, loader=head_loader)
        self.norm = nn.Module()  # its output norm: plain weight, gated by silu(z)
        self.norm.weight = loaded_parameter(spec.value_head_dim, loader=replicated_loader)
        self.eps = config.rms_norm_eps
        self.out_proj = RowParallelLinear(spec.value_dim, config.hidden_size, tp)

    def forward(
        self,
        x: torch.Tensor,
        plan: SequencePlan | PrefixSteps,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output for every row of x, or for `rows` only (the recurrence still
        reads every row); with shared prefixes (PrefixSteps) their states kept for the texts
        that follow them (and the cache)."""
        qkv, z, b, a = self._project(x)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        beta = b.sigmoid()
        if isinstance(plan, SequencePlan):
            out = self._rule(qkv, plan.position, g, beta, plan)
        else:
            out = self._after_prefixes(qkv, g, beta, plan)
        t = x.shape[0]
        out = out.to(x.dtype)
        z = z.reshape(t, self.value_heads, self.value_head_dim)
        if rows is not None:
            out, z = out[rows], z[rows]
        # transformers' gated RMSNorm: normalised in fp32, rounded, weighted, gated in fp32
        out = self.ops.rms_norm(out, self.norm.weight, self.eps)
        out = (out.float() * F.silu(z.float())).to(x.dtype)
        return self.out_proj(out.reshape(out.shape[0], -1))

    def _project(self, x: torch.Tensor):
        """(q|k|v as one tensor, z, b, a) of x: q|k|v a view of the projection's output where
        one layer computes them, else its parts joined."""
        out, qkv = {}, []
        for group, widths, y in self.outputs(x):
            out.update(zip(group, y.split(widths, dim=-1), strict=True))
            inner = [i for i, shard in enumerate(group) if shard in CONV_SHARDS]
            if inner:
                start, width = sum(widths[: inner[0]]), sum(widths[i] for i in inner)
                qkv.append(y.narrow(-1, start, width))
        return (qkv[0] if len(qkv) == 1 else torch.cat(qkv, dim=-1)), out["z"], out["b"], out["a"]

    def _rule(
        self, qkv, position, g, beta, plan: SequencePlan, states=None, keep=None, exports=None
    ):
        """The convolution of the rows qkv at `position` (its rows `keep` of them), then the
        rule over them."""
        mixed = self.ops.causal_conv_silu(qkv, self.conv1d.weight, position)
        if keep is not None:
            mixed = mixed[keep]
        q, k, v = mixed.split([self.widths[s] for s in CONV_SHARDS], dim=-1)
        t = mixed.shape[0]
        return self.ops.gated_delta_rule(
            q.reshape(t, self.key_heads, self.key_head_dim),
            k.reshape(t, self.key_heads, self.key_head_dim),
            v.reshape(t, self.value_heads, self.value_head_dim),
            g,
            beta,
            plan,
            states,
            exports,
        )

    def _after_prefixes(self, qkv, g, beta, steps: PrefixSteps) -> torch.Tensor:
        """The prefixes computed here from empty states (the new shared prefixes' final
        states and last inputs kept in their entries), then the other sequences' rows from
        their prefixes' states."""
        shape = (self.value_heads, self.key_head_dim, self.value_head_dim)
        bank = [qkv.new_zeros(shape, dtype=torch.float32)]
        bank += [entry.kv[self.layer_index][0] for entry in steps.cached]
        outs, p = [], steps.prefix_rows
        if p:
            prefixes = steps.prefixes
            states = qkv.new_empty((prefixes.cuts, *shape), dtype=torch.float32)
            outs.append(
                self._rule(qkv[:p], prefixes.position, g[:p], beta[:p], prefixes, exports=states)
            )
            reach = self.conv1d.weight.shape[1] - 1
            for (entry, end), state in zip(steps.new, states[: len(steps.new)], strict=True):
                entry.kv[self.layer_index] = (state.clone(), qkv[end - reach : end].clone())
            bank += list(states)
        kept = [entry.kv[self.layer_index][1] for entry in steps.cached]
        source = torch.cat([*kept, qkv]) if kept else qkv
        states = torch.stack(bank).index_select(0, steps.start)
        rows, position = source.index_select(0, steps.conv_rows), steps.conv_position
        outs.append(self._rule(rows, position, g[p:], beta[p:], steps.own, states, steps.conv_own))
        return torch.cat(outs) if len(outs) > 1 else outs[0]


class GatedAttention(SplitProjection):
    """Full attention with an output gate per head value and rotary on `rotary_dim` values."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup,
        backend: AttentionBackend,
        layer_index: int,
        ops: RowOps = reference,
    ):
        super().__init__()
        self.layer_index = layer_index
        d = self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.num_heads = config.num_heads // tp.size
        self.num_kv_heads = max(1, config.num_kv_heads // tp.size)
        self.qkv_proj = qkv_projection(config, tp, 2 * d)  # each head's queries, then its gate
        self.widths = dict(self.qkv_proj.local)
        self._projections(("q", "k", "v"))
        self.q_norm = CenteredRMSNorm(d, config.rms_norm_eps, ops)
        self.k_norm = CenteredRMSNorm(d, config.rms_norm_eps, ops)
        self.backend = backend
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, tp)

    def _heads(self, x, norm: CenteredRMSNorm, cos, sin) -> torch.Tensor:
        """Normalised heads [T, heads, d], their first rotary_dim values rotated."""
        x = norm(x)
        r = self.rotary_dim
        if r == self.head_dim:
            return reference.rotary(x, cos, sin)
        return torch.cat([reference.rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
        layout: AttentionLayout,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        out = self.shards(x, rows, alone=("q",))
        q_gate, k, v = out["q"], out["k"], out["v"]
        q_gate = q_gate.reshape(q_gate.shape[0], self.num_heads, 2 * d)
        q, gate = q_gate[..., :d], q_gate[..., d:]
        cos_q, sin_q = (cos, sin) if rows is None else (cos[rows], sin[rows])
        q = self._heads(q, self.q_norm, cos_q, sin_q)
        k = self._heads(k.reshape(t, self.num_kv_heads, d), self.k_norm, cos, sin)
        k, v = ctx.keys(self.layer_index, k, v.reshape(t, self.num_kv_heads, d), layout)
        out = self.backend.forward(q, k, v, layout)
        out = out.reshape(q.shape[0], -1) * gate.reshape(q.shape[0], -1).sigmoid()
        return self.o_proj(out)


class HybridDecoderLayer(nn.Module):
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
        self.linear = config.linear_attention.layers[index]
        self.input_layernorm = CenteredRMSNorm(config.hidden_size, eps, ops)
        if self.linear:
            self.linear_attn = GatedDeltaNet(config, tp, index, ops)
        else:
            self.self_attn = GatedAttention(config, tp, backend, index, ops)
        self.post_attention_layernorm = CenteredRMSNorm(config.hidden_size, eps, ops)
        self.mlp = QwenMLP(config, tp, ops)

    def forward(self, x, residual, cos, sin, ctx: ForwardContext, last: bool):
        """(this layer's MLP output, the residual stream before it) from the previous layer's
        (the embeddings and None first); `last`: the pooled rows only, where ctx prunes."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        rows = ctx.last_rows if last and ctx.last is not None else None
        if self.linear:
            mixed = self.linear_attn(x, ctx.layout.state[PLAN], rows)
        else:
            layout = ctx.last if rows is not None else ctx.layout
            mixed = self.self_attn(x, cos, sin, ctx, layout, rows)
        x, residual = self.post_attention_layernorm(
            mixed, residual if rows is None else residual[rows]
        )
        return self.mlp(x), residual


class HybridModel(nn.Module):
    """Token ids [T] -> final-norm hidden states [T, hidden] (the pooled rows' only where
    ctx prunes); models/__init__.EmbeddingModel's interface."""

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
        spec = config.linear_attention
        if spec.key_heads % tp.size or spec.value_heads % tp.size:
            raise ValueError(
                f"tp_size={tp.size} does not divide linear_num_key_heads={spec.key_heads} "
                f"and linear_num_value_heads={spec.value_heads}"
            )
        self.config = config
        self.backend = backend
        self.planner = planner
        self.head = head
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, tp, backend, i, ops) for i in range(config.num_layers)
        )
        self.norm = CenteredRMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.graphs = None  # no CUDA graphs (route.py)
        self.visual = None  # a multimodal checkpoint's vision tower (engine.build_model sets it)
        self.adapters = None  # lora.AdapterSwitch where a request may name an adapter

    def split_qkv(self, index: int, apart: dict[str, tuple[str, ...]], prune: bool) -> None:
        """As QwenModel.split_qkv, and a linear-attention layer's in_proj cut around its shards
        in apart["in_proj"] (its convolution and rule read every row: none computed alone)."""
        layer = self.layers[index]
        if layer.linear:
            module = layer.linear_attn
            groups = shard_groups(IN_SHARDS, set(apart.get("in_proj", ())))
        else:
            last = index == len(self.layers) - 1
            module, groups = layer.self_attn, qkv_groups(apart, prune and last)
        if len(groups) > 1:
            module.split_projection(*groups)

    @torch.inference_mode()
    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        layout = ctx.layout
        self.backend.prepare(layout)
        if ctx.last is not None:
            self.backend.prepare(ctx.last)
        if self.adapters is not None:
            self.adapters.rows = ctx.adapters
        if PLAN not in layout.state:
            layout.state[PLAN] = linear_plan(ctx, self.config.linear_attention.conv_kernel)
        x, cos, sin = self.stem(ctx)
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, ctx, i == last)
        return self.norm(x, residual)[0]

    def stem(self, ctx: ForwardContext):
        """(embeddings, rotary cos, sin) of the rows; with images (ColQwen3.5) the tower's tokens
        at their placeholders and rotary on three axes (Qwen3.5's tower has no DeepStack: no
        features join later layers)."""
        x = self.embed_tokens(ctx.batch.input_ids)
        dim, theta, media = self.config.rotary_dim, self.config.rope_theta, ctx.media
        if media is None:
            return x, *rotary_cos_sin(ctx.batch.positions, dim, theta, x.dtype)
        section, interleaved = media.config.mrope_section, media.config.mrope_interleaved
        cos_sin = rotary_cos_sin(media.positions, dim, theta, x.dtype, section, interleaved)
        return media.embed(self.visual, x, self.embed_tokens.tp), *cos_sin
