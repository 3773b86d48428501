"""The arithmetic route (route.choose_route) as a pure function of the settings and the CPU's
features, and the int8 route's parity against transformers (cosine >= 0.999 against fp32)."""

import pytest
import torch

from qwen_embed import Encoder, int8
from qwen_embed.config import ModelConfig
from qwen_embed.cpu import CpuFeatures, cpu_features
from qwen_embed.layers import _Linear
from qwen_embed.route import Gemm, Linear, Route, choose_route
from qwen_embed.settings import EncoderSettings

from reference import cosine, model_config, random_sequences, reference_embeddings, route_for

INT8_COSINE = 0.999
EPYC_AVX2 = CpuFeatures.from_flags({"avx", "avx2", "fma"}, "AMD EPYC 7B13")
ZEN4 = CpuFeatures.from_flags({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}, "AMD EPYC 9B14")
SAPPHIRE = CpuFeatures.from_flags(
    {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8"},
    "Intel Xeon Platinum 8481C",
)
# the same Xeon under a hypervisor that hides its AMX tiles (AVX512_BF16 without AMX)
XEON_HIDDEN_AMX = CpuFeatures.from_flags(
    {"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}, "Intel(R) Xeon(R) Processor"
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
    route = route_for(features, checkpoint_dtype="bfloat16")
    assert (route.dtype, route.linear) == ("bfloat16", Linear.FLOAT)
    assert "native bf16" in route.reason and features.model in route.reason
    # batch_invariant "auto": the native operator (route_for: it runs)
    assert route.gemm is Gemm.NATIVE_BF16
    assert route.gemm.value in route.describe()


def test_auto_is_fp32_without_bf16_instructions():
    # whatever the checkpoint says: bf16 would be emulated
    route = route_for(EPYC_AVX2, checkpoint_dtype="bfloat16")
    assert (route.dtype, route.linear, route.gemm) == ("float32", Linear.FLOAT, Gemm.NATIVE_F32)
    assert "no bf16 instructions" in route.reason


def test_auto_is_fp32_on_intel_cores_without_amx():
    """Their VDPBF16PS multiplies slower than fp32 FMAs: bf16 only where the deployment asks."""
    assert XEON_HIDDEN_AMX.native_bf16 and not XEON_HIDDEN_AMX.bf16_outruns_fp32
    assert ZEN4.bf16_outruns_fp32 and SAPPHIRE.bf16_outruns_fp32
    route = route_for(XEON_HIDDEN_AMX, checkpoint_dtype="bfloat16")
    assert (route.dtype, route.linear) == ("float32", Linear.FLOAT)
    assert "multiplies fp32 faster than bf16" in route.reason
    asked = route_for(XEON_HIDDEN_AMX, dtype="bfloat16")
    assert (asked.dtype, asked.linear, asked.gemm) == ("bfloat16", Linear.FLOAT, Gemm.NATIVE_BF16)


def test_explicit_dtype_and_gpu_auto():
    assert route_for(SAPPHIRE, dtype="float32").dtype == "float32"
    route = route_for(EPYC_AVX2, dtype="bfloat16")
    assert route.linear is Linear.FP32_GEMM and "as fp32 GEMM" in route.describe()
    assert "set by the deployment" in route.reason
    # fp16 on any CPU: oneDNN packs fp16 weights only where the CPU converts fp16 itself
    for features in (EPYC_AVX2, ZEN4, SAPPHIRE):
        assert route_for(features, dtype="float16").linear is Linear.FP32_GEMM
    assert route_for(EPYC_AVX2, "cuda:0", "bfloat16").dtype == "bfloat16"
    # an fp32 checkpoint on a GPU runs in bf16 (fp16 where the GPU has no bf16), fp32 if asked
    assert route_for(EPYC_AVX2, "cuda:0").dtype == "bfloat16"
    assert route_for(EPYC_AVX2, "cuda:0", "float32").dtype == "bfloat16"
    assert route_for(EPYC_AVX2, "cuda:0", gpu_bf16=False).dtype == "float16"
    assert route_for(EPYC_AVX2, "cuda:0", "float16").dtype == "float16"
    assert route_for(EPYC_AVX2, "cuda:0", dtype="float32").dtype == "float32"
    # a bf16 checkpoint (Qwen3-Embedding ships one) on a GPU without bf16 (a T4, a V100): fp16
    route = route_for(EPYC_AVX2, "cuda:0", "bfloat16", gpu_bf16=False)
    assert route.dtype == "float16" and "has no bf16" in route.reason
    assert route_for(EPYC_AVX2, "cuda:0", "bfloat16", gpu_bf16=False, dtype="bfloat16").dtype == (
        "bfloat16"
    )
    assert "float32 checkpoint runs in bfloat16" in route_for(EPYC_AVX2, "cuda:0").reason
    assert route_for(EPYC_AVX2, "cuda:0").gemm is Gemm.TORCH
    # Nothing beyond torch on a GPU: its varlen FlashAttention where the GPU runs it, else the
    # per-segment loop.
    route = route_for(EPYC_AVX2, "cuda:0")
    assert (route.attn_backend, route.attention_reason) == (
        "torch",
        "auto: PyTorch's varlen FlashAttention, one call per layer",
    )
    assert "per segment" in route_for(EPYC_AVX2, "cuda:0", gpu_bf16=False).attention_reason
    assert "per segment" in route_for(EPYC_AVX2, "cuda:0", dtype="float32").attention_reason


def test_int8_route_and_refusals():
    route = route_for(ZEN4, quantization="int8")
    assert route.dtype == "bfloat16" and route.linear is Linear.INT8
    assert route.gemm is Gemm.NATIVE_BF16  # the layers int8 keeps in floats
    assert "no VNNI" not in route.reason
    # without VNNI the route says what multiplies: the native AVX2 operator where it is built
    route = route_for(EPYC_AVX2, quantization="int8", native_isa=lambda: "avx2")
    assert route.dtype == "float32" and "no VNNI on this CPU" in route.reason
    assert "native AVX2 operator" in route.reason
    assert (
        "float64 GEMMs" in route_for(EPYC_AVX2, quantization="int8", native_isa=lambda: None).reason
    )
    with pytest.raises(ValueError, match="CPU only"):
        route_for(ZEN4, "cuda:0", quantization="int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        route_for(ZEN4, quantization="int4")
    with pytest.raises(ValueError, match="dtype must be"):
        route_for(ZEN4, dtype="fp8")


def test_fp8_route_and_refusals():
    """fp8 computes around bf16 on GPUs with fp8 tensor cores, and runs on any CPU to check."""
    gpu = route_for(EPYC_AVX2, "cuda:0", quantization="fp8", checkpoint_dtype="float16")
    assert (gpu.dtype, gpu.linear, gpu.gemm) == ("bfloat16", Linear.FP8, Gemm.TORCH)
    assert "fp8 e4m3" in gpu.describe() and "set by the deployment" in gpu.reason
    for features in (EPYC_AVX2, ZEN4):
        cpu = route_for(features, quantization="fp8")
        assert (cpu.dtype, cpu.linear) == ("bfloat16", Linear.FP8)
        assert "to check the route" in cpu.reason
    # on AVX2 the layers kept in floats are bf16 held in fp32, as dtype bfloat16's are
    assert route_for(EPYC_AVX2, quantization="fp8").gemm is Gemm.NATIVE_F32
    assert route_for(EPYC_AVX2, quantization="fp8", dtype="bfloat16").linear is Linear.FP8
    with pytest.raises(ValueError, match="fp8 tensor cores"):
        route_for(EPYC_AVX2, "cuda:0", gpu_bf16=False, quantization="fp8")
    for dtype in ("float32", "float16"):
        with pytest.raises(ValueError, match="dtype must be auto or bfloat16"):
            route_for(EPYC_AVX2, "cuda:0", quantization="fp8", dtype=dtype)


def test_reuse_and_pruning_follow_the_model_and_pooling():
    assert route_for(ZEN4).prefix_reuse and route_for(ZEN4).prune
    assert not route_for(ZEN4, prefix_reuse=False).prefix_reuse
    mean = route_for(ZEN4, pooling="mean")
    assert not mean.prefix_reuse and not mean.prune
    bidirectional = choose_route(EncoderSettings(), model_config(is_causal=False), "cpu", ZEN4)
    assert not bidirectional.prefix_reuse and bidirectional.prune
    with pytest.raises(ValueError, match="prefix_reuse needs causal attention"):
        choose_route(EncoderSettings(prefix_reuse=True), model_config(is_causal=False), "cpu", ZEN4)


def test_route_is_plain_data_that_travels_whole():
    route = route_for(ZEN4)
    assert Route.from_dict(route.to_dict()) == route
    labels = route.labels()
    assert labels["linear"] == "float" and labels["gemm"] == Gemm.NATIVE_BF16.value
    assert labels["dtype"] in route.describe() and route.attention_reason in route.describe()


def test_encoder_reports_its_route(checkpoint):
    with Encoder.from_pretrained(checkpoint("qwen3"), device="cpu") as enc:
        config = ModelConfig.from_dir(checkpoint("qwen3"))
        assert enc.route == choose_route(EncoderSettings(), config, "cpu", cpu_features())


def test_int8_linear_is_close_to_the_float_product():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 256, generator=g), torch.randn(96, 256, generator=g)
    exact = x.double() @ w.double().T
    layer = int8.Int8Weight(w)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (37, 96)
    # int8 per-token x per-channel: ~1% of the output's scale, far from exact (no cheat)
    err = (out.double() - exact).abs().max() / exact.abs().max()
    assert 1e-5 < err < 0.02
    assert torch.equal(int8.quantize_rows(x)[0], int8.quantize_rows(x)[0])  # deterministic


def test_int8_products_without_vnni_are_torchs_int8_gemm():
    """The float64 products CPUs without VNNI take give torch's int32 sums bit for bit, at the
    largest codes too (|sum| up to 3,072 x 127 x 127), any row count."""
    g = torch.Generator().manual_seed(1)
    for rows, k in ((1, 16), (5, 1024), (33, 3072)):
        xq = torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int8)
        wq = torch.randint(-127, 128, (24, k), generator=g, dtype=torch.int8)
        xq[0], wq[0], wq[1] = 127, 127, -127  # the extreme sums
        want = torch._int_mm(xq, wq.t())
        got = int8.integer_products(xq, wq, vnni=False)
        assert torch.equal(got, want.double()), (rows, k)
        assert torch.equal(int8.integer_products(xq, wq, vnni=True), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_matches_transformers(checkpoint, config_name, dtype):
    seqs = random_sequences([1, 17, 90, 200], seed=3)
    ref = reference_embeddings(checkpoint(config_name), seqs)  # fp32
    with Encoder.from_pretrained(checkpoint(config_name), dtype=dtype, quantization="int8") as enc:
        linears = {n: m for n, m in enc.model.named_modules() if isinstance(m, _Linear)}
        assert linears and all(
            isinstance(m.kernel, int8.Int8Weight) == int8.quantizes(n) and m.weight is None
            for n, m in linears.items()
        )
        # per layer the attention's values and output projection stay in floats; q|k and the
        # MLP's projections are int8, their inputs rotated
        assert sum(map(int8.quantizes, linears)) == len(linears) - 2 * len(enc.model.layers)
        first = enc.model.layers[0]
        assert first.self_attn.projections == (("q", "k"), ("v",))
        assert isinstance(first.self_attn.qk_proj.kernel, int8.Int8Weight)
        assert isinstance(first.mlp.down_proj.kernel, int8.Int8Weight)
        assert first.mlp.down_proj.kernel.rotation > 1
        out = enc.embed(seqs)
    assert cosine(out, ref).min() >= INT8_COSINE


@pytest.mark.server  # full size: the fast tier has the tiny configs' int8 tests
def test_int8_on_the_demo_model_shape(demo_dir):
    """Qwen3-Embedding-0.6B's widths, texts of random ids: the int8 route against fp32. The
    attention's values and output projection stay in floats (int8.FLOAT_LAYERS); quantising
    the values too gives ~0.9990 on the 4-layer benchmark model (perf/bench_routes.py int8)."""
    seqs = random_sequences([5, 17, 40, 90, 128, 200, 300, 511, 33, 64], vocab_size=151643, seed=3)
    with Encoder.from_pretrained(demo_dir, dtype="float32", prefix_reuse=False) as enc:
        reference = enc.embed(seqs)
    with Encoder.from_pretrained(
        demo_dir, dtype="float32", prefix_reuse=False, quantization="int8"
    ) as enc:
        out = enc.embed(seqs)
    assert cosine(out, reference).min() >= INT8_COSINE
