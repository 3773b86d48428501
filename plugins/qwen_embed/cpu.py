"""What this CPU can do, and process tuning that follows from it."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_PAGE = os.sysconf("SC_PAGE_SIZE")


_MALLINFO2_FIELDS = (
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of handing it back to the kernel.

    Every forward allocates activation tensors of tens to hundreds of MB; by default glibc
    serves those with fresh mmaps, and first-touch page faults then cost a large share of the
    forward. The price is that the process keeps its peak heap, bounded by max_batch_tokens
    (HeapTrimmer gives back what fragmentation adds beyond that). One arena for every thread:
    with glibc's per-thread arenas, memory freed in one could not serve the next forward's
    ever-new sizes in another, and the heap kept growing. Measurements: docs/tuning.md.
    Returns False where glibc is absent.
    """
    libc = _libc()
    try:
        return (
            libc is not None
            and bool(libc.mallopt(_M_MMAP_MAX, 0))
            and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
            and bool(libc.mallopt(_M_ARENA_MAX, 1))
        )
    except AttributeError:
        return False


def anonymous_bytes() -> int:
    """Resident memory that is the process's own (heap, stacks): not pages of mapped files,
    such as a checkpoint's embedding table (layers.VocabParallelEmbedding), which the kernel
    shares and drops at will."""
    with open("/proc/self/statm") as f:
        resident, shared = f.read().split()[1:3]
    return (int(resident) - int(shared)) * _PAGE


class HeapTrimmer:
    """Bounds the memory keep_freed_memory keeps: after a forward, when the process holds
    more than `keep_bytes` of freed heap (its anonymous memory beyond what malloc has in use
    and what it held at the start), hand the free pages back (malloc_trim). Varlen forwards
    bring new sizes every time, so freed blocks fragment and the heap creeps up; `keep_bytes`
    (one full-budget forward's activations) stays for reuse, so trims are rare and the next
    forward's page faults are paid once per trim. mallinfo2 walks malloc's free lists, which
    costs a noticeable share of a small forward on a fragmented heap, so it is asked only when
    resident memory has grown by keep_bytes / LOOK_AFTER_GROWTH since the last look: small
    enough a step that the peak stays close to the bound. A no-op without mallinfo2."""

    LOOK_AFTER_GROWTH = 32

    def __init__(self, keep_bytes: int):
        self.keep_bytes = keep_bytes
        self.trims = 0
        libc = _libc()
        self._libc = libc if libc is not None and hasattr(libc, "mallinfo2") else None
        if self.active:
            self._libc.mallinfo2.restype = _MallInfo2
            self._libc.malloc_trim(0)  # what was freed before (loading) goes back first
            self._other = anonymous_bytes() - self._in_use()  # Python's arenas, stacks
            self._seen = anonymous_bytes()  # when mallinfo2 was last asked

    @property
    def active(self) -> bool:
        return self._libc is not None

    def _in_use(self) -> int:
        info = self._libc.mallinfo2()
        return info.uordblks + info.hblkhd

    def free_resident_bytes(self, resident: int | None = None) -> int:
        """Freed heap memory still resident (0 without mallinfo2); `resident`: a fresh
        reading of anonymous_bytes() the caller already has."""
        if not self.active:
            return 0
        resident = anonymous_bytes() if resident is None else resident
        return max(0, resident - self._in_use() - self._other)

    def __call__(self, *_) -> None:  # also usable as a forward hook
        if not self.active:
            return
        resident = anonymous_bytes()
        if resident <= self._seen + self.keep_bytes // self.LOOK_AFTER_GROWTH:
            return  # not grown: what was free at the last look is held, not added to
        if self.free_resident_bytes(resident) > self.keep_bytes:
            self._libc.malloc_trim(0)
            self.trims += 1
            resident = anonymous_bytes()
        self._seen = resident


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
        """bf16 dot-product instructions: without them torch's bf16 matmul is emulated, far
        slower than fp32 (docs/tuning.md)."""
        return self.avx512_bf16 or self.amx_bf16

    @property
    def bf16_outruns_fp32(self) -> bool:
        """Whether bf16 GEMMs run faster than fp32's here (dtype `auto`'s choice): with AMX, or
        AVX512_BF16 except on Intel cores without AMX: on a Xeon whose tiles a hypervisor hides,
        oneDNN's bf16 GEMM and ours (VDPBF16PS) run slower than its fp32 GEMM (two FMA ports);
        Cooper Lake is taken to be the same, unmeasured."""
        return self.amx_bf16 or (self.avx512_bf16 and not self.intel)

    @property
    def intel(self) -> bool:
        return "Intel" in self.model

    def describe(self) -> str:
        names = [
            ("AVX2", self.avx2),
            ("AVX-512", self.avx512),
            ("AVX512_BF16", self.avx512_bf16),
            ("AMX", self.amx_bf16),
            ("VNNI", self.vnni),
        ]
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


def fp32_gemm(dtype: str, native_bf16: bool) -> bool:
    """Whether a CPU multiplies `dtype` linear layers as one fp32 GEMM on fp32 copies of their
    16-bit weights: fp16 on every CPU (oneDNN packs fp16 weights only where the CPU converts
    fp16 itself), bf16 without bf16 instructions; torch's emulated GEMMs in those dtypes are
    far slower than fp32's."""
    return dtype == "float16" or (dtype == "bfloat16" and not native_bf16)
