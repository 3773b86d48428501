"""What this CPU can do, and process tuning that follows from it."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class CpuFeatures:
    """The x86 features that decide which GEMM route is fastest (all False elsewhere)."""

    model: str = "unknown CPU"
    avx2: bool = False
    avx512: bool = False
    avx512_bf16: bool = False
    amx_bf16: bool = False
    vnni: bool = False  # int8 dot products: AVX512_VNNI, AVX_VNNI or AMX_INT8

    @property
    def native_bf16(self) -> bool:
        """bf16 dot-product instructions: without them torch's bf16 matmul is emulated and
        measured 5-50x slower than fp32."""
        return self.avx512_bf16 or self.amx_bf16

    def describe(self) -> str:
        names = [("AVX2", self.avx2), ("AVX-512", self.avx512), ("AVX512_BF16", self.avx512_bf16),
                 ("AMX", self.amx_bf16), ("VNNI", self.vnni)]  # fmt: skip
        return f"{self.model} (" + ", ".join(n if on else f"no {n}" for n, on in names) + ")"

    @classmethod
    def from_flags(cls, flags: set[str], model: str = "unknown CPU") -> CpuFeatures:
        """From the `flags` line of /proc/cpuinfo."""
        return cls(
            model=model,
            avx2="avx2" in flags,
            avx512="avx512f" in flags,
            avx512_bf16="avx512_bf16" in flags,
            amx_bf16="amx_bf16" in flags and "amx_tile" in flags,
            vnni=bool({"avx512_vnni", "avx_vnni", "amx_int8"} & flags),
        )


@functools.cache
def cpu_features() -> CpuFeatures:
    """This machine's features: /proc/cpuinfo where it exists, else what torch detects."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    fields = dict(
        line.split(":", 1) for line in info.splitlines() if line.startswith(("flags", "model name"))
    )
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    if "flags" in fields:
        return CpuFeatures.from_flags(set(fields["flags"].split()), fields.get("model name", ""))

    def check(name: str) -> bool:  # private torch probes: absent in some builds
        return bool(getattr(torch.cpu, name, lambda: False)())

    return CpuFeatures(
        avx512_bf16=check("_is_avx512_bf16_supported"),
        amx_bf16=check("_is_amx_tile_supported"),
        vnni=check("_is_avx512_vnni_supported"),
    )


def has_native_bf16() -> bool:
    return cpu_features().native_bf16
