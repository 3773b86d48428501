"""The native int8 linear operator (native/csrc/gemm/: rows.cpp around our AMX int8 tile
kernel, tiles_amx.cpp, on CPUs with the tiles, or our VNNI panel kernel, panels_vnni.cpp)
against the torch route it replaces: the same integer arithmetic, so the same numbers, for the
layouts the model hands it, with and without the rows' Hadamard rotation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwen_embed import int8
from qwen_embed import native as native_ops

from reference import gated_as_silu_mul

pytestmark = pytest.mark.skipif(
    not int8.native_kernel(),
    reason="the native int8 operator needs AVX512_VNNI and the build",
)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (rows, out, in): one row, paddings of both widths, more rows than a task (a tail), the demo's
# widths, and wider than 1,024 values (the AMX tile kernel then walks channels outermost)
SHAPES = [(1, 16, 4), (7, 33, 10), (13, 100, 64), (97, 80, 130), (200, 1024, 1024), (45, 100, 2048)]


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def reference(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, rotation: int = 1
) -> torch.Tensor:
    """The route's arithmetic in torch ops: rows rotated (hadamard_rows, checked against the
    matrix below), int8 codes, an int32 product, the two scales."""
    dtype = x.dtype
    if rotation > 1:
        x, w = int8.hadamard_rows(x.float(), rotation), int8.hadamard_rows(w.double(), rotation)
    xq, xs = int8.quantize_rows(x)
    wq, ws = int8.quantize_rows(w)
    ws = ws / rotation
    rows = x.shape[0]
    acc = torch._int_mm(F.pad(xq, (0, 0, 0, max(0, 17 - rows))), wq.t())[:rows]  # _int_mm: > 16
    out = acc.float() * xs * ws.view(1, -1)
    return (out if bias is None else out + bias).to(dtype)


def native(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    packed, offset, scale = int8.pack(*int8.quantize_rows(w))
    return torch.ops.qwen_embed.int8_linear(x, packed, offset, scale, bias, w.shape[0])


def sylvester(n: int) -> torch.Tensor:
    """The unnormalised n x n Walsh-Hadamard matrix: H[i, j] = (-1) ** popcount(i & j)."""
    i = torch.arange(n)
    bits = torch.bitwise_and(i.view(-1, 1), i.view(1, -1))
    parity = torch.zeros_like(bits)
    while bits.any():
        parity ^= bits & 1
        bits >>= 1
    return 1.0 - 2.0 * parity.float()


@DTYPES
@pytest.mark.parametrize("rows,out_features,in_features", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_the_integer_arithmetic(dtype, rows, out_features, in_features, with_bias):
    x = _random(rows, in_features, seed=0).to(dtype)
    w = _random(out_features, in_features, seed=1)
    bias = _random(out_features, seed=2) if with_bias else None
    assert torch.equal(native(x, w, bias), reference(x, w, bias))


@DTYPES
def test_strided_rows_and_a_leading_batch_dimension(dtype):
    qkv = _random(40, 3 * 96, seed=0).to(dtype)
    w = _random(64, 96, seed=1)
    x = qkv[:, 96:192]  # a slice of a packed projection: rows 288 values apart
    assert torch.equal(native(x, w), reference(x.contiguous(), w))
    batched = native(qkv.view(4, 10, 288), _random(64, 288, seed=2))
    assert batched.shape == (4, 10, 64)
    assert torch.equal(batched.view(40, 64), native(qkv, _random(64, 288, seed=2)))


@DTYPES
def test_a_row_is_the_same_whatever_rows_share_its_batch(dtype):
    """Bitwise: integer sums are exact and every scale belongs to one row or one channel."""
    x = _random(300, 1024, seed=0).to(dtype)
    w = _random(512, 1024, seed=1)
    full = native(x, w)
    for rows in (slice(5, 6), slice(0, 7), slice(11, 200), slice(290, 300)):
        assert torch.equal(native(x[rows], w), full[rows])


def test_every_count_of_few_rows():
    """The panel kernel takes a task's rows in blocks of up to 6 (15 rows: 5 + 5 + 5), several
    panels per task (the next fetched meanwhile): each count its own blocks, the same numbers."""
    x, w = _random(25, 256, seed=3).to(torch.bfloat16), _random(320, 256, seed=4)
    for rows in range(1, 26):
        assert torch.equal(native(x[:rows], w), reference(x[:rows], w)), rows


@DTYPES
@pytest.mark.parametrize(
    "task_rows,task_channels,channels_outer", [(32, 64, True), (17, 512, False), (256, 128, True)]
)
def test_every_blocking_gives_the_same_bits(dtype, task_rows, task_channels, channels_outer):
    """Rows and channels per task are free choices (`bench_kernels.py int8_blocking` tries them):
    a row's sums are exact integers rescaled per row and channel, so the bits are the default's."""
    x, w = _random(150, 128, seed=0).to(dtype), _random(700, 128, seed=1)
    bias = torch.randn(700)
    packed, offset, scale = int8.pack(*int8.quantize_rows(w))
    default = torch.ops.qwen_embed.int8_linear(x, packed, offset, scale, bias, 700, 128)
    out = torch.ops.qwen_embed.int8_linear(
        x, packed, offset, scale, bias, 700, 128, task_rows, task_channels, channels_outer
    )
    assert torch.equal(out, default)
    with pytest.raises(RuntimeError, match="multiple of the panel"):  # 32-channel tile blocks
        torch.ops.qwen_embed.int8_linear(x, packed, offset, scale, None, 700, 1, 96, 80)


@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_the_rotation_is_the_hadamard_matrix(block):
    h = sylvester(block)
    assert torch.equal(h @ h.T, block * torch.eye(block))
    x = _random(5, 3 * block, seed=0)
    expected = (x.double().view(5, 3, block) @ h.double()).view(5, -1)
    assert torch.allclose(int8.hadamard_rows(x, block).double(), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "dtype,block", [(torch.bfloat16, 128), (torch.float32, 128), (torch.bfloat16, 1)]
)
def test_weight_codes_by_blocks_of_rows_are_the_whole_weights(dtype, block):
    """In torch's ops (no native build) a weight is rotated and quantised some rows at a time
    (bounded float64 temporaries): the same codes and scales as the whole weight at once, rows
    being independent."""
    w = _random(int8.weight_rows_at_once(256) * 2 + 300, 256, seed=3).to(dtype)
    rotated = int8.hadamard_rows(w.double(), block) if block > 1 else w
    q, scale = int8.quantize_rows(rotated)
    codes, scales, sums = int8.torch_weight_codes(w, block)
    assert torch.equal(codes, q) and torch.equal(scales, scale / block)
    assert torch.equal(sums, q.sum(dim=1, dtype=torch.int32))
    assert codes.dtype == torch.int8 and scales.shape == (len(w), 1)


@pytest.mark.parametrize("in_features,block", [(4, 1), (10, 1), (48, 16), (64, 64), (1024, 128)])
def test_rotation_blocks(in_features, block):
    assert int8.rotation_block(in_features) == block


@DTYPES
@pytest.mark.parametrize("rows,out_features,in_features", [(7, 33, 48), (97, 80, 64), *SHAPES[-2:]])
def test_rotated_rows_equal_the_integer_arithmetic(dtype, rows, out_features, in_features):
    """The kernel's in-register transform gives the floats of the torch route's butterflies
    (the same operations in the same order), so the same codes; and the product stays within
    int8's error of the float one."""
    x = _random(rows, in_features, seed=0).to(dtype)
    w = _random(out_features, in_features, seed=1)
    layer = int8.Int8Weight(w)
    assert layer.native and layer.rotation == int8.rotation_block(in_features) > 1
    out = layer(x)
    assert torch.equal(out, reference(x, w, rotation=layer.rotation))
    exact = x.double() @ w.double().T
    assert (out.double() - exact).abs().max() < 0.02 * exact.abs().max()


