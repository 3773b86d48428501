"""Thin client for Qwen embeddings served by Triton (depends on tritonclient and numpy only)."""

from .client import AsyncEmbeddingClient, EmbeddingClient, EmbeddingError, EmbeddingResult

__all__ = ["AsyncEmbeddingClient", "EmbeddingClient", "EmbeddingError", "EmbeddingResult"]
