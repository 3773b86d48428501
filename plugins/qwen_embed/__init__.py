"""qwen_embed: a tensor-parallel Qwen2/Qwen3 varlen embedding engine, usable without Triton."""

from .chunking import ChunkedText
from .config import ModelConfig, UnsupportedModelError
from .engine import Encoder, EncoderBroken
from .loader import CheckpointError
from .settings import EncoderSettings

__all__ = [
    "ChunkedText",
    "CheckpointError",
    "Encoder",
    "EncoderBroken",
    "EncoderSettings",
    "ModelConfig",
    "UnsupportedModelError",
]
