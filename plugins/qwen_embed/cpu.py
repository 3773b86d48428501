"""CPU-specific process tuning."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of handing it back to the kernel.

    Every forward allocates activation tensors of tens to hundreds of MB; by default glibc
    serves those with fresh mmaps, and first-touch page faults then cost more than the
    arithmetic (measured: ~1.3x end to end on the demo model). The price is that the process
    keeps its peak heap, bounded by max_batch_tokens. Returns False where glibc is absent.
    """
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
        )
    except (OSError, AttributeError):
        return False


@functools.cache
def has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512_BF16 or AMX).

    Without them torch's bf16 matmul is emulated and measured 5-50x slower than fp32 here.
    """
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)
