"""Attention backends behind one interface, looked up by name.

The registry stores import paths, not classes, so CPU machines never import flash-attn or
flashinfer: a backend's module is imported only when that backend is asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

from .base import AttentionBackend, AttentionSpec
from .flashinfer_limits import FLASHINFER_HEAD_DIMS

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


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def choose_backend(
    device_type: str, head_dim: int, importable: Callable[[str], bool] = _importable
) -> tuple[str, str]:
    """`attn_backend="auto"`: (backend, reason). On CUDA flash_attn when importable, else
    flashinfer (for the head sizes it ships kernels for), else the per-sequence torch loop;
    on CPU always torch. A pure function of the device, the head size and what imports."""
    if device_type != "cuda":
        return "torch", f"auto: {device_type} runs PyTorch SDPA"
    if importable("flash_attn"):
        return "flash_attn", "auto: flash-attn is installed"
    if importable("flashinfer") and head_dim in FLASHINFER_HEAD_DIMS:
        return "flashinfer", "auto: flashinfer is installed (flash-attn is not)"
    return "torch", "auto: neither flash-attn nor a usable flashinfer is installed (slow on GPU)"


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
    "choose_backend",
    "create_backend",
    "register_backend",
]
