"""The native CPU kernels (qwen_embed/native) against the torch ops they replace, for every
instruction set this CPU can run, in fp32 and bf16, on the layouts the model hands them."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_cpu_route import ZEN4
from test_kernels import check_fp32_weight_norm, check_gated_delta_rule

from qwen_embed import avx2_gemm, int8, native
from qwen_embed.avx2_gemm import Avx2F32Weight
from qwen_embed.kernels import native_cpu, reference
from qwen_embed.layers import RMSNorm
from qwen_embed.route import choose_route
from qwen_embed.settings import EncoderSettings

from reference import model_config

OPS = torch.ops.qwen_embed if native.isa() else None
# fp32: a few float ulps; bf16: the kernels round once where torch's ops round twice, so a
# value may land one bf16 step (2**-8 relative) away.
TOLERANCE = {torch.float32: dict(rtol=2e-6, atol=1e-6), torch.bfloat16: dict(rtol=2**-7, atol=1e-3)}


def test_the_kernels_are_built_where_a_compiler_is():
    """`make setup` builds them; only a machine without a C++ compiler runs torch's ops."""
    if shutil.which("c++") or shutil.which("g++"):
        assert native.isa() in native.ISAS


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


def _random(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(dtype)


@DTYPES
@pytest.mark.parametrize("width", [1024, 1000])  # 1,000: the kernels' scalar tail too
def test_rms_norm_matches_torch_on_strided_rows(isa, dtype, width):
    wide = _random(37, 1536, dtype=dtype)
    x = wide[:, 100 : 100 + width]  # rows with a row stride of 1,536
    weight = _random(width, dtype=dtype, seed=1)
    torch.testing.assert_close(
        OPS.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), **TOLERANCE[dtype]
    )
    three_d = _random(5, 4, 128, dtype=dtype)
    head_weight = _random(128, dtype=dtype, seed=2)
    out = OPS.rms_norm(three_d, head_weight, 1e-6)
    assert out.shape == three_d.shape
    torch.testing.assert_close(
        out, reference.rms_norm(three_d, head_weight, 1e-6), **TOLERANCE[dtype]
    )


@pytest.mark.parametrize("width", [1024, 1000])
def test_rms_norm_with_an_fp32_weight_rounds_once(isa, width):
    check_fp32_weight_norm(native_cpu, "cpu", width)


@DTYPES
@pytest.mark.parametrize(("key_dim", "value_dim"), [(128, 128), (16, 24), (30, 40)])
def test_gated_delta_rule_matches_the_chunked_form(isa, dtype, key_dim, value_dim):
    check_gated_delta_rule(native_cpu, "cpu", dtype, key_dim, value_dim)


