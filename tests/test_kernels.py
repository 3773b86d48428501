"""The row-op tables (qwen_embed/kernels) against torch's reference ops, on the layouts the
model hands them: Qwen2 (no q/k norm) and Qwen3 (q/k norm), head sizes 64 and 128, bf16, fp16
and fp32. The Triton kernels run on a GPU where there is one (tests marked `gpu`) and under
Triton's interpreter on CPU tensors everywhere else."""

from __future__ import annotations

import os

import pytest
import torch

from qwen_embed import Encoder, kernels, native
from qwen_embed.kernels import reference

from reference import cosine, random_sequences, reference_embeddings

# Against the reference's ops, which round some steps twice where a kernel rounds once: a value
# may land a step of the dtype away.
TOLERANCE = {
    torch.float32: dict(rtol=2e-6, atol=1e-6),
    torch.bfloat16: dict(rtol=2**-7, atol=1e-3),
    torch.float16: dict(rtol=2**-10, atol=1e-4),
}
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
GPU = pytest.mark.gpu


def _tables(reference_too: bool = True):
    """(table, device) pairs this machine runs: torch everywhere, native where built, Triton
    on CUDA (marked gpu) and interpreted on CPU."""
    pairs = [pytest.param("torch", "cpu", id="torch")] if reference_too else []
    if native.isa() is not None:
        pairs.append(pytest.param("native", "cpu", id="native"))
    pairs.append(pytest.param("triton", "cpu", id="triton-interpreted"))
    pairs.append(pytest.param("triton", "cuda", id="triton-cuda", marks=GPU))
    return pairs


TABLES = pytest.mark.parametrize(("table", "device"), _tables())
KERNELS = pytest.mark.parametrize(("table", "device"), _tables(reference_too=False))


def _ops(table: str, device: str):
    """The table, where this process runs it on `device`: Triton's interpreter is on or off for
    the whole process (conftest.py: on, except in a GPU run)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if table == "triton" and interpreted != (device == "cpu"):
        pytest.skip(f"Triton's interpreter is {'on' if interpreted else 'off'} in this run")
    return kernels.load(table)


def _random(*shape: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(dtype).to(device)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.cpu(), expected.cpu(), **TOLERANCE[dtype])


@TABLES
@DTYPES
@pytest.mark.parametrize("width", [1024, 1000])  # 1,000: a masked tail
def test_add_rms_norm_sums_exactly_and_normalises_the_sum(table, device, dtype, width):
    ops = _ops(table, device)
    x = _random(37, width, dtype=dtype, device=device)
    residual = _random(37, width, dtype=dtype, device=device, seed=1)
    weight = _random(width, dtype=dtype, device=device, seed=2)
    expected_sum = x + residual  # torch rounds the sum once: so must every table
    normed, summed = ops.add_rms_norm(x.clone(), residual, weight, 1e-6)
    assert torch.equal(summed, expected_sum)
    _close(normed, reference.rms_norm(expected_sum, weight, 1e-6), dtype)
    if table == "native":  # one pass over a row: its rms_norm's bits
        assert torch.equal(normed, ops.rms_norm(expected_sum, weight, 1e-6))
    _close(ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), dtype)


@TABLES
@pytest.mark.parametrize("width", [1024, 1000])
def test_rms_norm_with_an_fp32_weight_rounds_once(table, device, width):
    check_fp32_weight_norm(_ops(table, device), device, width)


def check_fp32_weight_norm(ops, device: str, width: int) -> None:
    """Qwen3.5's norms: bf16 rows scaled by an fp32 1 + weight in fp32 and rounded once, as
    transformers' Qwen3_5RMSNorm computes them; strided rows (its q/k heads) too."""
    wide = _random(37, width + 24, dtype=torch.bfloat16, device=device)
    x, residual = wide[:, :width], _random(37, width, dtype=torch.bfloat16, device=device, seed=1)
    weight = 1.0 + _random(width, dtype=torch.float32, device=device, seed=2) / 8

    def expected(rows):
        y = rows.float()
        return (y * torch.rsqrt(y.square().mean(-1, keepdim=True) + 1e-6) * weight).bfloat16()

    _close(ops.rms_norm(x, weight, 1e-6), expected(x), torch.bfloat16)
    summed = x + residual
    normed, total = ops.add_rms_norm(x.contiguous(), residual, weight, 1e-6)
    assert torch.equal(total, summed)
    _close(normed, expected(summed), torch.bfloat16)
    # rounded once: within half a bf16 step (and fp32's error) of the exact value
    exact = summed.double() * torch.rsqrt(summed.double().square().mean(-1, keepdim=True))
    value = exact * weight.double()
    half_step = torch.exp2(torch.floor(torch.log2(value.abs())) - 8)
    assert ((normed.double() - value).abs() <= half_step + value.abs() * 1e-6).all()


