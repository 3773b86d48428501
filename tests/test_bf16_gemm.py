"""The bf16 linear operator (native/csrc/gemm/, onednn.NativeBf16Weight) on our AMX tile
kernel, our AVX512_BF16 panel kernel or oneDNN's brgemm micro-kernel: the GEMM of
batch_invariant "on", since on AMX CPUs oneDNN's own GEMM sums a row in another order at other
row counts. Against the fp32 product (one bf16 rounding), a row the same at every row count and
stride, the kernels the same bits, and the route that chooses it."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from qwen_embed import native
from qwen_embed.cpu import CpuFeatures
from qwen_embed.onednn import NativeBf16Weight, brgemm_runs
from qwen_embed.route import Gemm, choose_route
from qwen_embed.settings import EncoderSettings

from reference import gated_as_silu_mul, model_config

NEEDS_OPERATOR = pytest.mark.skipif(
    not brgemm_runs(), reason="the native bf16 operator needs AVX-512, the build and oneDNN"
)
AMX = CpuFeatures.from_flags({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "Xeon")
AVX2 = CpuFeatures.from_flags({"avx2"}, "AMD EPYC 7B12")


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _rounded_product(x, w, bias=None):
    y = x.float() @ w.float().T
    return (y if bias is None else y + bias).bfloat16()


def route(features=AMX, device="cpu", runs=True, batch_invariant="on", **settings):
    return choose_route(
        EncoderSettings(batch_invariant=batch_invariant, **settings),
        model_config(),
        device,
        features,
        brgemm_runs=lambda: runs,
        choose_attention=lambda *_, **__: ("torch", "test"),
        gpu_bf16=lambda _: True,
    )


def test_batch_invariant_routes_bf16_linears_to_the_operator():
    assert route().gemm is Gemm.NATIVE_BF16
    assert route(quantization="int8").gemm is Gemm.NATIVE_BF16  # int8's layers in floats
    # fp32 GEMMs are row-invariant already
    assert route(dtype="float32").gemm is not Gemm.NATIVE_BF16
    assert route(AVX2).gemm is not Gemm.NATIVE_BF16  # bf16 runs as fp32 GEMMs there
    assert "batch-invariant native GEMM" in route().describe()
    assert route(batch_invariant="off").gemm is not Gemm.NATIVE_BF16
    with pytest.raises(ValueError, match="CPU only"):
        route(device="cuda:0")
    with pytest.raises(ValueError, match="native bf16 operator"):
        route(runs=False)
    with pytest.raises(ValueError, match="batch_invariant must be one of"):
        EncoderSettings(batch_invariant="always")


AVX512BF16 = CpuFeatures.from_flags({"avx2", "avx512f", "avx512_bf16"}, "AMD EPYC 9R14")


def test_auto_takes_the_operator_wherever_it_runs():
    """The default: bf16 GEMMs on the operator wherever it runs (AMX, AVX512_BF16); oneDNN
    elsewhere, without an error where the operator cannot run."""
    assert EncoderSettings().batch_invariant == "auto"
    auto = partial(route, batch_invariant="auto")
    assert auto().gemm is Gemm.NATIVE_BF16
    assert auto(AVX512BF16).gemm is Gemm.NATIVE_BF16
    assert auto(quantization="int8").gemm is Gemm.NATIVE_BF16
    assert auto(runs=False).gemm is Gemm.ONEDNN
    assert auto(AVX512BF16, runs=False).gemm is Gemm.ONEDNN
    assert auto(AVX2).gemm is not Gemm.NATIVE_BF16  # bf16 runs as fp32 GEMMs there
    assert auto(dtype="float32").gemm is not Gemm.NATIVE_BF16
    assert auto(device="cuda:0").gemm is not Gemm.NATIVE_BF16
    assert auto(batch_invariant="off").gemm is not Gemm.NATIVE_BF16


# (rows, out, in): one row, a channel tail, more rows than a task (a tail), the demo's widths,
# the attention's output projection's width
@NEEDS_OPERATOR
@pytest.mark.parametrize(
    "rows,n,k", [(1, 64, 32), (7, 100, 48), (97, 80, 130), (200, 1024, 1024), (45, 100, 2048)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_rounding_of_the_fp32_product(rows, n, k, with_bias):
    x, w = _random(rows, k, seed=0), _random(n, k, seed=1)
    bias = torch.randn(n) if with_bias else None
    out = NativeBf16Weight(w)(x, bias)
    ref = _rounded_product(x, w, bias)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    # fp32 sums in another order (an error up to ~k fp32 steps of the terms' magnitudes), then
    # one rounding: at most one bf16 step apart beyond that
    magnitude = x.float().abs() @ w.float().abs().T
    bound = ref.float().abs() * 2**-7 + magnitude * 2**-16
    assert ((out.float() - ref.float()).abs() <= bound).all()


@NEEDS_OPERATOR
def test_a_row_is_the_same_at_every_row_count_and_stride():
    w = _random(300, 256, seed=2)
    wide = _random(400, 300, seed=3)
    x = wide[:, :256]  # strided rows
    layer = NativeBf16Weight(w)
    full = layer(x.contiguous())
    for m in (1, 2, 3, 17, 95, 96, 97, 191, 250, 400):
        assert torch.equal(layer(x[:m]), full[:m]), m
    assert torch.equal(layer(x.reshape(4, 100, 256))[1], full[100:200])


@NEEDS_OPERATOR
@pytest.mark.parametrize("k", [2, 66, 1024])
def test_the_panel_kernel_gives_the_micro_kernels_bits(k):
    """The default layout runs our tile kernel on AMX CPUs where k is a multiple of 32 (16-channel
    panels; 200 channels: the last block's second tile past them), our panel kernel on
    AVX512_BF16 CPUs (rows in blocks of up to 6, the next panel fetched meanwhile), wider panels
    oneDNN's micro-kernel: the same bits at every row count, with and without bias."""
    w, x, bias = _random(200, k, seed=9), _random(70, k, seed=10), torch.randn(200)
    ours, wide = NativeBf16Weight(w), native.pack_panels(w, 2, 128)
    for m in [*range(1, 21), 25, 36, 37, 64, 70]:
        b = bias if m % 2 else None
        micro = torch.ops.qwen_embed.bf16_linear(x[:m], wide, b, 200)
        assert torch.equal(ours(x[:m], b), micro), m


@NEEDS_OPERATOR
def test_the_tile_kernel_reads_weights_in_16_channel_panels():
    """On AMX CPUs the weights are packed in panels of 16 channels, so that each step's weight
    tile is 1 KB in a row (a strided tile load is slower); widths the tiles do not take (not a
    multiple of 32) keep the panel kernel's 64; the tile kernel also takes 64-channel panels,
    with the same bits."""
    w, x = _random(96, 64, seed=11), _random(40, 64, seed=12)
    layer = NativeBf16Weight(w)
    panel = 16 if native.isa() == "amx" else native.PANEL
    assert native.bf16_panel(64) == panel and native.bf16_panel(48) == native.PANEL
    assert layer.packed.shape == (-(-96 // panel), 32, panel, 2)  # channels padded
    assert NativeBf16Weight(_random(96, 48, seed=13)).packed.shape[2] == native.PANEL
    wide = torch.ops.qwen_embed.bf16_linear(x, native.pack_panels(w, 2, 64), None, 96)
    assert torch.equal(layer(x), wide)


@NEEDS_OPERATOR
def test_the_operator_needs_onednn(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert not brgemm_runs()
    with pytest.raises(RuntimeError, match="oneDNN"):
        NativeBf16Weight(_random(64, 32, seed=4))(_random(3, 32, seed=5))


@NEEDS_OPERATOR
def test_bad_operands_are_refused():
    layer = NativeBf16Weight(_random(64, 32, seed=5))
    with pytest.raises(RuntimeError, match="bfloat16"):
        layer(torch.randn(3, 32))
    with pytest.raises(RuntimeError, match="packed"):
        layer(_random(3, 34, seed=6))


@NEEDS_OPERATOR
@pytest.mark.parametrize(
    "panel,task_rows,task_channels,channels_outer",
    [(64, 96, 256, False), (128, 64, 512, True), (256, 17, 256, False), (512, 32, 512, True)],
)
def test_every_blocking_gives_the_same_bits(panel, task_rows, task_channels, channels_outer):
    """Panels per call and tasks are free choices (`bench_kernels.py bf16_blocking` tries them):
    each row is still summed over the whole K in ascending tile products, so the bits are the
    default blocking's. 64-channel panels run our tile kernel on AMX CPUs (as the default's
    16-channel ones do) and our panel kernel on AVX512_BF16 ones, the wider ones oneDNN's
    micro-kernel: they agree bitwise."""
    w, x = _random(700, 192, seed=7), _random(150, 192, seed=8)
    bias = torch.randn(700)
    default = NativeBf16Weight(w)(x, bias)
    packed = native.pack_panels(w, 2, panel)
    out = torch.ops.qwen_embed.bf16_linear(
        x, packed, bias, 700, task_rows, task_channels, channels_outer
    )
    assert torch.equal(out, default)
    with pytest.raises(RuntimeError, match="multiple of the panel"):
        torch.ops.qwen_embed.bf16_linear(x, packed, None, 700, 32, panel + 16, True)


@NEEDS_OPERATOR
@pytest.mark.parametrize("rows,n,k", [(1, 256, 32), (45, 768, 192), (70, 1024, 1024)])
@pytest.mark.parametrize("panel", ["own", 128])
def test_the_gated_gemm_is_silu_mul_of_the_gemm(rows, n, k, panel):
    """A gate|up projection's silu(gate) * up in the GEMM's store, on the route's kernel (the
    AMX tile kernel's blocks of 16 gate and 16 up channels, the panel kernel's gate and up
    panels; 128-channel panels go to oneDNN's micro-kernel everywhere): the row ops' silu_mul on
    the plain GEMM's output, bitwise, at any row count and blocking (a task's channels halved:
    the same weights per task)."""
    weight = _random(n, k, seed=14)
    layer = NativeBf16Weight(weight)
    if panel != "own":
        layer.packed = native.pack_panels(weight, 2, panel)
        layer.gates = native.gates(panel, n)
    x = _random(rows, k, seed=15)
    expected = gated_as_silu_mul(layer, x)
    for blocking in ((32, 128, False), (96, 256, True), (64, 512, False)):
        gated = torch.ops.qwen_embed.bf16_linear(x, layer.packed, None, n, *blocking, gated=True)
        assert torch.equal(gated, expected), blocking


@NEEDS_OPERATOR
def test_a_gated_gemm_needs_whole_halves_and_no_bias():
    panel = native.bf16_panel(64)
    for n, k in ((2 * panel, 64), (2 * panel - 16, 64), (128, 48), (384, 48)):
        assert NativeBf16Weight(_random(n, k, seed=1)).gates == (
            n % (2 * native.bf16_panel(k)) == 0
        )
    x = _random(4, 64, seed=0)
    layer = NativeBf16Weight(_random(2 * panel, 64, seed=1))
    for n, bias in ((2 * panel - 16, None), (2 * panel, torch.zeros(2 * panel))):
        with pytest.raises(RuntimeError, match=f"gated needs n a multiple of {2 * panel}"):
            torch.ops.qwen_embed.bf16_linear(x, layer.packed, bias, n, gated=True)


@NEEDS_OPERATOR
def test_the_mlp_gates_in_the_gemm_unless_something_joins_the_product():
    """QwenMLP's gate|up projection hands silu(gate) * up to its kernel where it gates (the
    row ops' silu_mul not called, the same bits); a bias, or an adapter that a row of this
    forward names and that adapts this layer, joins the product before the gating, so there the
    GEMM's output goes to silu_mul. Adapters held but named by no row, or leaving this layer
    as it is, keep the gated store."""
    from types import SimpleNamespace

    from qwen_embed.kernels import native_cpu
    from qwen_embed.layers import ColumnParallelLinear, TPGroup
    from qwen_embed.lora import LinearLora
    from qwen_embed.segments import BASE, AdapterRows

    calls = []

    def counted_silu_mul(gate_up):
        calls.append(gate_up.shape)
        return native_cpu.silu_mul(gate_up)

    ops = SimpleNamespace(silu_mul=counted_silu_mul)
    x = _random(10, 64, seed=17)
    pair = (_random(4, 64, seed=18), _random(256, 4, seed=19))
    named = np.array([BASE] * 4 + [1] * 6)  # the last 6 rows name adapter 1
    unadapted = np.where(named == BASE, BASE, 0)  # adapter 0 leaves this layer as it is
    runs = {
        "no adapter": None,
        "none named": SimpleNamespace(rows=None),
        "named, not this layer's": SimpleNamespace(rows=AdapterRows.of(unadapted, unadapted)),
        "named": SimpleNamespace(rows=AdapterRows.of(named, named)),
    }
    for bias in (False, True):
        for case, switch in runs.items():
            layer = ColumnParallelLinear(64, {"gate": 128, "up": 128}, TPGroup(), bias=bias)
            layer.weight.data = _random(256, 64, seed=16)
            if bias:
                layer.bias.data = torch.randn(256)
            layer.repack(NativeBf16Weight)
            layer.lora = None if switch is None else LinearLora(switch, [None, pair])
            expected = native_cpu.silu_mul(layer(x))
            calls.clear()
            assert torch.equal(layer.silu_gated(x, ops), expected)
            joined = bias or case == "named"
            assert calls == ([(10, 256)] if joined else []), (bias, case)


@NEEDS_OPERATOR
@pytest.mark.parametrize(
    "n, k, r, panel, stacked",
    [(256, 64, 16, 64, False), (200, 44, 5, 64, False), (48, 128, 3, 16, False)]
    + [(384, 64, 16, 64, True), (96, 64, 12, 16, True)],
)
def test_a_pair_merges_into_the_packed_weights(n, k, r, panel, stacked):
    """bf16_merge_pair: the packed weights plus b @ a, each float(w) + the pair's sum rounded
    once, in the packed layout, as packing the merged weight gives them (within one bf16
    rounding: the sum's order is its own); padding channels past n stay zero. Steps past the
    kernel's blocks of 6 and widths past the panels' (n 200, k 44) included; `stacked`: a packed
    layer's pairs, b block-diagonal (each third of the channels its own ranks, the last third
    none: the kernel sums only the ranks a channel group's b holds)."""
    w = _random(n, k, seed=30)
    a, b = 0.3 * _random(r, k, seed=31).float(), 0.3 * _random(n, r, seed=32).float()
    if stacked:
        blocks = torch.block_diag(torch.ones(n // 3, r // 2), torch.ones(n // 3, r - r // 2))
        b *= torch.cat([blocks, torch.zeros(n - blocks.shape[0], r)])
    packed = native.pack_panels(w, 2, panel)
    merged = torch.ops.qwen_embed.bf16_merge_pair(packed, a, b)
    want = native.pack_panels((w.float() + b @ a).bfloat16(), 2, panel)
    assert merged.shape == want.shape and merged.dtype == torch.bfloat16
    ulp = want.float().abs() * 2**-7
    assert ((merged.float() - want.float()).abs() <= ulp).all()
    assert (merged != want).float().mean() < 0.01  # nearly every weight the same bits
    assert not torch.equal(merged, packed)
    with pytest.raises(RuntimeError, match=r"a must be float32 \[r,"):
        torch.ops.qwen_embed.bf16_merge_pair(packed, a[:, :-2], b)


@NEEDS_OPERATOR
def test_a_forward_of_one_adapter_multiplies_it_merged(monkeypatch):
    """A forward whose rows all name one adapter, lora.MERGE_FROM_ROWS of them or more,
    multiplies by the weights with the adapter's pair merged (NativeBf16Weight.merged, counted),
    a gate|up projection gating in the merged GEMM's store (silu_mul not called); fewer rows,
    or rows of two adapters, add the pairs' products. Merged or added, each row's product as
    its fine-tune's merged weight gives it (cosine >= 0.999: bf16 roundings)."""
    from types import SimpleNamespace

    from qwen_embed import lora
    from qwen_embed.kernels import native_cpu
    from qwen_embed.layers import ColumnParallelLinear, TPGroup
    from qwen_embed.segments import AdapterRows

    merges, gatings = [], []
    merged_by = NativeBf16Weight.merged
    monkeypatch.setattr(
        NativeBf16Weight, "merged", lambda self, a, b: merges.append(1) or merged_by(self, a, b)
    )

    def counted_silu_mul(gate_up):
        gatings.append(1)
        return native_cpu.silu_mul(gate_up)

    ops = SimpleNamespace(silu_mul=counted_silu_mul)
    layer = ColumnParallelLinear(64, {"gate": 128, "up": 128}, TPGroup(), bias=False)
    layer.weight.data = _random(256, 64, seed=16)
    weight = layer.weight.data
    layer.repack(NativeBf16Weight)
    pairs = [(_random(8, 64, seed=s), 0.2 * _random(256, 8, seed=s + 1)) for s in (40, 50)]
    switch = SimpleNamespace(rows=None)
    layer.lora = lora.LinearLora(switch, pairs)
    x = _random(12, 64, seed=17)
    one, two = np.zeros(12, np.int64), np.repeat([0, 1], 6)
    for rows, names, merged in ((12, one, True), (13, one, False), (12, two, False)):
        monkeypatch.setattr(lora, "MERGE_FROM_ROWS", rows)
        switch.rows = AdapterRows.of(names, names)
        merges.clear(), gatings.clear()
        got = layer.silu_gated(x, ops)
        assert (len(merges), len(gatings)) == ((1, 0) if merged else (0, 1)), (rows, names)
        a, b = pairs[0] if merged or names is one else pairs[1]
        finetuned = (weight.float() + b.float() @ a.float()).bfloat16()
        rows_of = slice(6, 12) if names is two else slice(0, 12)  # two: adapter 1's rows
        want = native_cpu.silu_mul(_rounded_product(x, finetuned))[rows_of]
        got = got[rows_of]
        cosines = torch.nn.functional.cosine_similarity(got.float(), want.float())
        assert cosines.min() >= 0.999, (rows, names)
    # a merged kernel that cannot gate (a bias joins the product): merged once, gated after
    layer.bias = torch.nn.Parameter(torch.zeros(256))
    monkeypatch.setattr(lora, "MERGE_FROM_ROWS", 12)
    switch.rows = AdapterRows.of(one, one)
    merges.clear(), gatings.clear()
    layer.silu_gated(x, ops)
    assert (len(merges), len(gatings)) == (1, 1)
