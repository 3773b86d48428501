"""qwen_embed: a tensor-parallel Qwen2/Qwen3 varlen embedding engine, usable without Triton.

The names below load on first use, so a process that needs only the light modules never
imports torch. The engine imports neither the client (qwen_embed_client) nor the Triton
adapter and tooling beside it (qwen_embed_deploy)."""

import os
from importlib import import_module

# torch's CPU allocator reads this once, at its first allocation, so it is set here, before any
# module of the engine imports torch: its buffers of 2 MB and more then ask for transparent
# huge pages (MADV_HUGEPAGE), and the GEMMs' rows, weights and outputs need far fewer TLB
# entries (docs/tuning.md; cpu.huge_pages tells whether it took). A deployment's value wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

_HOMES = {
    "ChunkedText": "chunking",
    "CheckpointError": "loader",
    "Encoder": "engine",
    "EncoderBroken": "engine",
    "EncoderSettings": "settings",
    "ModelConfig": "config",
    "UnsupportedModelError": "config",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_HOMES[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