@KERNELS  # the reference's rotation rounds twice: a step away where the terms cancel
@DTYPES
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # q/k norm only in Qwen3
def test_norm_rotary_on_the_qkv_rows(table, device, dtype, head_dim, family):
    """q and k are strided slices of the packed q|k|v projection, as the attention has them."""
    ops = _ops(table, device)
    if table == "native" and dtype == torch.float16:
        pytest.skip("no fp16 native kernels: the table runs the reference's ops")
    t, heads, kv_heads = 19, 4, 2
    qkv = _random(t, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    q, k = qkv[:, : heads * head_dim], qkv[:, heads * head_dim : (heads + kv_heads) * head_dim]
    angles = torch.arange(t).float()[:, None] * torch.rand(head_dim // 2)
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    weight = _random(head_dim, dtype=dtype, device=device, seed=3) if family == "qwen3" else None
    for x, n in ((q, heads), (k, kv_heads)):
        out = ops.norm_rotary(x, cos, sin, head_dim, weight, 1e-6)
        assert out.shape == (t, n, head_dim) and out.is_contiguous()
        heads_in = x.reshape(t, n, head_dim)
        normed = reference.rms_norm(heads_in, weight, 1e-6) if weight is not None else heads_in
        # the rotation in float64, rounded once
        rotated = reference.rotary(normed.double(), cos.double(), sin.double()).to(dtype)
        _close(out, rotated, dtype)


@TABLES
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 72, 128])  # 72: Qwen3-VL-8B's tower, a scalar tail
def test_norm_rotary_with_fp32_tables_rotates_in_fp32(table, device, dtype, head_dim):
    """The vision tower's rotation: fp32 cos/sin, q and k slices of its q|k|v rows in the model
    dtype, the rotation in fp32 rounded once (transformers' vision attention)."""
    ops = _ops(table, device)
    t, heads = 37, 3
    qkv = _random(t, 3 * heads * head_dim, dtype=dtype, device=device)
    angles = torch.arange(t).float()[:, None] * torch.rand(head_dim // 2)
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    for x in (qkv[:, : heads * head_dim], qkv[:, heads * head_dim : 2 * heads * head_dim]):
        out = ops.norm_rotary(x, cos, sin, head_dim, None, 0.0)
        assert out.shape == (t, heads, head_dim) and out.is_contiguous() and out.dtype == dtype
        heads_in = x.reshape(t, heads, head_dim).double()
        want = reference.rotary(heads_in, cos.double(), sin.double()).to(dtype)
        # fp32 arithmetic against float64, rounded to the dtype: at most a step apart
        torch.testing.assert_close(out.cpu(), want.cpu(), **TOLERANCE[dtype])
        # bitwise the expression it stands for, where fp32 rounds alike (not the fused path)
        if dtype != torch.float32:
            fp32 = reference.rotary(x.reshape(t, heads, head_dim).float(), cos, sin).to(dtype)
            mismatched = (out.cpu() != fp32.cpu()).float().mean().item()
            assert mismatched < 0.01, mismatched


@TABLES
@DTYPES
@pytest.mark.parametrize("width", [3072, 1000])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's, at -200
def test_silu_mul(table, device, dtype, width):
    ops = _ops(table, device)
    gate_up = _random(23, 2 * width, dtype=dtype, device=device)
    gate_up[0, :8] = torch.tensor([-200.0, -88.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 200.0])
    expected = reference.silu_mul(gate_up.double()).to(dtype)
    _close(ops.silu_mul(gate_up), expected, dtype)


@TABLES
@DTYPES
@pytest.mark.parametrize("width", [4096, 1000])
def test_gelu_tanh(table, device, dtype, width):
    """The vision tower's MLP activation, on strided rows (a slice of wider ones)."""
    ops = _ops(table, device)
    x = _random(23, width + 24, dtype=dtype, device=device)[:, 24:]
    x[0, :10] = torch.tensor([-200.0, -88.0, -30.0, -5.0, -3.0, -1e-3, 0.0, 1e-3, 30.0, 200.0])
    out = ops.gelu_tanh(x)
    assert out.is_contiguous()
    _close(out, reference.gelu_tanh(x.double()).to(dtype), dtype)


TRITON = pytest.mark.parametrize(
    ("table", "device"),
    [p for p in _tables(reference_too=False) if p.values[0] == "triton"],
)


@TRITON
@DTYPES
@pytest.mark.parametrize("width", [64, 1000, 5000])  # 5,000: a row in three steps
def test_quantize_fp8_gives_the_references_codes(table, device, dtype, width):
    """The fp8 route's activation codes and scales, bit for bit: rows of every magnitude, a
    zero row, a row of ties to even (its largest value 448: scale 1), strided rows."""
    ops = _ops(table, device)
    x = _random(6, width + 8, dtype=dtype, device="cpu")
    x *= torch.logspace(-6, 3, 6).view(-1, 1).to(dtype)
    x[1] = 0
    ties = [448.0, 1.0625, 1.1875, -1.0625, 100.0, 17.0, 1.5 * 2**-9, 2.5 * 2**-9, 0.5 * 2**-9]
    x[2] = 0
    x[2, : len(ties)] = torch.tensor(ties)
    rows = x.to(device)[:, :width]
    codes, scale = ops.quantize_fp8(rows)
    want_codes, want_scale = reference.quantize_fp8(x[:, :width])
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    assert torch.equal(codes.cpu().view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scale.cpu(), want_scale)


@TABLES
def test_no_rows_is_no_launch(table, device):
    ops = _ops(table, device)
    empty = torch.empty(0, 256, dtype=torch.bfloat16, device=device)
    w = torch.ones(256, dtype=torch.bfloat16, device=device)
    assert ops.rms_norm(empty, w, 1e-6).shape == (0, 256)
    assert ops.silu_mul(empty).shape == (0, 128)
    assert ops.gelu_tanh(empty).shape == (0, 256)
    cos = torch.empty(0, 32, dtype=torch.bfloat16, device=device)
    assert ops.norm_rotary(empty, cos, cos, 64, None, 1e-6).shape == (0, 4, 64)
    assert [t.shape for t in ops.quantize_fp8(empty)] == [(0, 256), (0, 1)]


def test_each_route_names_its_table():
    assert kernels.choose("cpu", "avx2") == "native"
    assert kernels.choose("cpu", None) == "torch"
    assert kernels.choose("cuda:0", None, has_triton=lambda: True) == "triton"
    assert kernels.choose("cuda:1", None, has_triton=lambda: False) == "torch"
    for name in kernels.TABLES:
        table = kernels.load(name)
        assert table.NAME == name
        for op in (
            "rms_norm",
            "add_rms_norm",
            "norm_rotary",
            "silu_mul",
            "gelu_tanh",
            "quantize_fp8",
        ):
            assert callable(getattr(table, op)), (name, op)
    with pytest.raises(ValueError, match="unknown row-op table 'cuda'"):
        kernels.load("cuda")


@pytest.mark.parametrize(
    ("table", "dtype"),
    [
        ("torch", "float32"),
        ("torch", "bfloat16"),
        # the kernels' rounding is checked bitwise above; interpreted, a whole forward is slow
        # (a program at a time): the server tier's
        pytest.param("triton", "float32", marks=pytest.mark.server),
        pytest.param("triton", "bfloat16", marks=pytest.mark.server),
    ],
)
@pytest.mark.parametrize("name", ["qwen2", "qwen3"])  # q/k/v bias; q/k norm and head_dim 32
def test_the_model_on_a_table_matches_transformers(checkpoint, name, table, dtype, monkeypatch):
    """The whole forward with a table forced onto the CPU route (the Triton one interpreted,
    a program at a time: few tokens): the residual adds fused into the norms, the pruned last
    layer."""
    if table == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is off in this run")
    monkeypatch.setattr(kernels, "choose", lambda *args: table)
    seqs = random_sequences([1, 12, 20], seed=5)
    torch_dtype = getattr(torch, dtype)
    ref = reference_embeddings(checkpoint(name), seqs, dtype=torch_dtype)
    with Encoder.from_pretrained(checkpoint(name), dtype=dtype) as enc:
        assert enc.route.elementwise == table
        out = enc.embed(seqs)
    assert cosine(out, ref).min() >= (0.99999 if dtype == "float32" else 0.999)


def _kernel_launches(enc: Encoder, seqs) -> int:
    """CUDA kernels one embed() launches (copies and memsets not counted), after a warm-up."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    enc.embed(seqs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        enc.embed(seqs)
        torch.cuda.synchronize()
    return sum(
        e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
        for e in prof.events()
    )


MAX_LAUNCHES_PER_LAYER = 12


@GPU
def test_a_layer_launches_few_kernels(checkpoint):
    """A middle layer's kernels in an eager forward (CUDA graphs off: their static buffers add
    copies), counted as the difference between a 4- and a 2-layer model of the same shape (the
    first and the pruned last layer are in both)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    seqs = random_sequences([40, 100, 7, 300], seed=1)
    launches = {}
    for layers, name in ((2, "qwen3_head128"), (4, "qwen3_head128_4layers")):
        with Encoder.from_pretrained(
            checkpoint(name), dtype="bfloat16", device="cuda:0", cuda_graph_tokens=0
        ) as enc:
            assert enc.route.elementwise == "triton"
            launches[layers] = _kernel_launches(enc, seqs)
    per_layer = (launches[4] - launches[2]) / 2
    print(f"kernel launches: {launches}, {per_layer} per layer")
    assert 0 < per_layer <= MAX_LAUNCHES_PER_LAYER