def test_the_layer_runs_the_kernel_and_matches_the_torch_route(monkeypatch):
    w, x = _random(96, 256, seed=1), _random(37, 256, seed=0).to(torch.bfloat16)
    layer = int8.Int8Weight(w)
    panel = native_ops.int8_panel()
    assert layer.native and layer.packed.shape == (-(-96 // panel), 64, panel, 4)  # padded
    assert layer.rotation == 128
    monkeypatch.setattr(int8, "native_kernel", lambda: False)
    monkeypatch.setattr(int8, "avx2_kernel", lambda: False)  # test_int8_avx2.py has that one
    torch_route = int8.Int8Weight(w)
    assert not torch_route.native and torch_route.qweight.dtype == torch.int8
    assert torch.equal(layer(x), torch_route(x))


@pytest.mark.parametrize("k", [64, 200, 1088])
def test_the_tile_kernels_16_channel_panels_give_the_same_bits(monkeypatch, k):
    """On AMX CPUs the weights are packed in panels of 16 channels (a weight tile 1 KB in a
    row) and k padded to the tiles' 64-value steps, so the tile kernel runs at every width (200:
    where 64-channel panels leave it to the VNNI panel kernel); 100 channels: the last block's
    second tile past them. The same bits as 64-channel panels."""
    w, x = _random(100, k, seed=5), _random(45, k, seed=6).to(torch.bfloat16)
    q, s = int8.quantize_rows(w)
    packed, offset, scale = int8.pack(q, s)
    amx = native_ops.isa() == "amx"
    assert native_ops.int8_panel() == (16 if amx else native_ops.PANEL)
    assert packed.shape[2] == native_ops.int8_panel()
    assert packed.shape[1] * 4 == (-(-k // 64) * 64 if amx else k)
    monkeypatch.setattr(native_ops, "int8_panel", lambda: native_ops.PANEL)
    wide = int8.pack(q, s)
    assert wide[0].shape[2] == 64
    for rows in (1, 7, 32, 45):
        out = torch.ops.qwen_embed.int8_linear(x[:rows], packed, offset, scale, None, 100)
        assert torch.equal(out, torch.ops.qwen_embed.int8_linear(x[:rows], *wide, None, 100))


def test_bad_operands_are_refused():
    packed, offset, scale = int8.pack(*int8.quantize_rows(_random(32, 64, seed=1)))
    x = _random(4, 64, seed=0)
    with pytest.raises(RuntimeError, match="packed must be"):  # more channels than packed
        torch.ops.qwen_embed.int8_linear(x, packed, offset, scale, None, 65)
    with pytest.raises(RuntimeError, match="packed must be"):  # longer rows than packed
        torch.ops.qwen_embed.int8_linear(_random(4, 72, seed=0), packed, offset, scale, None, 32)
    with pytest.raises(RuntimeError, match="offset"):
        torch.ops.qwen_embed.int8_linear(x, packed, offset[:16], scale, None, 32)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.qwen_embed.int8_linear(x, packed, offset, scale, torch.zeros(31), 32)
    for rotation in (8, 48, 128):  # below a vector, not a power of two, not dividing 64
        with pytest.raises(RuntimeError, match="rotation must be"):
            torch.ops.qwen_embed.int8_linear(x, packed, offset, scale, None, 32, rotation)
    # 16-channel panels are the tile kernel's, whose steps are 64 values
    narrow = native_ops.pack_panels(int8.quantize_rows(_random(32, 72, seed=2))[0], 4, 16)
    with pytest.raises(RuntimeError, match="16-channel panels need the AMX tile kernel"):
        torch.ops.qwen_embed.int8_linear(_random(4, 72, seed=0), narrow, offset, scale, None, 32)


def test_the_operator_needs_no_onednn(monkeypatch):
    """Its kernels are all ours: with torch's oneDNN switched off the layers still take it."""
    w, x = _random(32, 64, seed=1), _random(3, 64, seed=2)
    expected = reference(x, w)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert int8.native_kernel()
    assert int8.Int8Weight(w).native
    assert torch.equal(native(x, w), expected)


@DTYPES
@pytest.mark.parametrize("rows,n,k", [(1, 128, 64), (45, 384, 200), (70, 1024, 1088)])
@pytest.mark.parametrize("panel", ["own", native_ops.PANEL])
def test_the_gated_gemm_is_silu_mul_of_the_gemm(monkeypatch, dtype, rows, n, k, panel):
    """A gate|up projection's silu(gate) * up in the GEMM's store, on the AMX tile kernel (its
    blocks of 16 gate and 16 up channels) or the VNNI panel kernel (gate's panel and up's per
    output panel): the row ops' silu_mul on the plain GEMM's output, bitwise, at any row count
    and blocking (a task's channels halved: the same weights per task)."""
    if panel != "own":
        monkeypatch.setattr(native_ops, "int8_panel", lambda: panel)
    layer = int8.Int8Weight(_random(n, k, seed=7))
    x = _random(rows, k, seed=8).to(dtype)
    expected = gated_as_silu_mul(layer, x)
    args = (layer.packed, layer.offset, layer.scale, None, n, layer.rotation)
    for blocking in ((32, 64, False), (96, 256, True), (64, 1024, False)):
        gated = torch.ops.qwen_embed.int8_linear(x, *args, *blocking, gated=True)
        assert torch.equal(gated, expected), blocking


def test_a_gated_gemm_needs_whole_halves_and_no_bias():
    panel = native_ops.int8_panel()
    assert int8.Int8Weight(_random(2 * panel, 64, seed=1)).gates
    assert not int8.Int8Weight(_random(2 * panel - 16, 64, seed=1)).gates
    x = _random(4, 64, seed=0)
    layer = int8.Int8Weight(_random(2 * panel, 64, seed=1))
    packed, offset, scale = layer.packed, layer.offset, layer.scale
    for n, bias in ((2 * panel - 16, None), (2 * panel, torch.zeros(2 * panel))):
        with pytest.raises(RuntimeError, match=f"gated needs n a multiple of {2 * panel}"):
            torch.ops.qwen_embed.int8_linear(x, packed, offset, scale, bias, n, gated=True)