@DTYPES
@pytest.mark.parametrize("head_dim", [64, 128, 96, 32])  # 96 and 32: scalar tails
@pytest.mark.parametrize("with_norm", [True, False])
def test_rotary_matches_torch_on_a_qkv_slice(isa, dtype, head_dim, with_norm):
    """q is a strided slice of the packed q|k|v projection, as the attention layer has it."""
    t, heads, kv_heads = 19, 4, 2
    qkv = _random(t, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim]
    angles = torch.arange(t).float()[:, None] * torch.rand(head_dim // 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    norm = None
    if with_norm:
        norm = RMSNorm(head_dim, 1e-6).to(dtype)
        norm.weight.data.copy_(_random(head_dim, dtype=dtype, seed=3))
    weight = None if norm is None else norm.weight
    out = OPS.rope(q, cos, sin, head_dim, weight, 1e-6)
    heads_in = q.reshape(t, heads, head_dim)
    # normalised and rounded to the dtype by torch's ops, as transformers does
    normed = reference.rms_norm(heads_in, norm.weight, 1e-6) if norm else heads_in
    # The rotation in float64, rounded once: the kernel's fp32 expression may differ by a step.
    expected = reference.rotary(normed.double(), cos.double(), sin.double()).to(dtype)
    assert out.shape == (t, heads, head_dim) and out.is_contiguous()
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@DTYPES
@pytest.mark.parametrize("width", [3072, 1000])
def test_silu_mul_matches_torch(isa, dtype, width):
    gate_up = _random(23, 2 * width, dtype=dtype)
    gate_up[0, :8] = torch.tensor([-200.0, -88.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 200.0])
    expected = reference.silu_mul(gate_up.double()).to(dtype)
    torch.testing.assert_close(OPS.silu_mul(gate_up), expected, **TOLERANCE[dtype])


@DTYPES
@pytest.mark.parametrize("width", [4096, 1000])
def test_gelu_tanh_matches_torch(isa, dtype, width):
    """As x sigmoid(2u): no cancellation where torch's 1 + tanh(u) loses digits (x near -5)."""
    x = _random(23, width, dtype=dtype)
    x[0, :10] = torch.tensor([-200.0, -88.0, -30.0, -5.0, -3.0, -1e-3, 0.0, 1e-3, 30.0, 200.0])
    expected = reference.gelu_tanh(x.double())
    out = OPS.gelu_tanh(x)
    torch.testing.assert_close(out, expected.to(dtype), **TOLERANCE[dtype])
    if dtype == torch.float32:  # where torch's fp32 cancels, ours keeps 5 digits
        assert abs(out[0, 3].item() / expected[0, 3].item() - 1) < 1e-5


@DTYPES
@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_the_int8_rotation_is_the_torch_butterflies_bitwise(isa, dtype, block):
    """int8.py's rotation: the native kernels take the butterflies in the torch order, so the
    same floats (the int8 codes of a row must not depend on the instruction set)."""
    wide = _random(9, 3 * block + 40, dtype=dtype)
    x = wide[:, 40:]  # strided rows
    out = OPS.hadamard_rows(x, block)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.equal(out, int8.torch_hadamard_rows(x.float(), block))
    assert torch.equal(OPS.hadamard_rows(x.reshape(3, 3, -1), block).view(9, -1), out)
    with pytest.raises(RuntimeError, match="rotation must be"):
        OPS.hadamard_rows(x[:, 1:], block)


@DTYPES
@pytest.mark.parametrize(
    "k,block", [(48, 16), (96, 32), (320, 64), (1024, 128), (2560, 128), (10, 1)]
)
def test_int8_weight_codes_are_the_torch_route_bitwise(isa, dtype, k, block):
    """An int8 weight's codes and scales at load (rotated in float64, quantised per row): the
    same as torch's ops, on strided rows of values over 16 decades, an outlier, a zero row and
    rows that land on halves (round half to even)."""
    g = torch.Generator().manual_seed(k)
    wide = torch.randn(37, k + 8, generator=g) * 10.0 ** torch.randint(-8, 8, (37, 1), generator=g)
    wide[3, 8 + k // 2] = 5e4
    wide[5] = 0.0
    wide[6, 8:] = torch.arange(k) % 5 - 2.0  # without rotation: codes on exact halves
    w = wide[:, 8:].to(dtype)
    codes, scales, sums = OPS.weight_codes(w, block)
    expected = int8.torch_weight_codes(w, block)
    assert codes.dtype == torch.int8 and scales.shape == (37, 1) and sums.dtype == torch.int32
    assert torch.equal(codes, expected[0]) and torch.equal(scales, expected[1])
    assert torch.equal(sums, expected[2]) and torch.equal(sums, codes.sum(1, dtype=torch.int32))
    assert codes.abs().max() == 127 and not codes[5].any()
    with pytest.raises(RuntimeError, match="rotation must be"):
        OPS.weight_codes(w[:, 1:], max(block, 16))


@DTYPES
def test_a_row_is_the_same_whatever_rows_share_its_batch(isa, dtype):
    """Bitwise: each row is computed alone, in a fixed order."""
    x = _random(40, 1024, dtype=dtype)
    w = _random(1024, dtype=dtype, seed=1)
    gate_up = _random(40, 512, dtype=dtype)
    qk = _random(40, 4 * 128, dtype=dtype)
    cos, sin = _random(40, 64, dtype=dtype, seed=4), _random(40, 64, dtype=dtype, seed=5)
    norm_w = _random(128, dtype=dtype, seed=6)
    for rows in (slice(3, 4), slice(0, 7), slice(11, 40)):
        assert torch.equal(OPS.rms_norm(x[rows], w, 1e-6), OPS.rms_norm(x, w, 1e-6)[rows])
        assert torch.equal(OPS.silu_mul(gate_up[rows]), OPS.silu_mul(gate_up)[rows])
        assert torch.equal(OPS.gelu_tanh(x[rows]), OPS.gelu_tanh(x)[rows])
        alone = OPS.rope(qk[rows], cos[rows], sin[rows], 128, norm_w, 1e-6)
        assert torch.equal(alone, OPS.rope(qk, cos, sin, 128, norm_w, 1e-6)[rows])


def test_the_native_table_runs_the_kernels_on_cpu_and_torch_elsewhere():
    """kernels/native_cpu.py hands CPU fp32/bf16 to the kernels and anything else to torch's
    ops."""
    if native.isa() is None:
        pytest.skip("native kernels not built")
    x = _random(8, 256, dtype=torch.bfloat16)
    w = _random(256, dtype=torch.bfloat16, seed=1)
    assert torch.equal(native_cpu.rms_norm(x, w, 1e-6), OPS.rms_norm(x, w, 1e-6))
    assert torch.equal(native_cpu.silu_mul(x), OPS.silu_mul(x))
    assert torch.equal(native_cpu.gelu_tanh(x), OPS.gelu_tanh(x))
    cos, sin = _random(8, 32, dtype=torch.bfloat16), _random(8, 32, dtype=torch.bfloat16)
    rotated = native_cpu.norm_rotary(x, cos, sin, 64, None, 1e-6)
    assert torch.equal(rotated, OPS.rope(x, cos, sin, 64, None, 0.0))
    half = x.half()  # no fp16 kernels: torch's ops
    assert torch.equal(
        native_cpu.rms_norm(half, w.half(), 1e-6), reference.rms_norm(half, w.half(), 1e-6)
    )
    assert not native.handles(x, w.float())  # mixed dtypes: torch's ops


@pytest.mark.parametrize("n,k", [(128, 64), (100, 30)], ids=["whole panels", "padded"])
@pytest.mark.parametrize(
    "dtype,group", [(torch.float32, 4), (torch.int8, 4), (torch.bfloat16, 2), (torch.float32, 1)]
)
def test_panels_hold_each_weight_where_the_operators_read_it(n, k, dtype, group):
    """pack_panels is pure layout (no build needed): [n_pad / panel, k_pad / group, panel,
    group], value (c, i) of w at [c // panel, i // group, c % panel, i % group], zeros beyond;
    a group of 32 bits (int8 quads, bf16 pairs, fp32) moved as one word."""
    w = (torch.arange(n * k) % 127 + 1).to(dtype).view(n, k)
    packed = native.pack_panels(w, group, 64)
    n_pad, k_pad = -(-n // 64) * 64, -(-k // group) * group
    assert packed.shape == (n_pad // 64, k_pad // group, 64, group) and packed.is_contiguous()
    assert packed.dtype == dtype
    c, i = torch.meshgrid(torch.arange(n_pad), torch.arange(k_pad), indexing="ij")
    expected = torch.zeros(n_pad, k_pad, dtype=dtype)
    expected[:n, :k] = w
    assert torch.equal(packed[c // 64, i // group, c % 64, i % group], expected)
    assert packed.data_ptr() != w.data_ptr()  # a copy, also where nothing is padded


def test_route_names_the_kernels():
    config = model_config()
    route = choose_route(EncoderSettings(), config, "cpu", ZEN4, native_isa=lambda: "avx2")
    assert (route.elementwise, route.native_isa) == ("native", "avx2")
    assert "elementwise ops native avx2" in route.describe()
    assert (
        choose_route(EncoderSettings(), config, "cpu", ZEN4, native_isa=lambda: None).elementwise
        == "torch"
    )
    fp16 = choose_route(
        EncoderSettings(dtype="float16"), config, "cpu", ZEN4, native_isa=lambda: "avx2"
    )
    assert (fp16.elementwise, fp16.native_isa) == ("torch", None)
    gpu = choose_route(
        EncoderSettings(),
        config,
        "cuda:0",
        ZEN4,
        choose_attention=lambda *a, **k: ("torch", "a stand-in"),
        gpu_bf16=lambda d: True,
        has_triton=lambda: True,
    )
    assert gpu.elementwise == "triton" and "elementwise ops triton;" in gpu.describe()


def test_an_unknown_or_unsupported_instruction_set_is_refused():
    if native.isa() is None:
        pytest.skip("native kernels not built")
    with pytest.raises(RuntimeError, match="cannot run"):
        native.select("sve")
    assert native.isa() in native.ISAS


def test_a_clang_build_says_why_it_stops(tmp_path):
    """The kernels' vector shuffles are GCC builtins: clang is refused by name, up front."""
    from qwen_embed.native.build import build

    clang = tmp_path / "c++"
    clang.write_text("#!/bin/sh\necho 'clang version 17.0.6'\n")
    clang.chmod(0o755)
    with pytest.raises(RuntimeError, match="is clang; the kernels use GCC's vector extensions"):
        build(str(clang))


GEMM_PANELS = {  # channels per panel of each GEMM operator's packed weights, as the engine packs
    "f32_linear": avx2_gemm.PANEL,
    "int8_linear_avx2": int8.PAIRS_PANEL,
    "int8_linear": native.PANEL,
    "bf16_linear": native.PANEL,
}


def schedule_span(m, n, rows, channels, threads):
    """When the last task of an m x n GEMM ends, its tasks of `rows` x `channels` (channels
    outermost) each taken by the first free thread, a task's cost its rows x channels."""
    free = [0] * threads
    for c in range(0, n, channels):
        for r in range(0, m, rows):
            first = free.index(min(free))
            free[first] += min(rows, m - r) * min(channels, n - c)
    return max(free)


@pytest.mark.skipif(OPS is None, reason="the native kernels are not built here")
@pytest.mark.parametrize("op", sorted(GEMM_PANELS))
@pytest.mark.parametrize("threads", [1, 2, 3, 8, 64])
@pytest.mark.parametrize(
    "m, n", [(1, 1024), (20, 1024), (20, 3072), (128, 1024), (300, 1024), (12800, 6144)]
)
def test_gemm_tasks_end_soonest_where_they_are_few(op, threads, m, n):
    """A GEMM's tasks (rows x channels) keep the threads busy: where they are few (a short
    query's layers), the channels per task are the most, in whole panels, whose tasks end
    soonest; a short query's 1,024-channel layer is not left to a few threads of a many-core
    host, nor 3 tasks to 2 threads. Where they are many, the default blocking stays (any
    blocking gives a row the same bits)."""
    defaults = {a.name: a.default_value for a in getattr(OPS, op).default._schema.arguments}
    rows, channels, panel = defaults["task_rows"], defaults["task_channels"], GEMM_PANELS[op]
    got = OPS.gemm_task_channels(m, n, rows, channels, panel, threads)
    row_tasks = -(-m // rows)
    assert got % panel == 0 and panel <= got <= channels
    if row_tasks * -(-n // channels) > 4 * threads:
        assert got == channels
    else:
        candidates = range(panel, channels + 1, panel)
        spans = {c: schedule_span(m, n, rows, c, threads) for c in candidates}
        few = [c for c in spans if c == channels or row_tasks * -(-n // c) <= 4 * threads]
        assert spans[got] == min(spans[c] for c in few)
        assert all(spans[c] > spans[got] for c in spans if c > got)


@pytest.mark.skipif(OPS is None, reason="the native kernels are not built here")
def test_a_short_querys_int8_layers_split_evenly_over_two_threads():
    # q|k (3,072 channels) at 20 rows: 4 tasks of 768 rather than 3 of 1,024 on 2 threads;
    # down (1,024 channels) at 128 rows: 96 and 32 rows, each in 2 tasks of 512 channels
    assert OPS.gemm_task_channels(20, 3072, 96, 1024, native.PANEL, 2) == 768
    assert OPS.gemm_task_channels(128, 1024, 96, 1024, native.PANEL, 2) == 512
    assert OPS.gemm_task_channels(20, 6144, 96, 1024, native.PANEL, 2) == 1024


@pytest.mark.skipif(OPS is None or not OPS.avx2_supported(), reason="needs the AVX2 operators")
def test_a_gemm_cut_for_more_threads_gives_the_same_bits():
    x = _random(5, 768, dtype=torch.float32)
    w = _random(1024, 768, dtype=torch.float32, seed=1)
    packed = Avx2F32Weight(w).packed
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = OPS.f32_linear(x, packed, None, 1024)
        torch.set_num_threads(16)  # 16 tasks of 64 channels instead of 4 of 256
        assert OPS.gemm_task_channels(5, 1024, 96, 256, 16, 16) == 64
        assert torch.equal(OPS.f32_linear(x, packed, None, 1024), one)
    finally:
        torch.set_num_threads(previous)
