"""Attention backends behind one interface, looked up by name.

The registry stores import paths, not classes, so CPU machines never import flash-attn or
flashinfer: a backend's module is imported only when that backend is asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from .base import AttentionBackend, AttentionSpec
from .native_cpu import native_problem
from .torch_varlen import flash_problem, varlen_problem

VARLEN_REASON = "auto: PyTorch's varlen FlashAttention, one call per layer"

_BACKENDS = {
    "torch": "qwen_embed.attention.torch_sdpa:TorchAttention",
    "native": "qwen_embed.attention.native_cpu:NativeAttention",
    "flash_attn": "qwen_embed.attention.flash_attn:FlashAttention",
    "flashinfer": "qwen_embed.attention.flashinfer:FlashInferAttention",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def _import_problem(module: str) -> str | None:
    """Why `module` cannot be imported (None when it can). An import, not a lookup: a wheel
    built for another torch is found but fails to load (undefined symbols)."""
    try:
        importlib.import_module(module)
    except (ImportError, OSError) as e:
        return f"{module} does not import ({type(e).__name__}: {e})"
    return None


def choose_backend(
    device: str,
    head_dim: int,
    *,
    dtype: str = "bfloat16",
    import_problem: Callable[[str], str | None] = _import_problem,
    gpu_problem: Callable[..., str | None] = varlen_problem,
    flash_attn_problem: Callable[..., str | None] = flash_problem,
    cpu_problem: Callable[..., str | None] = native_problem,
) -> tuple[str, str]:
    """`attn_backend="auto"`: (backend, reason). On CPU the native operator where it is built
    for the dtype and head size with kernels measured faster (AVX-512, AMX), else the
    per-segment torch loop. On CUDA flash-attn where it is installed, imports and takes the
    GPU, dtype and head size (a deployer who installed it asked for it), else torch:
    PyTorch's varlen FlashAttention where the GPU, dtype and head size allow (the same
    FlashAttention kernels, nothing beyond PyPI's torch), else its per-segment loop.
    flashinfer runs when asked for by name. A pure function of the device, the head size, the
    dtype and what is installed."""
    if not device.startswith("cuda"):
        why = cpu_problem(device, dtype, head_dim, auto=True)
        if why is None:
            return "native", "auto: the native CPU operator, one call per layer"
        return "torch", f"auto: PyTorch SDPA per segment ({why})"
    flash_why = flash_attn_problem(device, dtype, head_dim)
    if flash_why is None and import_problem("flash_attn") is None:
        return "flash_attn", "auto: flash-attn is installed"
    why = gpu_problem(device, dtype, head_dim)
    if why is None:
        return "torch", VARLEN_REASON
    return "torch", f"auto: PyTorch SDPA per segment ({why})"


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
]