@TABLES
@DTYPES
@pytest.mark.parametrize("width", [384, 200])  # 200: a masked tail
def test_causal_convolution_restarts_at_each_sequence_of_strided_rows(table, device, dtype, width):
    """Qwen3.5's: q|k|v are the leading columns of a wider projection; sequences of 1, 2, 3
    and more rows reach back over fewer taps than the kernel has."""
    ops = _ops(table, device)
    lengths = [5, 1, 2, 3, 9, 4]
    position = torch.cat([torch.arange(n) for n in lengths]).to(device)
    wide = _random(sum(lengths), width + 100, dtype=dtype, device=device)
    x = wide[:, :width]
    weight = _random(width, 4, dtype=torch.float32, device=device, seed=1)
    out = ops.causal_conv_silu(x, weight, position)
    _close(out, reference.causal_conv_silu(x, weight, position), dtype)
    start = 0
    for n in lengths:  # each sequence alone: no row reaches into the one before
        rows = slice(start, start + n)
        alone = ops.causal_conv_silu(x[rows], weight, position[rows])
        _close(alone, out[rows], dtype)
        start += n


@TABLES
@DTYPES
@pytest.mark.parametrize(
    ("key_dim", "value_dim"),
    [(128, 128), (16, 24), (30, 40)],  # Qwen3.5's; the replicas' (a block's tail); odd sizes
)
def test_gated_delta_rule_from_states_to_cuts(table, device, dtype, key_dim, value_dim):
    check_gated_delta_rule(_ops(table, device), device, dtype, key_dim, value_dim)


