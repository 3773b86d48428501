"""Model families registered by name; ModelConfig.family picks one.

`EmbeddingModel` is what the engine asks of a family's model: a new family provides it, and
registers its class in `_MODELS`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from .qwen import QwenModel
from .qwen3_5 import HybridModel

if TYPE_CHECKING:
    from ..attention import AttentionBackend
    from ..config import ModelConfig
    from ..kernels import RowOps
    from ..layers import TPGroup
    from ..segments import ForwardContext, Planner


class EmbeddingModel(Protocol):
    """What the engine (engine.py, loader.py, parallel.py) uses of a model shard."""

    # checkpoint module name -> (our packed module, shard id): loader.py maps keys with it
    packed_modules: dict[str, tuple[str, str]]
    # the decoder layers in order, `layers.{i}.` in parameter names: engine.build_model cuts
    # and repacks each as soon as its weights are loaded
    layers: nn.ModuleList
    planner: Planner  # turns flat batches into this shard's forward contexts (segments.py)
    # rank 0: pooled hidden states -> scores (rerank) or projected vectors (heads.py)
    head: nn.Module | None
    # rank 0, a checkpoint pooled by attention (engine._instantiate sets it; else None): its
    # attention_pooling.AttentionPooling, which pools the final hidden states (batch.pool)
    pooler: nn.Module | None
    # cuda_graphs.TokenGraphs where the route captures CUDA graphs (engine.build_model sets
    # it; None until then): the forward replays them where the batch fits
    graphs: object | None
    # lora.AdapterSwitch where settings.lora_modules names adapters (engine.build_model)
    adapters: object | None

    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup,
        backend: AttentionBackend,
        planner: Planner,
        head: nn.Module | None,
        ops: RowOps,
    ): ...

    def split_qkv(self, index: int, apart: dict[str, tuple[str, ...]], prune: bool) -> None:
        """Once layer `index` is loaded, before it is repacked: its projections cut as the
        route needs (QwenModel's docstring says how)."""

    def __call__(self, ctx: ForwardContext) -> torch.Tensor:
        """Final-norm hidden states of the computed rows, or of the pooled rows where the
        forward prunes (ctx.last)."""


_MODELS: dict[str, type[EmbeddingModel]] = {
    "qwen2": QwenModel,
    "qwen3": QwenModel,
    "qwen3_5": HybridModel,
}


def model_class(family: str) -> type[EmbeddingModel]:
    if family not in _MODELS:
        raise ValueError(f"no model registered for family {family!r}; known: {sorted(_MODELS)}")
    return _MODELS[family]


__all__ = ["EmbeddingModel", "model_class"]
