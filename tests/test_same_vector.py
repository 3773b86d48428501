"""A text's vector does not depend on the batch it arrives in, up to what the machine's GEMM
kernels allow: every elementwise op has one numerics path whatever the batch size, so what
remains is each row of a GEMM coming out the same at any row count. That holds for the oneDNN
kernels on AVX-512 CPUs without AMX (bf16) and for packed fp32; on AMX CPUs oneDNN's bf16
kernels accumulate differently for different row counts, which this test bounds instead."""

import numpy as np
import pytest
import torch

from qwen_embed import Encoder
from qwen_embed.onednn import PackedWeight, available

from reference import cosine, random_sequences

# The demo model's shapes (Qwen3-Embedding-0.6B's widths), where the GEMM kernels a small
# and a large batch take could differ.
LENGTHS = [3, 9, 17, 20, 33, 48, 64, 90, 128, 140, 200, 257, 300, 17, 5, 512]
# Exact up to the GEMMs: what the elementwise path must hold (bf16), and fp32's rounding.
EXACT = {"bfloat16": 1e-5, "float32": 1e-6}
# Where the bf16 GEMM itself depends on the row count (AMX): one bf16 rounding step of a
# vector component of size ~0.1, and the direction all but unchanged.
GEMM_BOUND_MAX_ABS, GEMM_BOUND_COSINE = 5e-3, 0.9999


def gemm_rows_independent(dtype: torch.dtype) -> bool:
    """Whether this machine's packed GEMM gives a row the same result at any row count."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3072, 1024, generator=g).to(dtype)
    x = torch.randn(300, 1024, generator=g).to(dtype)
    layer = PackedWeight(w)
    full = layer(x)
    return all(torch.equal(layer(x[:m]), full[:m]) for m in (1, 3, 17, 64, 128))


@pytest.mark.skipif(not available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_alone_and_among_other_texts_give_the_same_vector(demo_dir, dtype):
    seqs = random_sequences(LENGTHS, vocab_size=151643, seed=21)
    with Encoder.from_pretrained(demo_dir, dtype=dtype, prefix_reuse=False) as enc:
        together = enc.embed(seqs)
        alone = np.stack([enc.embed([s])[0] for s in seqs])
        again = enc.embed(seqs[::-1])[::-1]  # another order: other neighbours in each forward
    for other in (alone, again):
        diff = np.abs(other - together).max()
        if gemm_rows_independent(getattr(torch, dtype)):
            assert diff <= EXACT[dtype]
        else:
            assert diff <= GEMM_BOUND_MAX_ABS
            assert cosine(other, together).min() >= GEMM_BOUND_COSINE
