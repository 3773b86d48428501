"""qwen_embed: a tensor-parallel Qwen2/Qwen3 varlen embedding engine, usable without Triton.

The names below load on first use, so a process that needs only the light modules never
imports torch. The engine imports neither the client (qwen_embed_client) nor the Triton
adapter and tooling beside it (qwen_embed_deploy)."""

from importlib import import_module

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
