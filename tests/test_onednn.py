"""Linear weights packed for oneDNN at load (onednn.py): chosen by the route on CPU float
routes only, the same results as F.linear on the plain weights, and against transformers."""

import pytest
import torch
import torch.nn.functional as F

from qwen_embed import Encoder
from qwen_embed.cpu import CpuFeatures, cpu_features
from qwen_embed.layers import _Linear
from qwen_embed.onednn import PackedWeight, available
from qwen_embed.route import Gemm
from qwen_embed.row_plans import PRIMITIVE_CACHE_CAPACITY, planned_rows

from reference import cosine, random_sequences, reference_embeddings, route_for

pytestmark = pytest.mark.skipif(not available(), reason="this torch has no oneDNN")
ZEN4 = CpuFeatures.from_flags({"avx2", "avx512f", "avx512_bf16"}, "AMD EPYC 9B14")


def test_route_packs_cpu_float_weights_only():
    # bf16 on oneDNN where batch_invariant says so (its "auto" takes the native operator)
    assert route_for(ZEN4, batch_invariant="off").gemm is Gemm.ONEDNN
    assert route_for(ZEN4, dtype="float32").gemm is Gemm.ONEDNN
    # int8's float layers
    assert route_for(ZEN4, quantization="int8", batch_invariant="off").gemm is Gemm.ONEDNN
    assert route_for(ZEN4, dtype="float32", prepack_weights=False).gemm is Gemm.TORCH
    assert route_for(ZEN4, prepack_weights=False, batch_invariant="off").gemm is Gemm.TORCH
    assert route_for(ZEN4, onednn=False).gemm is Gemm.TORCH
    assert route_for(ZEN4, "cuda:0", "bfloat16").gemm is Gemm.TORCH
    with pytest.raises(ValueError, match="prepack_weights needs"):
        route_for(ZEN4, "cuda:0", prepack_weights=True)
    with pytest.raises(ValueError, match="oneDNN"):
        route_for(ZEN4, onednn=False, prepack_weights=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weight_is_f_linear(dtype):
    if dtype == torch.bfloat16 and not cpu_features().avx512:
        pytest.skip("oneDNN packs bf16 weights with AVX-512 only; routes hold them in fp32 here")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    layer = PackedWeight(w)
    for rows in (1, 7, 16, 17, 300, 512, 513):  # 17 and 300 are padded (planned_rows)
        x = torch.randn(rows, 64, generator=g).to(dtype)
        torch.testing.assert_close(layer(x, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(3, 9, 64, generator=g).to(dtype)  # leading dims kept (27 rows: padded)
    torch.testing.assert_close(layer(x3), F.linear(x3, w), rtol=1e-5, atol=1e-5)
    if dtype == torch.float32:  # bf16 activations on fp32-held bf16 weights (layers.linear)
        xb = torch.randn(4, 64, generator=g).bfloat16()
        assert layer(xb).dtype == torch.bfloat16
        torch.testing.assert_close(layer(xb), F.linear(xb.float(), w).bfloat16())


def test_row_counts_are_padded_so_that_onednn_plans_repeat():
    rows = (1, 15, 16, 17, 18, 32, 33, 65, 250, 257, 500, 512)
    assert [planned_rows(n) for n in rows] == [2, 15, 16, 18, 18, 32, 36, 72, 256, 272, 512, 512]
    assert planned_rows(513) == 513 and planned_rows(5000) == 5000  # planning is cheap there
    planned = [planned_rows(n) for n in range(1, 513)]
    assert len(set(planned)) == 71  # few plans per GEMM shape: the launcher's cache holds them
    assert PRIMITIVE_CACHE_CAPACITY >= 6 * 71  # q|k|v, o, gate|up, down, q, k|v
    assert all(n <= p <= max(2, 1.11 * n) for n, p in enumerate(planned, 1))  # little extra work


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_encoder_matches_plain_and_transformers(checkpoint, config_name, dtype):
    # qwen2 has biased q/k/v projections; both configs run TP-free here, TP in its own tests.
    # batch_invariant off: oneDNN's GEMM, which "auto" trades for the native bf16 operator
    # wherever it runs.
    seqs = random_sequences([1, 17, 90, 200], seed=4)
    ref = reference_embeddings(checkpoint(config_name), seqs)  # fp32
    out = {}
    for packed in (True, False):
        with Encoder.from_pretrained(
            checkpoint(config_name), dtype=dtype, prepack_weights=packed, batch_invariant="off"
        ) as enc:
            linears = [m for m in enc.model.modules() if isinstance(m, _Linear)]
            assert linears and all(isinstance(m.kernel, PackedWeight) == packed for m in linears)
            assert enc.route.gemm is (Gemm.ONEDNN if packed else Gemm.TORCH)
            out[packed] = enc.embed(seqs)
    if dtype == "float32":
        assert float(abs(out[True] - out[False]).max()) <= 1e-5
        assert cosine(out[True], ref).min() >= 0.99999
    else:
        assert float(abs(out[True] - out[False]).max()) <= 1e-3
        assert cosine(out[True], ref).min() >= 0.999
