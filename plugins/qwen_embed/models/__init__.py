"""Model families registered by name; ModelConfig.family picks one."""

from __future__ import annotations

from torch import nn

from .qwen import QwenModel

_MODELS: dict[str, type[nn.Module]] = {
    "qwen2": QwenModel,
    "qwen3": QwenModel,
}


def model_class(family: str) -> type[nn.Module]:
    if family not in _MODELS:
        raise ValueError(f"no model registered for family {family!r}; known: {sorted(_MODELS)}")
    return _MODELS[family]


__all__ = ["model_class"]
