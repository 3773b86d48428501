"""E2Rank's reranking (Alibaba-NLP/E2Rank): an embedding model scores each document by the
cosine of its vector with a pseudo query's, the query written after the first documents in
the listwise prompt it was trained on, as its README builds it:

  Qwen3's chat template, one user turn, thinking off, over
  "{task}\\nDocuments:\\n[1] {document}<|endoftext|>\\n[2] ...<|endoftext|>Search Query:{query}"

with each document (in the prompt and on its own) ending in <|endoftext|>, which its tokenizer
does not append; the pseudo query ends with the template. Vectors are last-token, normalised:
the embed model's own. The texts are built here, so the documents may be split over requests
and servers and each still meets the one pseudo query.
"""

from __future__ import annotations

import numpy as np

RECIPE = "e2rank"
TASK = (
    "Given a web search query and some relevant documents, rerank the documents that answer "
    "the query:"
)
PROMPT_DOCUMENTS = 20  # the documents the pseudo query reads
END = "<|endoftext|>"


def ended(documents: list[str]) -> list[str]:
    return [d + END for d in documents]


def pseudo_query(query: str, documents: list[str], task: str | None = None) -> str:
    """The pseudo query over `documents` as `ended` gives them."""
    listed = "\n".join(f"[{i}] {d}" for i, d in enumerate(documents[:PROMPT_DOCUMENTS], 1))
    content = f"{task or TASK}\nDocuments:\n{listed}Search Query:{query}"
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def scores(query_vector: np.ndarray, document_vectors: np.ndarray) -> np.ndarray:
    """Cosines of unit vectors, float32 [documents]."""
    return (document_vectors.astype(np.float64) @ query_vector.astype(np.float64)).astype(
        np.float32
    )
