"""The decoder layer's row-wise operations, one table per kind of device, chosen by the route.

Every table is a module with the functions of `RowOps`, computing the same arithmetic
(reference.py's, transformers' rounding points) with its own kernels:
- `torch`: torch's ops, the numerical reference (reference.py);
- `native`: the C++ CPU kernels (native/), one pass over memory each;
- `triton`: Triton-language kernels for CUDA (triton_gpu.py), the residual add fused into the
  RMSNorm after it.
A new fused operation is one function in each table and one method here. Tables are imported
only when asked for, so CPU machines never import Triton.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..gated_delta import SequencePlan

TABLES = {
    "torch": "qwen_embed.kernels.reference",
    "native": "qwen_embed.kernels.native_cpu",
    "triton": "qwen_embed.kernels.triton_gpu",
}


class RowOps(Protocol):
    """What every table provides (each table is a module with these functions)."""

    NAME: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual), the sum written over x (the caller's
        fresh sublayer output)."""

    def norm_rotary(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        head_dim: int,
        weight: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        """Heads of x [T, heads * head_dim] (rows may be strided), RMS-normalised by `weight`
        when given, rotated by cos/sin [T, head_dim // 2]: a contiguous [T, heads, head_dim].
        Tables in x's dtype rotate as transformers' text models do; fp32 tables (the vision
        tower's) rotate in fp32, rounded once."""

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for the packed [T, 2 * inter] projection."""

    def gelu_tanh(self, x: torch.Tensor) -> torch.Tensor:
        """GELU with tanh's approximation (the vision tower's MLP), a new tensor."""

    def causal_conv_silu(
        self, x: torch.Tensor, weight: torch.Tensor, position: torch.Tensor
    ) -> torch.Tensor:
        """silu of the causal depthwise convolution of x [T, channels] (rows may be strided) by
        weight [channels, K] (taken in fp32) within each sequence (`position` [T], int64: each
        row's place in it), summed in fp32 and rounded once (Qwen3.5's linear attention)."""

    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        plan: SequencePlan,
        states: torch.Tensor | None = None,
        exports: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Qwen3.5's linear attention over the plan's sequences (gated_delta.gated_delta_rule's
        arguments and result: fp32 outputs [T, value heads, value dim])."""

    def quantize_fp8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of x [T, k] (contiguous values) as float8_e4m3fn codes [T, k] and fp32 scales
        [T, 1] (the fp8 route's activations, fp8.py), reference.quantize_fp8's arithmetic."""


def load(name: str) -> RowOps | ModuleType:
    if name not in TABLES:
        raise ValueError(f"unknown row-op table {name!r}; known: {sorted(TABLES)}")
    return importlib.import_module(TABLES[name])


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose(
    device: str,
    native_isa: str | None,
    has_triton: Callable[[], bool] = has_triton,
) -> str:
    """The table a route takes: on CPU the native kernels where they run this route
    (`native_isa`: their instruction set, None where they are not built or not for its
    dtype), on CUDA the Triton kernels where Triton is installed, else torch's ops."""
    if device.startswith("cuda"):
        return "triton" if has_triton() else "torch"
    return "native" if native_isa is not None else "torch"
