"""Thin client for Qwen embeddings and reranking served by Triton (tritonclient and numpy only)."""

from .client import (
    AsyncEmbeddingClient,
    ChunkedEmbedding,
    EmbeddingClient,
    EmbeddingError,
    EmbeddingResult,
    RerankResult,
)

__all__ = [
    "AsyncEmbeddingClient",
    "ChunkedEmbedding",
    "EmbeddingClient",
    "EmbeddingError",
    "EmbeddingResult",
    "RerankResult",
]