def check_gated_delta_rule(ops, device: str, dtype: torch.dtype, key_dim: int, value_dim: int):
    """Qwen3.5's linear attention on q|k|v as the convolution leaves them (strided rows, two
    value heads per key head), sequences of 1 row to past a tile of rows, each from a given
    state, the states exported at cuts (inside a sequence, at its end, at a tile's end, twice
    at one place): against the chunked torch form (itself against the float64 recurrence:
    test_qwen3_5.py)."""
    from qwen_embed.gated_delta import SequencePlan

    lengths = [1, 17, 40, 3]
    t, heads = sum(lengths), 2
    widths = [heads * key_dim, heads * key_dim, 2 * heads * value_dim]
    mixed = _random(t, sum(widths) + 8, dtype=dtype, device=device)
    q, k, v = mixed[:, : sum(widths)].split(widths, dim=-1)
    q, k = q.reshape(t, heads, key_dim), k.reshape(t, heads, key_dim)
    v = v.reshape(t, 2 * heads, value_dim)
    g = -_random(t, 2 * heads, dtype=torch.float32, device=device, seed=1).abs()
    beta = _random(t, 2 * heads, dtype=dtype, device=device, seed=2).sigmoid()
    shape = (2 * heads, key_dim, value_dim)
    states = _random(len(lengths), *shape, dtype=torch.float32, device=device, seed=3) / 4
    cuts = [(1, 16), (2, 5), (2, 40), (0, 1), (2, 5), (1, 3)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    plan = SequencePlan.build(cu, device, cuts)
    exports = torch.full((len(cuts), *shape), float("nan"), device=device)
    out = ops.gated_delta_rule(q, k, v, g, beta, plan, states, exports)
    expected_exports = torch.empty((len(cuts), *shape), device=device)
    expected = reference.gated_delta_rule(q, k, v, g, beta, plan, states, expected_exports)
    _close(out, expected, torch.float32)
    _close(exports, expected_exports, torch.float32)
