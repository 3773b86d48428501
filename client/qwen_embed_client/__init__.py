"""Thin client for Qwen embeddings and reranking served by Triton (tritonclient and numpy only)."""

from .client import (
    AsyncEmbeddingClient,
    ChunkedEmbedding,
    Classification,
    EmbeddingClient,
    EmbeddingError,
    EmbeddingResult,
    RerankResult,
    deadline,
    metered,
)
from .maxsim import maxsim, maxsim_scores

__all__ = [
    "AsyncEmbeddingClient",
    "ChunkedEmbedding",
    "Classification",
    "EmbeddingClient",
    "EmbeddingError",
    "EmbeddingResult",
    "RerankResult",
    "deadline",
    "maxsim",
    "maxsim_scores",
    "metered",
]
