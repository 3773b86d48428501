"""A text's vector does not depend on the batch it arrives in: alone, among 64 other texts, in
another order, or after its shared prefix was cached (reuse on == off), on the native kernels of
each instruction set the CPU runs. Every elementwise op and the attention operator compute each
row alone in a fixed order, and GEMMs never run one row (row_plans.planned_rows), so what remains
is each row of a GEMM coming out the same at any row count. That holds in fp32, and in bf16 for
oneDNN's kernels on AVX-512 CPUs without AMX. On AMX CPUs oneDNN's bf16 kernels accumulate
differently for different row counts: there batch_invariant "off" gives vectors within a bound
only, and "auto" (the default) and "on" (bf16 GEMMs on the native operator,
onednn.NativeBf16Weight, wherever it runs) must give them bitwise, as everywhere. The int8
route's quantised layers are exact integer sums over per-row codes; its float layers are the
route's bf16 GEMMs."""

import functools

import numpy as np
import pytest
import torch

from qwen_embed import Encoder, int8, native
from qwen_embed.config import ModelConfig
from qwen_embed.cpu import cpu_features
from qwen_embed.layers import linear_weight_dtype
from qwen_embed.onednn import PackedWeight, available
from qwen_embed.route import Route, choose_route
from qwen_embed.settings import EncoderSettings

from reference import WIDE_CONFIGS, cosine, random_sequences

# The demo model's widths (Qwen3-Embedding-0.6B's), where the GEMM kernels a small and a large
# batch take could differ; a small vocabulary (reference.WIDE_CONFIGS) loads faster. The fast
# tier's texts (about 800 rows with the prefixed ones) against one alone; the server tier's 64
# texts, about 8K rows, a full forward's.
LENGTHS = {
    "small": [3, 9, 17, 20, 33, 64, 128, 257],
    "full": [3, 9, 17, 20, 33, 48, 64, 90, 128, 140, 200, 257, 300, 17, 5, 512] * 4,
}
WIDEST = native.isa()  # at import, before a test selects another: what the engine runs here
PREFIX = 40  # tokens the prefix-sharing texts begin with (a long instruction)
# Where the bf16 GEMM itself depends on the row count (AMX, batch_invariant off): one bf16
# rounding step of a vector component of size ~0.1, and the direction all but unchanged; int8
# codes of the rows after such a GEMM may round the other way, within the route's own accuracy.
GEMM_BOUND_MAX_ABS = 5e-3
GEMM_BOUND_COSINE = {"none": 0.9999, "int8": 0.999}
# The fast tier's routes: fp32, and the default (bf16, batch_invariant auto)
FAST = [("float32", "none", "off"), ("bfloat16", "none", "auto")]


@functools.cache
def gemm_rows_independent(dtype: torch.dtype) -> bool:
    """Whether this machine's packed oneDNN GEMM gives a row the same result at any row count,
    for the demo model's GEMM shapes (q|k|v, o, gate|up, down)."""
    g = torch.Generator().manual_seed(0)
    for out_features, in_features in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)):
        # the weights as the route holds them (fp32 where the CPU has no bf16 instructions)
        w = torch.randn(out_features, in_features, generator=g).to(dtype)
        w = w.to(linear_weight_dtype(dtype, torch.device("cpu")))
        x = torch.randn(600, in_features, generator=g).to(dtype)
        layer = PackedWeight(w)
        full = layer(x)
        if not all(torch.equal(layer(x[:m]), full[:m]) for m in (1, 2, 3, 17, 64, 128, 300)):
            return False
    return True


def route(model_dir, **settings) -> Route:
    config = ModelConfig.from_dir(model_dir)
    return choose_route(EncoderSettings(**settings), config, "cpu", cpu_features())


def assert_same(a: np.ndarray, b: np.ndarray, exact: bool, quantization: str) -> None:
    if exact:
        assert np.array_equal(a, b)
    else:
        assert np.abs(a - b).max() <= GEMM_BOUND_MAX_ABS
        assert cosine(a, b).min() >= GEMM_BOUND_COSINE[quantization]


