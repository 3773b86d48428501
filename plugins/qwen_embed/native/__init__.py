"""The engine's native CPU kernels: a decoder layer's row-wise ops (RMSNorm, the q/k norm and
rotary embedding, silu(gate) * up, Qwen3.5's causal convolution), each one pass over memory,
and varlen attention (attention/native_cpu.py), all in fp32 arithmetic, the same numbers for a
row whatever rows share its batch.

Built by `make setup` (build.py), once per instruction set; `isa()` names the one in use (the
widest this CPU runs, `isa_for`), or None where the library is missing, stale or cannot load:
then layers.py runs its torch ops and attention PyTorch's SDPA instead.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from ..cpu import CpuFeatures, cpu_features

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
BUILD = Path(__file__).parent / "_build"
LIBRARY = BUILD / "libqwen_embed_native.so"
STAMP = BUILD / "sources.sha256"  # which sources the library was built from
DTYPES = (torch.float32, torch.bfloat16)
ISAS = ("amx", "avx512bf16", "avx512", "avx2", "generic")  # widest first
DTYPE_NAMES = ("float32", "bfloat16")
PANEL = 64  # output channels per panel of the GEMM operators' packed weights (csrc: kPanel)
# the same for our AMX tile kernels (csrc: kTilePanel): bf16_panel's and int8_panel's there
TILE_PANEL = 16


def gates(panel: int, out_features: int) -> bool:
    """Whether the GEMM operators compute a gate|up projection's silu(gate) * up in their store
    (`gated`) for weights packed in panels of `panel` channels: each half in whole panels (the
    tile kernels' blocks of 16 gate and 16 up channels, or a panel kernel's gate panel and up
    panel per output panel)."""
    return out_features % (2 * panel) == 0


_state: dict[str, str | None] = {}  # "isa" once the library was looked for


def _load() -> str | None:
    if not LIBRARY.exists():
        return None
    if not STAMP.exists() or STAMP.read_text() != sources_digest():
        log.warning("native kernels in %s are older than their sources: run `make setup`", LIBRARY)
        return None
    try:
        torch.ops.load_library(str(LIBRARY))
    except (OSError, RuntimeError) as e:
        log.warning("native kernels not loaded (%s); using torch's ops", e)
        return None
    return _widest()


def _widest() -> str | None:
    for candidate in ISAS[ISAS.index(isa_for(cpu_features())) :]:
        try:  # the library may still refuse one (AMX without the kernel's permission)
            return torch.ops.qwen_embed.select_isa(candidate)
        except RuntimeError as e:
            log.warning("native %s kernels unavailable (%s)", candidate, e)
    return None


def isa_for(features: CpuFeatures) -> str:
    """The widest kernels a CPU with these features runs."""
    if features.avx512 and features.amx_bf16:
        return "amx"
    if features.avx512:
        return "avx512bf16" if features.avx512_bf16 else "avx512"
    return "avx2" if features.avx2 else "generic"


def sources_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in CSRC.rglob("*") if p.is_file()):
        h.update(path.relative_to(CSRC).as_posix().encode() + path.read_bytes())
    return h.hexdigest()


def isa() -> str | None:
    """The instruction set the kernels run with (one of ISAS), or None."""
    if "isa" not in _state:
        _state["isa"] = _load()
    return _state["isa"]


def select(name: str) -> str:
    """Run the kernels of instruction set `name` ("" = the widest this CPU has); for tests."""
    if isa() is None:
        raise RuntimeError("the native kernels are not built")
    _state["isa"] = torch.ops.qwen_embed.select_isa(name) if name else _widest()
    return _state["isa"]


def handles(x: torch.Tensor, *weights: torch.Tensor | None) -> bool:
    """Whether the kernels take this activation (a CPU tensor in fp32 or bf16) with these
    weights (None, or of its dtype)."""
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and all(w is None or w.dtype == x.dtype for w in weights)
        and isa() is not None
    )


def bf16_panel(k: int) -> int:
    """Channels per panel of the bf16 weights of k values each that the bf16_linear operator
    reads fastest here: 16 where our AMX tile kernel takes them (a weight tile 1 KB in a row;
    k a multiple of 32), else PANEL (our AVX512_BF16 panel kernel's)."""
    return torch.ops.qwen_embed.bf16_panel(k) if isa() is not None else PANEL


def int8_panel() -> int:
    """The same for int8_linear's weights (16 where our AMX int8 tile kernel runs)."""
    return torch.ops.qwen_embed.int8_panel() if isa() is not None else PANEL


def pack_panels(w: torch.Tensor, group: int, panel: int = PANEL) -> torch.Tensor:
    """Weights [n, k] as the GEMM operators (int8_linear, bf16_linear) read them, oneDNN brgemm's
    layout: [n_pad / panel, k_pad / group, panel, group], n and k padded with zeros up to
    multiples of `panel` (PANEL for int8_linear; any multiple of 16 for bf16_linear) and `group`
    (the input values one dot-product instruction takes)."""
    n, k = w.shape
    n_pad, k_pad = -(-n // panel) * panel, -(-k // group) * group
    if (n_pad, k_pad) != (n, k):  # a padded copy only where needed: it raises load's peak
        padded = torch.zeros(n_pad, k_pad, dtype=w.dtype)
        padded[:n, :k] = w
        w = padded
    panels, steps = n_pad // panel, k_pad // group
    if w.element_size() * group == 4 and w.is_contiguous():  # moved as 32-bit words: faster
        words = w.view(torch.int32).view(panels, panel, steps).transpose(1, 2).contiguous()
        return words.view(w.dtype).view(panels, steps, panel, group)
    return w.reshape(panels, panel, steps, group).permute(0, 2, 1, 3).contiguous()
