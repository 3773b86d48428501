"""Compact vectors (`embedding_type`): the server's codes against a NumPy reference of the
documented definition, written here independently, element by element."""

import numpy as np
import pytest

from qwen_embed_client.contract import EMBEDDING_TYPES, coded_outputs, compact


def reference(vector: np.ndarray, embedding_type: str) -> list[int]:
    """One vector, spelled out: per-vector scale 127 / max|x|, round half to even; bits are
    x > 0, the first dimension in the most significant bit of the first byte."""
    if embedding_type in ("int8", "uint8"):
        peak = max(abs(float(x)) for x in vector)
        codes = [0 if peak == 0 else int(round(float(x) * 127 / peak)) for x in vector]
        return codes if embedding_type == "int8" else [c + 128 for c in codes]
    bits = [1 if x > 0 else 0 for x in vector]
    bits += [0] * (-len(bits) % 8)
    packed = [
        sum(b << (7 - i) for i, b in enumerate(bits[k : k + 8])) for k in range(0, len(bits), 8)
    ]
    return packed if embedding_type == "ubinary" else [p - 128 for p in packed]


@pytest.mark.parametrize("embedding_type", EMBEDDING_TYPES[1:])
@pytest.mark.parametrize("dim", [8, 13, 64])
def test_codes_match_the_definition(embedding_type, dim):
    rng = np.random.default_rng(dim)
    vectors = rng.standard_normal((5, dim)).astype(np.float32)
    vectors[1] = 0  # all zero: codes 0 (int8), 128 (uint8), no bit set
    vectors[2] = 0
    vectors[2, :3] = [0.5, -0.5, 1.0]  # exact halves after scaling: +-63.5 -> +-64 (half even)
    codes = compact(vectors, embedding_type)
    signed = embedding_type in ("int8", "binary")
    assert codes.dtype == (np.int8 if signed else np.uint8)
    expected_width = dim if embedding_type in ("int8", "uint8") else -(-dim // 8)
    assert codes.shape == (5, expected_width)
    for row, vector in zip(codes, vectors, strict=True):
        assert row.astype(int).tolist() == reference(vector, embedding_type)
    if embedding_type == "int8":
        assert codes[2, :3].tolist() == [64, -64, 127]


def test_int8_codes_keep_the_ranking():
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((50, 256)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    codes = compact(vectors, "int8").astype(np.float32)
    codes /= np.linalg.norm(codes, axis=1, keepdims=True)
    assert np.abs(codes @ codes.T - vectors @ vectors.T).max() < 0.02


def test_each_type_in_its_own_output():
    vectors = np.ones((3, 16), np.float32)
    names = {t: list(coded_outputs(vectors, (t,))) for t in EMBEDDING_TYPES}
    assert names == {
        "float": ["EMBEDDING"],
        "int8": ["EMBEDDING_INT8"],
        "binary": ["EMBEDDING_BINARY"],
        "uint8": ["EMBEDDING_UINT8"],
        "ubinary": ["EMBEDDING_UBINARY"],
    }
    assert coded_outputs(vectors, ("binary",))["EMBEDDING_BINARY"].tolist() == [[127, 127]] * 3
    several = coded_outputs(vectors, EMBEDDING_TYPES)  # every type, each in its own output
    assert {k: v.dtype.name for k, v in several.items()} == {
        "EMBEDDING": "float32",
        "EMBEDDING_INT8": "int8",
        "EMBEDDING_UINT8": "uint8",
        "EMBEDDING_BINARY": "int8",
        "EMBEDDING_UBINARY": "uint8",
    }
    with pytest.raises(ValueError, match="embedding_type must be one of"):
        compact(vectors, "int4")
