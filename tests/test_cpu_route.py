"""The arithmetic route (route.choose_route) as a pure function of the CPU's features, and the
int8 route's parity against transformers (cosine >= 0.999 against fp32)."""

import dataclasses

import pytest
import torch

from qwen_embed import Encoder, int8
from qwen_embed.cpu import CpuFeatures, cpu_features
from qwen_embed.layers import _Linear
from qwen_embed.route import choose_route

from reference import cosine, random_sequences, reference_embeddings

INT8_COSINE = 0.999
EPYC_AVX2 = CpuFeatures.from_flags({"avx", "avx2", "fma"}, "AMD EPYC 7B13")
ZEN4 = CpuFeatures.from_flags({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}, "AMD EPYC 9B14")
SAPPHIRE = CpuFeatures.from_flags(
    {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8"},
    "Intel Xeon Platinum 8481C",
)


def test_features_from_cpuinfo_flags():
    assert not EPYC_AVX2.native_bf16 and not EPYC_AVX2.vnni and EPYC_AVX2.avx2
    assert ZEN4.native_bf16 and ZEN4.avx512_bf16 and not ZEN4.amx_bf16 and ZEN4.vnni
    assert SAPPHIRE.native_bf16 and SAPPHIRE.amx_bf16
    # amx_bf16 without the tile unit (or the reverse) is not AMX
    assert not CpuFeatures.from_flags({"amx_bf16"}).native_bf16
    assert "no AMX" in ZEN4.describe() and "AVX512_BF16" in ZEN4.describe()


@pytest.mark.parametrize("features", [ZEN4, SAPPHIRE], ids=["avx512_bf16", "amx"])
def test_auto_is_bf16_where_the_cpu_has_bf16_instructions(features):
    route = choose_route("auto", "none", "cpu", "bfloat16", features)
    assert (route.dtype, route.linear) == ("bfloat16", "bfloat16, oneDNN-packed weights")
    assert route.prepacked
    assert "native bf16" in route.reason and features.model in route.reason


def test_auto_is_fp32_without_bf16_instructions():
    # whatever the checkpoint says: bf16 would be emulated
    route = choose_route("auto", "none", "cpu", "bfloat16", EPYC_AVX2)
    assert (route.dtype, route.linear) == ("float32", "float32, oneDNN-packed weights")
    assert "no bf16 instructions" in route.reason


def test_explicit_dtype_and_gpu_auto():
    assert choose_route("float32", "none", "cpu", None, SAPPHIRE).dtype == "float32"
    route = choose_route("bfloat16", "none", "cpu", None, EPYC_AVX2)
    assert route.linear == "bfloat16 as fp32 GEMM, oneDNN-packed weights"
    assert "set by the deployment" in route.reason
    assert choose_route("auto", "none", "cuda", "bfloat16", EPYC_AVX2).dtype == "bfloat16"
    assert choose_route("auto", "none", "cuda", None, EPYC_AVX2).dtype == "float32"


def test_int8_route_and_refusals():
    route = choose_route("auto", "int8", "cpu", None, ZEN4)
    assert route.dtype == "bfloat16" and route.linear.startswith("int8") and not route.prepacked
    assert choose_route("auto", "int8", "cpu", None, EPYC_AVX2).dtype == "float32"
    with pytest.raises(ValueError, match="CPU only"):
        choose_route("auto", "int8", "cuda", None, ZEN4)
    with pytest.raises(ValueError, match="quantization must be one of"):
        choose_route("auto", "int4", "cpu", None, ZEN4)
    with pytest.raises(ValueError, match="dtype must be"):
        choose_route("fp8", "none", "cpu", None, ZEN4)


def test_encoder_reports_its_route(checkpoint):
    with Encoder.from_pretrained(checkpoint("qwen3"), device="cpu") as enc:
        expected = choose_route("auto", "none", "cpu", None, cpu_features())
        assert dataclasses.replace(enc.route, attention="") == expected


def test_int8_linear_is_close_to_the_float_product():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 256, generator=g), torch.randn(96, 256, generator=g)
    exact = x.double() @ w.double().T
    layer = int8.Int8Weight(w)
    assert layer.qweight.dtype == torch.int8 and layer.scale.shape == (1, 96)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (37, 96)
    # int8 per-token x per-channel: ~1% of the output's scale, far from exact (no cheat)
    err = (out.double() - exact).abs().max() / exact.abs().max()
    assert 1e-5 < err < 0.02
    assert torch.equal(int8.quantize_rows(x)[0], int8.quantize_rows(x)[0])  # deterministic


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_matches_transformers(checkpoint, config_name, dtype):
    seqs = random_sequences([1, 17, 90, 200], seed=3)
    ref = reference_embeddings(checkpoint(config_name), seqs)  # fp32
    with Encoder.from_pretrained(checkpoint(config_name), dtype=dtype, quantization="int8") as enc:
        linears = [m for m in enc.model.modules() if isinstance(m, _Linear)]
        assert linears and all(
            isinstance(m.kernel, int8.Int8Weight) and m.weight is None for m in linears
        )
        out = enc.embed(seqs)
    assert cosine(out, ref).min() >= INT8_COSINE
