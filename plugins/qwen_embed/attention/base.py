"""The contract every attention backend fulfils."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..batch import VarlenBatch


@dataclass(frozen=True)
class AttentionSpec:
    """Per-rank attention shape: heads here are the heads this TP rank owns."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    device: torch.device
    dtype: torch.dtype

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


class AttentionBackend(ABC):
    """Varlen self-attention over a flat token stream.

    `prepare` runs once per forward batch (index building, kernel planning); `forward` runs in
    every layer with q [T, num_heads, head_dim] and k, v [T, num_kv_heads, head_dim]; with
    `head_major` those are views of [heads, T, head_dim] storage.
    """

    head_major = False

    def __init__(self, spec: AttentionSpec):
        self.spec = spec

    @abstractmethod
    def prepare(self, batch: VarlenBatch) -> None: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def import_gpu_kernel(spec: AttentionSpec, backend: str, module: str, package: str):
    """Check a GPU-only backend can run with `spec`, then import its kernel module lazily."""
    if spec.device.type != "cuda":
        raise RuntimeError(f"attention backend '{backend}' runs only on CUDA devices")
    if spec.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"attention backend '{backend}' needs dtype float16 or bfloat16")
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise RuntimeError(
            f"attention backend '{backend}' needs the {package} package and a CUDA GPU "
            "(pip install '.[gpu]'); use attn_backend='torch' elsewhere"
        ) from e
