"""Late interaction (ColBERT's MaxSim) over per-token vectors (`embed_tokens`): a document's
score for a query is the sum, over the query's tokens, of each one's largest dot product with
the document's tokens (cosine when the vectors are normalised, as `embed_tokens` gives them)."""

from __future__ import annotations

import numpy as np


def maxsim(query: np.ndarray, document: np.ndarray) -> float:
    """query [q, dim], document [d, dim] -> sum over q of max over d of the dot product."""
    return float((query.astype(np.float64) @ document.astype(np.float64).T).max(axis=1).sum())


def maxsim_scores(query: np.ndarray, documents: list[np.ndarray]) -> np.ndarray:
    """Each document's MaxSim score for the query, float64 [n], in document order."""
    return np.array([maxsim(query, d) for d in documents], dtype=np.float64)
