"""Attention backends behind one interface, looked up by name.

The registry stores import paths, not classes, so CPU machines never import flash-attn or
flashinfer: a backend's module is imported only when that backend is asked for.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable

from .base import AttentionBackend, AttentionSpec
from .flashinfer_limits import FLASHINFER_HEAD_DIMS, flashinfer_problem
from .native_cpu import native_problem

_BACKENDS = {
    "torch": "qwen_embed.attention.torch_sdpa:TorchAttention",
    "native": "qwen_embed.attention.native_cpu:NativeAttention",
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


def _flashinfer_version() -> str | None:
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def choose_backend(
    device_type: str,
    head_dim: int,
    importable: Callable[[str], bool] = _importable,
    flashinfer_version: Callable[[], str | None] = _flashinfer_version,
    *,
    dtype: str = "bfloat16",
    cpu_problem: Callable[..., str | None] = native_problem,
) -> tuple[str, str]:
    """`attn_backend="auto"`: (backend, reason). On CPU the native operator where it is built
    for the dtype and head size with kernels measured faster (AVX-512, AMX), else the
    per-segment torch loop. On CUDA flash_attn when importable, else flashinfer (a version
    with the device guard, for the head sizes it ships kernels for), else the torch loop;
    torch for fp32. A pure function of the device, the head size, the dtype and what is
    installed."""
    if device_type != "cuda":
        why = cpu_problem(device_type, dtype, head_dim, auto=True)
        if why is None:
            return "native", "auto: the native CPU operator, one call per layer"
        return "torch", f"auto: PyTorch SDPA per segment ({why})"
    if dtype not in ("float16", "bfloat16"):  # both GPU kernels are half precision only
        return "torch", f"auto: the GPU kernels need float16 or bfloat16, not {dtype}"
    if importable("flash_attn"):
        return "flash_attn", "auto: flash-attn is installed"
    why = flashinfer_problem(flashinfer_version() if importable("flashinfer") else None, None)
    if why is None and head_dim in FLASHINFER_HEAD_DIMS:
        return "flashinfer", "auto: flashinfer is installed (flash-attn is not)"
    if why is None:
        why = f"flashinfer has no kernels for head size {head_dim}"
    return "torch", f"auto: no flash-attn, and {why} (slow on GPU: make setup-gpu)"


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
