"""Attention backends behind one interface, looked up by name.

The registry stores import paths, not classes, so CPU machines never import flash-attn or
flashinfer: a backend's module is imported only when that backend is asked for.
"""

from __future__ import annotations

import importlib

from .base import AttentionBackend, AttentionSpec

_BACKENDS = {
    "torch": "qwen_embed.attention.torch_sdpa:TorchAttention",
    "flash_attn": "qwen_embed.attention.flash_attn:FlashAttention",
    "flashinfer": "qwen_embed.attention.flashinfer:FlashInferAttention",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def register_backend(name: str, import_path: str) -> None:
    """Add a backend as "package.module:ClassName"; it is imported on first use."""
    _BACKENDS[name] = import_path


def create_backend(name: str, spec: AttentionSpec) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {available_backends()}")
    module_name, class_name = _BACKENDS[name].split(":")
    backend_cls = getattr(importlib.import_module(module_name), class_name)
    return backend_cls(spec)


__all__ = [
    "AttentionBackend",
    "AttentionSpec",
    "available_backends",
    "create_backend",
    "register_backend",
]
