"""Compact vectors: the `embedding_type` request option (Cohere's names), computed from the
float vector after `dimensions` and `normalize`.

- "float": float32, as computed.
- "int8": each vector scaled by 127 / its own largest |value| and rounded half to even, in
  -127..127 (an all-zero vector stays zero). The scale is per vector, so a vector's codes do
  not depend on its batch, and cosine similarity between codes approximates the float one.
- "uint8": the int8 codes + 128, in 1..255.
- "ubinary": one bit per dimension, 1 where the value is > 0, packed 8 per byte, the first
  dimension in the most significant bit; a last partial byte is padded with 0 bits.
  ceil(dimensions / 8) bytes as uint8.
- "binary": the ubinary bytes - 128, as int8 (what Cohere and sentence-transformers return).

Which Triton output carries each type is the request contract's (qwen_embed_client.contract).
"""

from __future__ import annotations

import numpy as np

from qwen_embed_client.contract import EMBEDDING_OUTPUTS, EMBEDDING_TYPES


def compact(vectors: np.ndarray, embedding_type: str) -> np.ndarray:
    """float32 [n, d] -> the `embedding_type` codes [n, d] (or [n, ceil(d / 8)] for bits)."""
    if embedding_type == "float":
        return vectors
    if embedding_type in ("int8", "uint8"):
        peak = np.abs(vectors).max(axis=1, keepdims=True)
        scale = np.divide(127.0, peak, out=np.zeros_like(peak), where=peak > 0)
        codes = np.clip(np.rint(vectors * scale), -127, 127).astype(np.int8)
        return (
            codes if embedding_type == "int8" else (codes.astype(np.int16) + 128).astype(np.uint8)
        )
    if embedding_type in ("binary", "ubinary"):
        bits = np.packbits(vectors > 0, axis=1)
        return (
            bits if embedding_type == "ubinary" else (bits.astype(np.int16) - 128).astype(np.int8)
        )
    raise ValueError(
        f"embedding_type must be one of {list(EMBEDDING_TYPES)}, not {embedding_type!r}"
    )


def outputs(vectors: np.ndarray, embedding_types: tuple[str, ...]) -> dict[str, np.ndarray]:
    """A response's outputs: each asked type's codes in its own, all from the same vectors;
    the others are left out (an empty output would keep Triton's response cache from storing
    the response)."""
    return {EMBEDDING_OUTPUTS[kind]: compact(vectors, kind) for kind in embedding_types}
