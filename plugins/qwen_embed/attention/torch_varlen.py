"""When the torch backend can take PyTorch's packed varlen attention on a GPU
(`torch.nn.attention.varlen.varlen_attn`: one FlashAttention call per layer over the whole flat
batch, separate query/key offsets, GQA): known without importing anything CUDA."""

from __future__ import annotations

import importlib.util
import inspect

# Its FlashAttention kernels: Ampere and newer, half precision, head sizes up to 256 in
# multiples of 8.
MIN_CAPABILITY = (8, 0)
MAX_HEAD_DIM = 256


def _capability(device: str) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(device)


# The keywords our call passes that every torch since 2.11 takes (enable_gqa, since 2.13, is
# optional: torch_sdpa.py repeats the key/value heads without it).
KEYWORDS = frozenset({"scale", "window_size"})


def keywords_of(varlen_attn) -> frozenset[str]:
    """The parameter names a varlen_attn takes (torch's, or a stand-in's)."""
    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_keywords() -> frozenset[str] | None:
    """The parameter names of this torch's varlen_attn (None where it has none)."""
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return None
    from torch.nn.attention.varlen import varlen_attn

    return keywords_of(varlen_attn)


def flash_problem(
    device: str, dtype: str, head_dim: int, capability=_capability, name: str = "flash-attn"
) -> str | None:
    """Why FlashAttention-2 kernels (flash-attn's own, and those under torch's varlen_attn)
    cannot serve this device, dtype and head size (None when they can): flash-attn's
    flash_api.cpp checks the same (sm8x/sm90, fp16/bf16, head size <= 256)."""
    if not device.startswith("cuda"):
        return f"{name} runs on CUDA only"
    if dtype not in ("float16", "bfloat16"):
        return f"{name} needs float16 or bfloat16, not {dtype}"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"{name} takes head sizes up to {MAX_HEAD_DIM} in multiples of 8, not {head_dim}"
    major, minor = capability(device)
    if (major, minor) < MIN_CAPABILITY:
        need = ".".join(map(str, MIN_CAPABILITY))
        return f"{name} needs compute capability {need}+, {device} has {major}.{minor}"
    return None


def varlen_problem(
    device: str,
    dtype: str,
    head_dim: int,
    capability=_capability,
    keywords=_varlen_keywords,
) -> str | None:
    """Why varlen_attn cannot serve this device, dtype and head size (None when it can)."""
    if device.startswith("cuda"):
        takes = keywords()
        if takes is None:
            return "this torch has no torch.nn.attention.varlen (added in the 2.9 line)"
        if KEYWORDS - takes:
            missing = ", ".join(sorted(KEYWORDS - takes))
            return f"this torch's varlen_attn takes no {missing} (torch 2.11 and newer do)"
    return flash_problem(device, dtype, head_dim, capability, name="varlen_attn")