@pytest.mark.skipif(not available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize(
    "dtype,quantization,batch_invariant",
    [
        *FAST,
        # the same matrix's other routes: the server tier's
        pytest.param("bfloat16", "none", "off", marks=pytest.mark.server),
        pytest.param("bfloat16", "int8", "off", marks=pytest.mark.server),
        pytest.param("bfloat16", "none", "on", marks=pytest.mark.server),
        pytest.param("bfloat16", "int8", "on", marks=pytest.mark.server),
    ],
)
@pytest.mark.parametrize("size", ["small", pytest.param("full", marks=pytest.mark.server)])
def test_alone_among_others_and_after_a_cached_prefix(
    isa, checkpoint, dtype, quantization, batch_invariant, size
):
    """On the native kernels (attention included) of every instruction set this CPU runs."""
    lengths = LENGTHS[size]
    if quantization == "int8" and not int8.native_kernel():
        # the integer products (the AVX2 operator's, test_int8_avx2.py, or torch's
        # int8.integer_products) are the same exact sums whatever kernels the row ops take and
        # at any row count: the small size's shortest texts on the widest ISA cover the route;
        # the float layers at full size are the cases without int8
        if size == "full" or isa != WIDEST:
            pytest.skip("int8 without the VNNI operator: the small size on the widest ISA")
        lengths = lengths[:5]
    held_fp32 = linear_weight_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32
    if batch_invariant == "on" and held_fp32:
        # without bf16 instructions bf16 layers run as fp32 GEMMs whatever batch_invariant says
        pytest.skip("no bf16 instructions: 'on' is the 'off' route here")
    if size == "small" and isa != WIDEST:
        pytest.skip("the small size on the widest instruction set; every one at full size")
    if size == "full" and isa != WIDEST and (dtype, quantization, batch_invariant) not in FAST:
        # the GEMM kernels are the CPU's whatever instruction set the row ops take
        # (gemm/ops.cpp): each set's row ops at full size on the fast tier's routes, the other
        # routes' GEMMs at full size on the widest
        pytest.skip("the other GEMM routes at full size on the widest instruction set")
    model_dir = checkpoint("demo_widths")
    if (dtype, quantization, batch_invariant) == ("bfloat16", "none", "off"):
        routes = [route(model_dir, dtype=dtype, batch_invariant=b) for b in ("off", "auto")]
        if routes[0] == routes[1]:
            pytest.skip("'off' is the default 'auto' route here (no native operator)")
    # "auto" (the default) takes the operator wherever it runs, "off" oneDNN's GEMM: row-invariant
    # in fp32, and in bf16 without AMX
    exact = batch_invariant != "off" or gemm_rows_independent(getattr(torch, dtype))
    vocab = WIDE_CONFIGS["demo_widths"]["vocab_size"]
    mixed = random_sequences(lengths, vocab_size=vocab, seed=21)
    prefix = random_sequences([PREFIX], vocab_size=vocab, seed=22)[0]
    tails = random_sequences([5, 30, 77], vocab_size=vocab, seed=23)
    prefixed = [prefix + t for t in tails]
    settings = dict(
        dtype=dtype,
        quantization=quantization,
        attn_backend="native",
        batch_invariant=batch_invariant,
    )
    with Encoder.from_pretrained(model_dir, prefix_reuse=False, **settings) as enc:
        assert (enc.route.elementwise, enc.route.native_isa) == ("native", isa)
        together = enc.embed(mixed + prefixed)
        first = mixed[:8]
        alone = np.stack([enc.embed([s])[0] for s in first + prefixed])
        # Other neighbours in each forward: the small size's question. The full size asks about
        # the row count, which alone against together answers.
        if size == "small":
            assert_same(enc.embed((mixed + prefixed)[::-1])[::-1], together, exact, quantization)
    with Encoder.from_pretrained(model_dir, prefix_reuse=True, **settings) as enc:
        enc.embed(prefixed[1:])  # their shared prefix is found and cached
        cached = np.stack([enc.embed([s])[0] for s in prefixed])
        assert enc.prefix_cache.hits >= len(prefixed)
    n = len(mixed)
    assert_same(alone, together[np.r_[0 : len(first), n : n + 3]], exact, quantization)
    # the attention operator gives bitwise the same rows after a cached prefix (reuse on ==
    # off); the segments around it change the GEMMs' row counts only
    assert_same(cached, together[n:], exact, quantization)
