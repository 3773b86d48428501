"""qwen_embed: a tensor-parallel Qwen2/Qwen3 varlen embedding engine, usable without Triton."""

from .config import ModelConfig, UnsupportedModelError
from .engine import Encoder, EncoderBroken
from .loader import CheckpointError
from .settings import EncoderSettings

__all__ = [
    "CheckpointError",
    "Encoder",
    "EncoderBroken",
    "EncoderSettings",
    "ModelConfig",
    "UnsupportedModelError",
]
