"""ggml's quantised blocks -> float32 weights: one table of torch functions for the types most
GGUF files hold, Q8_0 (Qwen's own quantised files) and the k-quants of llama.cpp's and Ollama's
usual Q4_K_M and Q5_K_M (Q4_K or Q5_K, with Q6_K for the embedding table and some layers), each
the `gguf` package's values bit for bit (the same float32 products, in the same order) in a
fraction of its numpy's time; every other type by that package's numpy, a few blocks at a time
either way.

A block of `VALUES` weights is `SIZE` bytes; `_TYPES` holds one function per type, from blocks
[n, SIZE] (uint8) to their weights [n, VALUES] (float32).
"""

from __future__ import annotations

import numpy as np
import torch

from .gguf_files import GGUFError

_AT_ONCE = 1 << 22  # weights per pass: the temporaries stay small beside an embedding table


def _f32(field: torch.Tensor) -> torch.Tensor:
    """A float16 field of each block ([n, 2] bytes) as float32 [n, 1]."""
    return field.contiguous().view(torch.float16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """32 int8 codes after their float16 scale."""
    return blocks[:, 2:].view(torch.int8) * _f32(blocks[:, :2])


def _bits(packed: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """Bytes [n, groups, width] -> [n, groups x len(shifts), width]: each group's bits at each
    shift in turn."""
    shifted = packed[:, :, None] >> torch.tensor(shifts, dtype=torch.uint8)[:, None]
    return (shifted & mask).flatten(1, 2)


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's float16 scale and minimum, times their 8 sub-blocks' 6-bit factors
    (bytes 4-15: the low 6 bits of bytes 0-3 and 4-7 hold sub-blocks 0-3, nibbles of bytes 8-11
    with the top 2 bits of bytes 0-7 sub-blocks 4-7) -> [n, 8, 1] each."""
    low, high, rest = blocks[:, 4:16].reshape(-1, 3, 4).unbind(1)
    scales = torch.cat([low & 0x3F, (rest & 0x0F) | ((low >> 2) & 0x30)], 1)
    minima = torch.cat([high & 0x3F, (rest >> 4) | ((high >> 2) & 0x30)], 1)
    scale = _f32(blocks[:, 0:2]) * scales.float()
    minimum = _f32(blocks[:, 2:4]) * minima.float()
    return scale[:, :, None], minimum[:, :, None]


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """256 weights in 8 sub-blocks of 32: 4-bit codes (bytes 16-143, 32 bytes for two
    sub-blocks: low nibbles, then high), scaled less a minimum."""
    scale, minimum = _k_scales(blocks)
    codes = _bits(blocks[:, 16:].reshape(-1, 4, 32), [0, 4], 0x0F).float()
    return (scale * codes - minimum).flatten(1)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K's layout with a fifth bit per weight (bytes 16-47: sub-block j's in bit j)."""
    scale, minimum = _k_scales(blocks)
    low = _bits(blocks[:, 48:].reshape(-1, 4, 32), [0, 4], 0x0F)
    high = _bits(blocks[:, None, 16:48], list(range(8)), 1)
    return (scale * (low | (high << 4)).float() - minimum).flatten(1)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """256 weights in 16 sub-blocks of 16, each with an int8 scale (bytes 192-207) times the
    block's float16 one (208-209); 6-bit codes less 32: the low 4 bits in bytes 0-127 (two
    halves of 64 bytes, low nibbles then high), the top 2 in bytes 128-191 (two halves of 32
    bytes, bit pairs 0-1 to 6-7)."""
    scale = _f32(blocks[:, 208:210]) * blocks[:, 192:208].view(torch.int8).float()
    low = _bits(blocks[:, :128].reshape(-1, 2, 64), [0, 4], 0x0F).reshape(-1, 8, 32)
    high = _bits(blocks[:, 128:192].reshape(-1, 2, 32), [0, 2, 4, 6], 0x03)
    codes = (low | (high << 4)).view(torch.int8) - 32
    return (scale[:, :, None] * codes.reshape(-1, 16, 16).float()).flatten(1)


# ggml type -> (weights per block, bytes per block, dequantiser)
_TYPES = {8: (32, 34, _q8_0), 12: (256, 144, _q4_k), 13: (256, 176, _q5_k), 14: (256, 210, _q6_k)}


def _sizes(kind: int) -> tuple[int, int]:
    """(weights, bytes) of a block of ggml type `kind`."""
    if kind in _TYPES:
        return _TYPES[kind][:2]
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError as e:
        raise GGUFError(
            "a GGUF file's quantised tensors of this type are read by the `gguf` package "
            "(pip install gguf)"
        ) from e
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise GGUFError(f"tensor type {kind} of the GGUF file is not a ggml type") from None


def stored_bytes(kind: int, count: int) -> int:
    """Bytes of `count` weights of this type."""
    values, size = _sizes(kind)
    return count // values * size


def _package(kind: int):
    """The `gguf` package's numpy dequantisation of blocks of type `kind`, as a torch function."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(kind)
    return lambda blocks: torch.from_numpy(dequantize(blocks.numpy(), kind))


def dequantize(data: np.ndarray, kind: int) -> torch.Tensor:
    """A tensor's blocks (uint8 bytes) -> its weights, float32 and flat."""
    values, size = _sizes(kind)
    blocks_to_weights = _TYPES[kind][2] if kind in _TYPES else _package(kind)
    blocks = torch.from_numpy(data).view(-1, size)
    out = torch.empty(len(blocks), values)
    step = max(1, _AT_ONCE // values)
    try:
        for at in range(0, len(blocks), step):
            out[at : at + step] = blocks_to_weights(blocks[at : at + step])
    except NotImplementedError as e:  # a type the package names but does not dequantize
        raise GGUFError(f"tensor type {kind} of the GGUF file is not read: {e}") from e
    return out.flatten()
