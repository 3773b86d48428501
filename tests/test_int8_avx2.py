"""The int8 route's native AVX2 GEMM (native/csrc/gemm/pairs_avx2.cpp: the codes as int16
pairs, vpmaddwd, on weights held as int8), which CPUs without VNNI multiply on, against the
torch route's integer arithmetic it replaces (int8.integer_products and the rescale): exact
integer sums and the same rescale, so the same bits, for the layouts the model hands it. It
runs on any AVX2 CPU, so every CI machine tests it, also those whose layers take the VNNI
operator."""

from __future__ import annotations

import pytest
import torch

from qwen_embed import int8

pytestmark = pytest.mark.skipif(
    not int8.avx2_kernel(), reason="the AVX2 int8 operator needs the native build and AVX2"
)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (rows, out, in): one row, an odd width (padded to a pair), every tail of the 6-row blocks and
# 16-channel panels, the demo's widths, and down_proj's 3,072 inputs
SHAPES = [(1, 16, 4), (2, 33, 3), (3, 17, 10), (7, 100, 64), (97, 80, 130), (200, 1024, 1024)]
SHAPES += [(45, 100, 3072), (10, 48, 66), (11, 33, 20)]


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def torch_route(x, wq, w_scale, rotation=1):
    """int8.Int8Weight's torch route before its cast and bias: rotation, quantisation, integer
    products, rescale."""
    rotated = int8.hadamard_rows(x, rotation) if rotation > 1 else x
    xq, x_scale = int8.quantize_rows(rotated)
    products = int8.integer_products(xq, wq, vnni=False)
    return int8._rescale(products, x_scale, w_scale.view(1, -1), torch.float32)


def avx2(x, wq, w_scale, rotation=1, **blocking):
    packed, scale = int8.pack_pairs(wq, w_scale)
    return torch.ops.qwen_embed.int8_linear_avx2(
        x, packed, scale, wq.shape[0], rotation, *blocking.values()
    )


@DTYPES
@pytest.mark.parametrize("rows,out_features,in_features", SHAPES)
def test_equals_the_torch_routes_arithmetic(dtype, rows, out_features, in_features):
    x = _random(rows, in_features, seed=0).to(dtype)
    wq, w_scale = int8.quantize_rows(_random(out_features, in_features, seed=1))
    assert torch.equal(avx2(x, wq, w_scale), torch_route(x, wq, w_scale))


@DTYPES
@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_rotated_rows_are_the_torch_routes(dtype, block):
    """The rotation in registers takes the torch butterflies' pairs in their order: the same
    floats, so the same codes and scales."""
    for rows, in_features in ((5, block), (37, 3 * block), (9, 1024)):
        x = _random(rows, in_features, seed=0).to(dtype)
        wq, w_scale = int8.quantize_rows(_random(40, in_features, seed=1))
        assert torch.equal(avx2(x, wq, w_scale, block), torch_route(x, wq, w_scale, block))


def test_strided_rows_and_a_leading_batch_dimension():
    qkv = _random(40, 3 * 96, seed=0)
    wq, w_scale = int8.quantize_rows(_random(64, 96, seed=1))
    x = qkv[:, 96:192]  # a slice of a packed projection: rows 288 values apart
    assert torch.equal(avx2(x, wq, w_scale, 32), torch_route(x.contiguous(), wq, w_scale, 32))
    wq, w_scale = int8.quantize_rows(_random(64, 288, seed=2))
    batched = avx2(qkv.view(4, 10, 288), wq, w_scale)
    assert batched.shape == (4, 10, 64)
    assert torch.equal(batched.view(40, 64), avx2(qkv, wq, w_scale))


def test_the_largest_sums_are_exact():
    """Codes of +-127 over 3,072 inputs: sums of 49.5M, past fp32's exact integers, rounded
    once as torch rounds them; int16 pairs never saturate (2 x 127 x 127 < 2**31)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 2, (9, 3072), generator=g).float() * 2 - 1  # codes +-127
    wq = torch.randint(-127, 128, (24, 3072), generator=g, dtype=torch.int8)
    x[0], wq[0], wq[1] = 1.0, 127, -127
    w_scale = torch.ones(24, 1)
    out = avx2(x, wq, w_scale)
    assert out[0, 0] == float(3072 * 127 * 127) / 127 and out[0, 1] == -out[0, 0]
    assert torch.equal(out, torch_route(x, wq, w_scale))


def test_a_row_is_the_same_whatever_rows_share_its_batch():
    x = _random(300, 1024, seed=0)
    wq, w_scale = int8.quantize_rows(_random(520, 1024, seed=1))
    full = avx2(x, wq, w_scale, 128)
    for rows in (slice(5, 6), slice(0, 7), slice(11, 200), slice(290, 300)):
        assert torch.equal(avx2(x[rows], wq, w_scale, 128), full[rows])


@pytest.mark.parametrize(
    "task_rows,task_channels,channels_outer", [(1, 16, True), (17, 512, False), (256, 48, True)]
)
def test_every_blocking_gives_the_same_bits(task_rows, task_channels, channels_outer):
    x = _random(150, 128, seed=0)
    wq, w_scale = int8.quantize_rows(_random(700, 128, seed=1))
    default = avx2(x, wq, w_scale)
    blocking = dict(rows=task_rows, channels=task_channels, outer=channels_outer)
    assert torch.equal(avx2(x, wq, w_scale, 1, **blocking), default)
    with pytest.raises(RuntimeError, match="multiple of the panel"):
        avx2(x, wq, w_scale, 1, rows=96, channels=24, outer=True)


@DTYPES
@pytest.mark.parametrize("rows,out_features,in_features", [(7, 33, 48), (97, 80, 1024)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_layer_takes_it_without_the_vnni_operator(
    monkeypatch, dtype, rows, out_features, in_features, with_bias
):
    """Int8Weight where the VNNI operator does not run: rotated rows, the AVX2 GEMM on weights
    of one byte each, the bias; bitwise the layer of the torch route (no native GEMM at all)."""
    monkeypatch.setattr(int8, "native_kernel", lambda: False)
    w = _random(out_features, in_features, seed=1)
    x = _random(rows, in_features, seed=0).to(dtype)
    bias = _random(out_features, seed=2) if with_bias else None
    layer = int8.Int8Weight(w)
    assert layer.avx2 and not layer.native and layer.packed.dtype == torch.int8
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
    x = _random(4, 64, seed=0)
    op = torch.ops.qwen_embed.int8_linear_avx2
    with pytest.raises(RuntimeError, match="packed must be"):  # more channels than packed
        op(x, packed, scale, 33)
    with pytest.raises(RuntimeError, match="packed must be"):  # other widths than packed
        op(_random(4, 72, seed=0), packed, scale, 32)
    with pytest.raises(RuntimeError, match="packed must be the int8"):  # weights of 2 bytes
        op(x, packed.to(torch.int16), scale, 32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(x.double(), packed, scale, 32)
    with pytest.raises(RuntimeError, match="w_scale"):
        op(x, packed, scale[:16], 32)
    for rotation in (8, 48, 128):  # below a vector, not a power of two, not dividing 64
        with pytest.raises(RuntimeError, match="rotation must be"):
            op(x, packed, scale, 32, rotation)
