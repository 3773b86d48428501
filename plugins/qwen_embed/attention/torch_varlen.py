"""When the torch backend can run PyTorch's FlashAttention varlen kernel on a GPU
(`aten::_flash_attention_forward` with offsets: one call per layer over the whole flat batch,
separate query/key offsets, GQA as FlashAttention reads it): known without importing anything
CUDA. The backend calls the ATen operator itself: `torch.nn.attention.varlen.varlen_attn`
reaches the same kernel through a Python custom op that adds host time and a zero-filled
tensor (one more kernel) to every layer."""

from __future__ import annotations

# Its FlashAttention kernels: Ampere and newer, half precision, head sizes up to 256 in
# multiples of 8.
MIN_CAPABILITY = (8, 0)
MAX_HEAD_DIM = 256
KERNEL = "aten::_flash_attention_forward"

# The keywords our call passes: torch 2.5 and newer take them.
KEYWORDS = frozenset({"scale", "window_size_left", "window_size_right"})


def _capability(device: str) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(device)


def kernel_keywords() -> frozenset[str] | None:
    """The keyword-only parameters of this torch's `aten::_flash_attention_forward` (None
    where it has none)."""
    import torch

    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return None
    schema = torch.ops.aten._flash_attention_forward.default._schema
    return frozenset(a.name for a in schema.arguments if a.kwarg_only)


def flash_problem(
    device: str, dtype: str, head_dim: int, capability=_capability, name: str = "flash-attn"
) -> str | None:
    """Why FlashAttention-2 kernels (flash-attn's own, and PyTorch's copy of them) cannot
    serve this device, dtype and head size (None when they can): flash-attn's flash_api.cpp
    checks the same (sm8x/sm90, fp16/bf16, head size <= 256)."""
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
    keywords=kernel_keywords,
) -> str | None:
    """Why PyTorch's varlen FlashAttention cannot serve this device, dtype and head size
    (None when it can)."""
    if device.startswith("cuda"):
        takes = keywords()
        if takes is None:
            return f"this torch has no {KERNEL}"
        if KEYWORDS - takes:
            missing = ", ".join(sorted(KEYWORDS - takes))
            return f"this torch's {KERNEL} takes no {missing} (torch 2.5 and newer do)"
    return flash_problem(device, dtype, head_dim, capability, name="PyTorch's FlashAttention")
