"""Tensor-parallel building blocks.

Every parameter carries a `weight_loader(param, full_tensor, shard_id=None)` that copies this
rank's slice of a full checkpoint tensor: sharding lives here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .cpu import fp32_gemm, has_native_bf16
from .kernels import RowOps, reference

LowRank = tuple[torch.Tensor, torch.Tensor]  # a LoRA pair (A [r, in], B [out, r])


def linear_weight_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype linear-layer weights are stored in for a model of `dtype` on `device`.

    fp32 holding the same values where cpu.fp32_gemm says (route.Linear.FP32_GEMM). Converted
    once at load, so no request pays for the upcast; the price is fp32 weight memory, except
    where our AVX2 GEMM packs them (avx2_gemm.pack keeps bf16 values in bf16).
    """
    name = str(dtype).removeprefix("torch.")
    if device.type == "cpu" and fp32_gemm(name, has_native_bf16()):
        return torch.float32
    return dtype


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; 16-bit activations against fp32-held weights (linear_weight_dtype) run as one
    fp32 GEMM rounded back: a 16-bit GEMM's 16-bit in, fp32 accumulation, 16-bit out."""
    if x.dtype != weight.dtype:
        return F.linear(x.float(), weight, bias).to(x.dtype)
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group; `group` is None when tp_size == 1."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.group.allreduce([t]).wait()
        return t

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` on every rank, in place."""
        if self.size > 1:
            self.group.broadcast(t, 0).wait()
        return t


def rank_slice(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if full.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} does not split {size} ways")
    return full.chunk(size, dim=dim)[rank]


def copy_exact(param: torch.Tensor, value: torch.Tensor) -> None:
    if param.shape != value.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint slice {tuple(value.shape)}"
        )
    param.data.copy_(value)


def loaded_parameter(*shape: int, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = loader
    return p


def replicated_loader(param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
    copy_exact(param, full)


class RMSNorm(nn.Module):
    """RMSNorm of x, or with `residual` the norm of x + residual and that sum (written over x),
    in the kernels of the route's row-op table (kernels/)."""

    def __init__(self, dim: int, eps: float, ops: RowOps = reference):
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = loaded_parameter(dim, loader=replicated_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary; one all-reduce joins the rows.

    On CPU the slice is the checkpoint's tensor itself wherever the model's dtype holds its
    values exactly (bf16 rows in an fp32 model, or the same dtype): the loader maps its bytes,
    so only the rows of tokens met are ever read into memory, and every process serving the
    checkpoint shares them (the page cache). Rows are widened once gathered: the same bits."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * per_rank
        self.end = min(vocab_size, self.start + per_rank)
        self.weight = loaded_parameter(per_rank, dim, loader=self._load)
        self.dtype = self.weight.dtype  # of the rows it returns

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
        part = full[self.start : self.end]
        if full.shape[1:] != param.shape[1:] or len(full) < self.end:
            raise ValueError(
                f"shape mismatch: the vocabulary needs at least {self.end} rows of "
                f"{param.shape[1]}, the checkpoint's table is {tuple(full.shape)}"
            )
        on_cpu = param.device.type == full.device.type == "cpu"
        if on_cpu and torch.promote_types(full.dtype, param.dtype) == param.dtype:
            param.data = part  # ids outside [start, end) are masked in forward: no padding
            return
        param.data.zero_()  # rows past the vocabulary (uneven split) stay zero
        param.data[: part.shape[0]].copy_(part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight).to(self.dtype)
        mine = (ids >= self.start) & (ids < self.end)
        out = F.embedding((ids - self.start) * mine, self.weight).to(self.dtype)
        out.mul_(mine.unsqueeze(-1).to(out.dtype))
        return self.tp.all_reduce(out)


class _Linear(nn.Module):
    """What every linear layer shares: the multiply (route.py decides which): F.linear on
    the float weight, or a GEMM that holds the weight in its own form (int8.Int8Weight,
    onednn.PackedWeight) once `repack` handed it over."""

    def __init__(self):
        super().__init__()
        self.kernel: nn.Module | None = None
        self.lora = None  # lora.LinearLora: the adapters a request may name

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._product(x, bias, self._merged(x))

    def _merged(self, x: torch.Tensor) -> nn.Module | None:
        """The kernel with this forward's one adapter merged (lora.LinearLora.merged), or None."""
        return None if self.lora is None else self.lora.merged(self.kernel, len(x))

    def _product(
        self, x: torch.Tensor, bias: torch.Tensor | None, merged: nn.Module | None
    ) -> torch.Tensor:
        if merged is not None:
            return merged(x, bias)
        if self.kernel is not None:
            y = self.kernel(x, bias)
        else:
            y = linear(x, self.weight, bias)
        return y if self.lora is None else self.lora.add(x, y)

    def repack(self, kernel: type[nn.Module]) -> None:
        """Replace this rank's (already sharded) float weight by `kernel(weight)`."""
        self.kernel = kernel(self.weight)
        self.weight = None


class ColumnParallelLinear(_Linear):
    """Output features split across ranks; several checkpoint matrices may be packed in one.

    `shard_sizes` gives each packed shard's full output size and `shard_ranks` how a shard is
    divided: a shard with fewer heads than ranks (kv heads when tp > num_kv_heads) is
    replicated, each rank taking the slice `shard_owner(rank)` of it.
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        tp: TPGroup,
        bias: bool,
        shard_parts: dict[str, int] | None = None,
    ):
        super().__init__()
        self.tp = tp
        # Into how many pieces each shard is cut; normally tp.size, fewer when replicated.
        self.parts = {k: (shard_parts or {}).get(k, tp.size) for k in shard_sizes}
        self.local = {k: size // self.parts[k] for k, size in shard_sizes.items()}
        self.offsets, total = {}, 0
        for k, n in self.local.items():
            self.offsets[k] = total
            total += n
        self.weight = loaded_parameter(total, in_features, loader=self._load)
        self.bias = loaded_parameter(total, loader=self._load) if bias else None

    def _piece(self, shard_id: str) -> int:
        # With P pieces over tp.size ranks, consecutive ranks share a piece.
        return self.tp.rank * self.parts[shard_id] // self.tp.size

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_id: str | None = None) -> None:
        key = shard_id if shard_id is not None else next(iter(self.local))
        part = rank_slice(full, 0, self._piece(key), self.parts[key])
        copy_exact(param.data.narrow(0, self.offsets[key], self.local[key]), part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def silu_gated(self, x: torch.Tensor, ops: RowOps) -> torch.Tensor:
        """silu(gate) * up of a gate|up projection (its two shards): in the GEMM's store where
        the kernel does it (`gates`: int8.Int8Weight, onednn.NativeBf16Weight) and nothing
        joins the product first (a bias, an adapter a row of this forward names, unless merged
        into the kernel's weights: lora.MERGE_FROM_ROWS), else ops.silu_mul after it; the same
        bits."""
        merged = self._merged(x)  # once: a merge is a pass over the layer's weights
        kernel = self.kernel if merged is None else merged
        adapted = merged is None and self.lora is not None and self.lora.adds(len(x))
        if getattr(kernel, "gates", False) and self.bias is None and not adapted:
            return kernel.silu_gated(x)
        return ops.silu_mul(self._product(x, self.bias, merged))

    def lora_pair(self, pairs: dict[str | None, LowRank]) -> LowRank:
        """The packed shards' pairs as one: their A stacked [sum r, in], their B this rank's
        rows of each, placed block-diagonally [out, sum r] (a shard without one: zeros)."""
        if None in pairs:
            pairs = {next(iter(self.local)): pairs[None]}
        a = torch.cat([a for a, _ in pairs.values()])
        b = a.new_zeros(sum(self.local.values()), a.shape[0])
        col = 0
        for key, (a_k, b_k) in pairs.items():
            rows = rank_slice(b_k, 0, self._piece(key), self.parts[key])
            b[self.offsets[key] : self.offsets[key] + self.local[key], col : col + len(a_k)] = rows
            col += len(a_k)
        return a, b

    def split(self, *groups: tuple[str, ...]) -> list[ShardLinear]:
        """This rank's packed shards as separate layers, one per group of consecutive shards
        (after loading, before repacking), so that a caller can feed each its own rows."""
        names, out = list(self.local), []
        for group in groups:
            first = names.index(group[0])
            if tuple(names[first : first + len(group)]) != group:
                raise ValueError(f"shards {group} are not consecutive in {names}")
            start, size = self.offsets[group[0]], sum(self.local[k] for k in group)
            bias = None if self.bias is None else self.bias.data.narrow(0, start, size)
            out.append(ShardLinear(self.weight.data.narrow(0, start, size), bias))
            out[-1].lora = None if self.lora is None else self.lora.outputs(start, size)
        return out


def shard_groups(shards: tuple[str, ...], apart: set[str]) -> tuple[tuple[str, ...], ...]:
    """`shards` (a packed projection's, in order) cut into runs of consecutive shards that are
    all in `apart` or all not."""
    groups: list[tuple[str, ...]] = []
    run: list[str] = []
    for shard in shards:
        if run and (shard in apart) != (run[-1] in apart):
            groups.append(tuple(run))
            run = []
        run.append(shard)
    return tuple(groups + [tuple(run)])


class SplitProjection(nn.Module):
    """A module with one packed projection (the ColumnParallelLinear named by `packed`) that
    may be cut, after loading and before repacking, into one layer per group of consecutive
    shards, named after them (`qk_proj`, `v_proj`): for a route that multiplies the groups
    differently (int8.FLOAT_SHARDS), or computes one group for some rows only. `shards`
    computes every shard either way."""

    packed = "qkv_proj"

    def _projections(self, *groups: tuple[str, ...]) -> None:
        """What `shards` runs, decided once: each group's layer, its shards and their widths
        (`self.widths`: this rank's width of each shard)."""
        self.projections = groups
        names = [projection_name(g) for g in groups] if len(groups) > 1 else [self.packed]
        self._plan = [
            (n, g, [self.widths[s] for s in g]) for n, g in zip(names, groups, strict=True)
        ]

    def split_projection(self, *groups: tuple[str, ...]) -> None:
        packed = getattr(self, self.packed)
        for group, layer in zip(groups, packed.split(*groups), strict=True):
            setattr(self, projection_name(group), layer)
        setattr(self, self.packed, None)
        self._projections(*groups)

    def outputs(
        self, x: torch.Tensor, rows: torch.Tensor | None = None, alone: tuple[str, ...] = ()
    ):
        """(shards, their widths, output) of each layer on x; the layer of the shards `alone`,
        where they have one, on x's `rows` only."""
        for name, group, widths in self._plan:
            own = rows is not None and group == alone
            yield group, widths, getattr(self, name)(x[rows] if own else x)

    def shards(
        self, x: torch.Tensor, rows: torch.Tensor | None = None, alone: tuple[str, ...] = ()
    ) -> dict[str, torch.Tensor]:
        """Each shard's output on x; the shards `alone` of x's `rows` only."""
        out = {}
        for group, widths, y in self.outputs(x, rows, alone):
            out.update(zip(group, y.split(widths, dim=-1), strict=True))
        if rows is not None and alone not in self.projections:  # computed on every row
            out.update({s: out[s][rows] for s in alone})
        return out


def projection_name(group: tuple[str, ...]) -> str:
    return "".join(group) + "_proj"


class ShardLinear(_Linear):
    """Some shards of a ColumnParallelLinear, cut out after loading (same rank slice)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(_Linear):
    """A whole linear layer on each rank that holds it (the vision tower's, on rank 0)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.weight = loaded_parameter(out_features, in_features, loader=replicated_loader)
        self.bias = loaded_parameter(out_features, loader=replicated_loader) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def lora_pair(self, pairs: dict[str | None, LowRank]) -> LowRank:
        return pairs[None]


class RowParallelLinear(_Linear):
    """Input features split across ranks; the partial products are summed by one all-reduce."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.weight = loaded_parameter(out_features, in_features // tp.size, loader=self._load)

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
        copy_exact(param, rank_slice(full, 1, self.tp.rank, self.tp.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.matmul(x, None))

    def lora_pair(self, pairs: dict[str | None, LowRank]) -> LowRank:
        """A's columns of this rank's input features: its partial (x A^T) B^T is summed by
        the all-reduce as the base product is."""
        a, b = pairs[None]
        return rank_slice(a, 1, self.tp.rank, self.tp.size), b


def rotary_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    section: tuple[int, int, int] | None = None,
    interleaved: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim // 2], computed in fp32 then cast, as transformers does, of
    positions [T]; or of positions [T, 3] (time, row, column: multimodal rotary). Interleaved
    (Qwen3-VL): frequency j turns with rows where j % 3 == 1 and j < 3 * section[1], with
    columns where j % 3 == 2 and j < 3 * section[2], else with time; else (Qwen2-VL) the
    first section[0] frequencies turn with time, the next section[1] with rows, the rest
    with columns."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device)
    inv_freq = 1.0 / (theta ** (exponents.float() / head_dim))
    if positions.ndim == 1:
        freqs = positions.float().unsqueeze(-1) * inv_freq
    else:
        j = torch.arange(head_dim // 2, device=positions.device)
        axis = torch.zeros_like(j)
        if interleaved:
            axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
            axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
        else:
            axis[j >= section[0]] = 1
            axis[j >= section[0] + section[1]] = 2
        freqs = positions[:, axis].float() * inv_freq
    return freqs.cos().to(dtype), freqs.sin().to(dtype)
