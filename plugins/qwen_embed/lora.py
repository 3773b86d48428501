"""LoRA adapters a request names, kept unmerged beside the base weights (settings.lora_modules).

Several fine-tunes of one base then share one copy of its weights: an adapted linear layer
adds (x A^T) B^T of each row's adapter to its base product, on whatever GEMM the route
multiplies the base on. The rows of one forward may name different adapters (texts of
several requests, each its own): the base GEMM runs once over all of them, and each run of
rows with one adapter adds its product (segments.AdapterRows, which the engine keeps few by
ordering a forward's texts by adapter). `AdapterSwitch`, shared by every adapted layer, holds
the forward's runs, set by the model from ForwardContext.adapters. Packed layers (q|k|v,
gate|up) take their shards' pairs stacked (ColumnParallelLinear.lora_pair), row-parallel
layers their input features' slice of A. The vision tower's layers have a switch of their own,
whose rows are patches (each image's text's adapter: media.MediaForward), and rank 0's
projection heads (heads.ProjectionHead) take pairs over the rows they project.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .adapters import AdapterError, adapter_folder, adapter_names, read_lora
from .finetunes import ADAPTER_CONFIG
from .heads import ProjectionHead
from .layers import LowRank, _Linear
from .loader import checkpoint_names
from .segments import AdapterRows
from .settings import parse_lora_modules


class AdapterSwitch:
    """Which adapter (lora_modules' index) each row of this forward adds; None: none."""

    def __init__(self):
        self.rows: AdapterRows | None = None

    def select_visuals(
        self, adapters: np.ndarray | None, patches: list[int], merge_unit: int
    ) -> None:
        """A vision tower's forward: each visual's patches, then its merged tokens (a
        `merge_unit` of patches each), add its adapter (`adapters`: each visual's; None:
        none)."""
        if adapters is None:
            self.rows = None
            return
        tokens = [n // merge_unit for n in patches]
        self.rows = AdapterRows.of(np.repeat(adapters, patches), np.repeat(adapters, tokens))


# Rows from which a forward whose rows all name one adapter multiplies by the layer's weights
# with that adapter's pair merged into a copy of them (the kernel's `merged`) instead of adding
# the pair's products: the merge costs the same at any row count, the products and their pass
# over the layer's output grow with the rows, and a merged gate|up still gates in its store.
MERGE_FROM_ROWS = 3072


class LinearLora:
    """One linear layer's low-rank pairs, this rank's slice, scale folded into B: one per
    adapter of the switch (None where an adapter leaves the layer as it is)."""

    def __init__(self, switch: AdapterSwitch, pairs: list[LowRank | None]):
        self.switch = switch
        self.pairs = pairs

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [rows, out] (x's base product) plus each row's adapter product, in place."""
        rows = self.switch.rows
        if rows is None:
            return y
        for adapter, start, stop in rows.runs(x.shape[0]):
            if (pair := self.pairs[adapter]) is None:
                continue
            a, b = pair
            xa = F.linear(x[start:stop].to(a.dtype), a)
            if y.dtype == b.dtype:  # summed in the GEMM's accumulator: rounded once
                y[start:stop].addmm_(xa, b.t())
            else:  # pairs held in fp32 (layers.linear_weight_dtype)
                y[start:stop].add_(F.linear(xa, b))
        return y

    def merged(self, kernel: nn.Module | None, rows: int) -> nn.Module | None:
        """`kernel` with the pair merged into its weights (kernel.merged) where every one of
        this forward's `rows` rows names one adapter of this layer, they are MERGE_FROM_ROWS
        or more and the kernel merges; else None."""
        runs = self.switch.rows
        if runs is None or rows < MERGE_FROM_ROWS or not hasattr(kernel, "merged"):
            return None
        match runs.runs(rows):
            case ((adapter, 0, stop),) if stop == rows and self.pairs[adapter] is not None:
                return kernel.merged(*self.pairs[adapter])
        return None

    def adds(self, rows: int) -> bool:
        """Whether a row of this forward's `rows` adds a pair of this layer."""
        runs = self.switch.rows
        return runs is not None and any(self.pairs[a] is not None for a, _, _ in runs.runs(rows))

    def outputs(self, start: int, size: int) -> LinearLora:
        """The pairs of output features [start, start + size) (ColumnParallelLinear.split)."""
        cut = [None if p is None else (p[0], p[1].narrow(0, start, size)) for p in self.pairs]
        return LinearLora(self.switch, cut)


def adapter_folders(setting: str, model_dir: Path) -> list[tuple[str, Path, str | None]]:
    """settings.lora_modules as (name, adapter folder, task): a path, a Hub id (hub.py), or a
    bare name's folder under the checkpoint's adapters/ (a task of the one adapter there where
    it holds several: jina-embeddings-v4's)."""
    from .hub import CheckpointNotFoundError, locate

    folders = []
    for name, where in parse_lora_modules(setting):
        task = None
        try:
            if where is None:
                folder, task = adapter_folder(model_dir, name)
            else:
                folder = locate(where)
        except CheckpointNotFoundError as e:
            raise AdapterError(f"lora_modules: {name}: {e}") from e
        if not (folder / ADAPTER_CONFIG).is_file():
            raise AdapterError(
                f"lora_modules: {name}'s {folder} holds no {ADAPTER_CONFIG} (a peft LoRA "
                "adapter folder, as save_pretrained writes one)"
            )
        if task is not None and task not in (tasks := adapter_names(model_dir)):
            raise AdapterError(
                f"lora_modules: {name} is none of the tasks of the checkpoint's adapter ({tasks})"
            )
        folders.append((name, folder, task))
    return folders


def attach(
    model: nn.Module,
    folders: Sequence[tuple[str, Path, str | None]],
    dtype: torch.dtype,
    device: torch.device,
) -> AdapterSwitch:
    """Each adapter's pairs, in `dtype` (the linear weights': layers.linear_weight_dtype), on
    the linear layers they adapt (after loading, before the q|k|v split and repacking): the
    text model's, the vision tower's (its own switch, `tower.adapters`, whose rows are
    patches: media.MediaForward) and rank 0's projection heads' (fp32, as they compute);
    the text model's switch, which selects one. A rank without the tower and the heads
    leaves their pairs to rank 0."""
    switch = AdapterSwitch()
    tower = model.visual
    if tower is not None:
        tower.adapters = AdapterSwitch()
    names = checkpoint_names(model)
    owners = {id(m.weight): m for m in model.modules() if isinstance(m, _Linear)}
    heads = {h for h in (model.head, model.token_head) if isinstance(h, ProjectionHead)}
    by_head = {w: (h, i) for h in heads for i, w in enumerate(h.weight_names)}
    rank = model.embed_tokens.tp.rank
    per_layer: dict[_Linear, list[LowRank | None]] = {}
    per_head: dict[tuple[ProjectionHead, int], list[LowRank | None]] = {}
    for index, (name, folder, task) in enumerate(folders):
        pairs, scale = read_lora(folder, task)
        shards: dict[_Linear, dict[str | None, LowRank]] = {}
        for tensor, pair in pairs.items():
            if tensor in by_head:
                a, b = pair["A"], scale * pair["B"]
                slot = per_head.setdefault(by_head[tensor], [None] * len(folders))
                slot[index] = (a.to(device).contiguous(), b.to(device).contiguous())
                continue
            targets = [(owners.get(id(p)), shard) for p, shard in names.get(tensor, [])]
            if rank > 0 and not targets:  # the tower's or a head's: rank 0 holds them
                continue
            if not targets or any(layer is None for layer, _ in targets):
                raise AdapterError(
                    f"lora_modules: {name} adapts {tensor}, which is no linear layer of this "
                    "checkpoint (is it an adapter of another base?)"
                )
            for layer, shard in targets:
                shards.setdefault(layer, {})[shard] = (pair["A"], scale * pair["B"])
        for layer, layer_pairs in shards.items():
            try:
                a, b = layer.lora_pair(layer_pairs)
            except (RuntimeError, ValueError) as e:
                raise AdapterError(f"lora_modules: {name} does not fit this checkpoint: {e}") from e
            expected = layer.weight.shape
            if a.shape[1] != expected[1] or b.shape[0] != expected[0]:
                raise AdapterError(
                    f"lora_modules: {name}'s pair for a layer of {tuple(expected)} is "
                    f"{tuple(b.shape)} x {tuple(a.shape)} (an adapter of another base?)"
                )
            slot = per_layer.setdefault(layer, [None] * len(folders))
            slot[index] = (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
    tower_layers = set() if tower is None else set(tower.modules())
    for layer, layer_pairs in per_layer.items():
        layer.lora = LinearLora(tower.adapters if layer in tower_layers else switch, layer_pairs)
    for (head, i), head_pairs in per_head.items():
        head.loras[i] = LinearLora(switch, head_pairs)
    return switch
