"""The contract every attention backend fulfils."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..segments import AttentionLayout


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
    """Varlen attention over a flat token stream, segment by segment (segments.py).

    `prepare(layout)` runs once per layout and forward batch (kernel planning; state goes on
    the layout); `forward` runs in every layer with q [Tq, num_heads, head_dim] and k, v
    [Tk, num_kv_heads, head_dim] split by the layout's q_lens / k_lens. Their last dimension
    is contiguous; v's rows may be a stride apart (a view of the q|k|v projection's rows): a
    kernel that needs dense rows copies them. A segment with fewer
    queries than keys holds its last queries (causal masks align bottom-right: a shared prefix's
    keys come first).
    """

    def __init__(self, spec: AttentionSpec):
        self.spec = spec

    @abstractmethod
    def prepare(self, layout: AttentionLayout) -> None: ...

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout
    ) -> torch.Tensor: ...


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
            "(make setup-gpu installs a prebuilt set); use attn_backend='torch' elsewhere"
        ) from e
