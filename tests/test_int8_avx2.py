"""The int8 route's native AVX2 GEMM (native/csrc/gemm/pairs_avx2.cpp: the codes as int16
pairs, vpmaddwd), which CPUs without VNNI multiply on, against the torch route's integer
arithmetic it replaces (int8.integer_products and the rescale): exact integer sums and the
same rescale, so the same bits, for the layouts the model hands it. It runs on any AVX2 CPU,
so every CI machine tests it, also those whose layers take the VNNI operator."""

from __future__ import annotations

import pytest
import torch

from qwen_embed import int8

pytestmark = pytest.mark.skipif(
    not int8.avx2_kernel(), reason="the AVX2 int8 operator needs the native build and AVX2"
)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (rows, out, in): one row, an odd width (padded to a pair), every tail of the 4-row blocks and
# 16-channel panels, the demo's widths, and down_proj's 3,072 inputs
SHAPES = [(1, 16, 4), (2, 33, 3), (3, 17, 10), (7, 100, 64), (97, 80, 130), (200, 1024, 1024)]
SHAPES += [(45, 100, 3072)]


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def torch_route(xq, x_scale, wq, w_scale, dtype=torch.float32):
    products = int8.integer_products(xq, wq, vnni=False)
    return int8._rescale(products, x_scale, w_scale.view(1, -1), dtype)


def avx2(xq, x_scale, wq, w_scale, **blocking):
    packed, scale = int8.pack_pairs(wq, w_scale)
    return torch.ops.qwen_embed.int8_gemm_avx2(
        xq, x_scale.view(-1), packed, scale, wq.shape[0], *blocking.values()
    )


@pytest.mark.parametrize("rows,out_features,in_features", SHAPES)
def test_equals_the_torch_routes_arithmetic(rows, out_features, in_features):
    xq, x_scale = int8.quantize_rows(_random(rows, in_features, seed=0))
    wq, w_scale = int8.quantize_rows(_random(out_features, in_features, seed=1))
    assert torch.equal(avx2(xq, x_scale, wq, w_scale), torch_route(xq, x_scale, wq, w_scale))


def test_the_largest_sums_are_exact():
    """Codes of +-127 over 3,072 inputs: sums of 49.5M, past fp32's exact integers, rounded
    once as torch rounds them; int16 pairs never saturate (2 x 127 x 127 < 2**31)."""
    g = torch.Generator().manual_seed(2)
    xq = torch.randint(-127, 128, (9, 3072), generator=g, dtype=torch.int8)
    wq = torch.randint(-127, 128, (24, 3072), generator=g, dtype=torch.int8)
    xq[0], wq[0], wq[1] = 127, 127, -127
    x_scale, w_scale = torch.ones(9, 1), torch.ones(24, 1)
    out = avx2(xq, x_scale, wq, w_scale)
    assert out[0, 0] == float(3072 * 127 * 127) and out[0, 1] == -out[0, 0]
    assert torch.equal(out, torch_route(xq, x_scale, wq, w_scale))


def test_a_row_is_the_same_whatever_rows_share_its_batch():
    xq, x_scale = int8.quantize_rows(_random(300, 1024, seed=0))
    wq, w_scale = int8.quantize_rows(_random(520, 1024, seed=1))
    full = avx2(xq, x_scale, wq, w_scale)
    for rows in (slice(5, 6), slice(0, 7), slice(11, 200), slice(290, 300)):
        assert torch.equal(avx2(xq[rows], x_scale[rows], wq, w_scale), full[rows])


@pytest.mark.parametrize(
    "task_rows,task_channels,channels_outer", [(1, 16, True), (17, 512, False), (256, 48, True)]
)
def test_every_blocking_gives_the_same_bits(task_rows, task_channels, channels_outer):
    xq, x_scale = int8.quantize_rows(_random(150, 128, seed=0))
    wq, w_scale = int8.quantize_rows(_random(700, 128, seed=1))
    default = avx2(xq, x_scale, wq, w_scale)
    blocking = dict(rows=task_rows, channels=task_channels, outer=channels_outer)
    assert torch.equal(avx2(xq, x_scale, wq, w_scale, **blocking), default)
    with pytest.raises(RuntimeError, match="multiple of the panel"):
        avx2(xq, x_scale, wq, w_scale, rows=96, channels=24, outer=True)


@DTYPES
@pytest.mark.parametrize("rows,out_features,in_features", [(7, 33, 48), (97, 80, 1024)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_layer_takes_it_without_the_vnni_operator(
    monkeypatch, dtype, rows, out_features, in_features, with_bias
):
    """Int8Weight where the VNNI operator does not run: rotated rows, the AVX2 GEMM, the bias;
    bitwise the layer of the torch route (no native GEMM at all)."""
    monkeypatch.setattr(int8, "native_kernel", lambda: False)
    w = _random(out_features, in_features, seed=1)
    x = _random(rows, in_features, seed=0).to(dtype)
    bias = _random(out_features, seed=2) if with_bias else None
    layer = int8.Int8Weight(w)
    assert layer.avx2 and not layer.native and layer.packed.dtype == torch.int16
    assert layer.rotation == int8.rotation_block(in_features) > 1
    monkeypatch.setattr(int8, "avx2_kernel", lambda: False)
    plain = int8.Int8Weight(w)
    assert not plain.avx2 and plain.qweight.dtype == torch.int8
    out = layer(x.view(1, rows, -1), bias)
    assert out.dtype == dtype and out.shape == (1, rows, out_features)
    assert torch.equal(out, plain(x.view(1, rows, -1), bias))


def test_bad_operands_are_refused():
    wq, w_scale = int8.quantize_rows(_random(32, 64, seed=1))
    packed, scale = int8.pack_pairs(wq, w_scale)
    xq, x_scale = int8.quantize_rows(_random(4, 64, seed=0))
    op = torch.ops.qwen_embed.int8_gemm_avx2
    with pytest.raises(RuntimeError, match="packed must be"):  # more channels than packed
        op(xq, x_scale.view(-1), packed, scale, 33)
    with pytest.raises(RuntimeError, match="packed must be"):  # other widths than packed
        op(int8.quantize_rows(_random(4, 72, seed=0))[0], x_scale.view(-1), packed, scale, 32)
    with pytest.raises(RuntimeError, match="codes must be"):
        op(xq.float(), x_scale.view(-1), packed, scale, 32)
    with pytest.raises(RuntimeError, match="a_scale"):
        op(xq, x_scale.view(-1)[:3], packed, scale, 32)
    with pytest.raises(RuntimeError, match="w_scale"):
        op(xq, x_scale.view(-1), packed, scale[:16], 32)
