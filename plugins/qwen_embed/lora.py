"""LoRA adapters a request names, kept unmerged beside the base weights (settings.lora_modules).

Several fine-tunes of one base then share one copy of its weights: an adapted linear layer
adds (x A^T) B^T of each row's adapter to its base product, on whatever GEMM the route
multiplies the base on. The rows of one forward may name different adapters (texts of
several requests, each its own): the base GEMM runs once over all of them, and each run of
rows with one adapter adds its product (segments.AdapterRows, which the engine keeps few by
ordering a forward's texts by adapter). `AdapterSwitch`, shared by every adapted layer, holds
the forward's runs, set by the model from ForwardContext.adapters. Packed layers (q|k|v,
gate|up) take their shards' pairs stacked (ColumnParallelLinear.lora_pair), row-parallel
layers their input features' slice of A.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .adapters import ADAPTERS, AdapterError, adapter_folder, read_lora
from .finetunes import ADAPTER_CONFIG
from .layers import LowRank, _Linear
from .loader import checkpoint_names
from .models.vision import TOWER
from .segments import AdapterRows
from .settings import parse_lora_modules


class AdapterSwitch:
    """Which adapter (lora_modules' index) each row of this forward adds; None: none."""

    def __init__(self):
        self.rows: AdapterRows | None = None


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

    def outputs(self, start: int, size: int) -> LinearLora:
        """The pairs of output features [start, start + size) (ColumnParallelLinear.split)."""
        cut = [None if p is None else (p[0], p[1].narrow(0, start, size)) for p in self.pairs]
        return LinearLora(self.switch, cut)


def adapter_folders(setting: str, model_dir: Path) -> list[tuple[str, Path]]:
    """settings.lora_modules as (name, adapter folder): a path, a Hub id (hub.py), or a bare
    name's folder under the checkpoint's adapters/."""
    from .hub import CheckpointNotFoundError, locate

    folders = []
    for name, where in parse_lora_modules(setting):
        if where is None and adapter_folder(model_dir, name)[1] is not None:
            raise AdapterError(
                f"lora_modules: {name}: the checkpoint keeps its tasks' adapters in one "
                "(jina-embeddings-v4's), merged at load one task at a time: set adapter to "
                f"{name!r} and lora_modules to none"
            )
        try:
            folder = model_dir / ADAPTERS / name if where is None else locate(where)
        except CheckpointNotFoundError as e:
            raise AdapterError(f"lora_modules: {name}: {e}") from e
        if not (folder / ADAPTER_CONFIG).is_file():
            raise AdapterError(
                f"lora_modules: {name}'s {folder} holds no {ADAPTER_CONFIG} (a peft LoRA "
                "adapter folder, as save_pretrained writes one)"
            )
        folders.append((name, folder))
    return folders


def attach(
    model: nn.Module,
    folders: Sequence[tuple[str, Path]],
    dtype: torch.dtype,
    device: torch.device,
) -> AdapterSwitch:
    """Each adapter's pairs, in `dtype` (the linear weights': layers.linear_weight_dtype), on
    the linear layers they adapt (after loading, before the q|k|v split and repacking); the
    switch that selects one."""
    switch = AdapterSwitch()
    names = checkpoint_names(model)
    owners = {id(m.weight): m for m in model.modules() if isinstance(m, _Linear)}
    per_layer: dict[_Linear, list[LowRank | None]] = {}
    for index, (name, folder) in enumerate(folders):
        pairs, scale = read_lora(folder)
        shards: dict[_Linear, dict[str | None, LowRank]] = {}
        for tensor, pair in pairs.items():
            if tensor.startswith(TOWER):
                raise AdapterError(
                    f"lora_modules: {name} adapts the vision tower ({tensor}), which adapters "
                    "per request do not: serve it as a checkpoint of its own (merged)"
                )
            targets = [(owners.get(id(p)), shard) for p, shard in names.get(tensor, [])]
            if not targets or any(layer is None for layer, _ in targets):
                raise AdapterError(
                    f"lora_modules: {name} adapts {tensor}, which is no linear layer of this "
                    "checkpoint's text model (is it an adapter of another base?)"
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
    for layer, layer_pairs in per_layer.items():
        layer.lora = LinearLora(switch, layer_pairs)
    return switch
