"""The fp32 GEMM of CPUs with AVX2 and no AVX-512 (native/csrc/gemm/floats_avx2.cpp,
avx2_gemm.Avx2F32Weight): against the float64 product (fp32 rounding of one chain of
multiply-adds), a row the same at every row count, stride and blocking, channel tails and depth
blocks, weights that are bf16 values held in bf16 with the same bits, the operator's refusals,
and the route that chooses it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_cpu_route import EPYC_AVX2, SAPPHIRE, ZEN4

from qwen_embed import Encoder, avx2_gemm, engine, native
from qwen_embed.avx2_gemm import Avx2F32Weight
from qwen_embed.layers import _Linear
from qwen_embed.loader import load_weights
from qwen_embed.route import Gemm, Linear
from qwen_embed_deploy.demo import build_demo_adapter

from reference import make_checkpoint, route_for

NEEDS_OPERATOR = pytest.mark.skipif(
    not avx2_gemm.runs(), reason="the native fp32 operator needs the build and AVX2"
)


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _product(x, w, bias=None):
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def _fp32_held(w: torch.Tensor) -> torch.Tensor:
    """The operator's fp32 layout of any weights, bf16 values included."""
    return native.pack_panels(w.float(), 1, avx2_gemm.PANEL).squeeze(-1)


@NEEDS_OPERATOR
@pytest.mark.parametrize(
    "n, k",
    [(64, 32), (1000, 777), (40, 2500), (16, 300), (8, 5)],
    ids=["one-block", "tails", "depth-blocks", "one-panel", "narrow"],
)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_matches_the_float64_product(n, k, with_bias):
    w, x = _random(n, k, seed=1) * 0.05, _random(37, k, seed=2)
    bias = _random(n, seed=3) if with_bias else None
    out = Avx2F32Weight(w)(x, bias)
    assert out.shape == (37, n) and out.dtype == torch.float32
    # fp32 rounding of k products: well inside sqrt(k) ulps of the sums' magnitude
    torch.testing.assert_close(out.double(), _product(x, w, bias), rtol=1e-5, atol=1e-5)


@NEEDS_OPERATOR
def test_a_row_is_the_same_at_every_row_count_stride_and_blocking():
    w, bias = _random(1000, 1100, seed=4) * 0.05, _random(1000, seed=5)  # two depth blocks
    layer = Avx2F32Weight(w)
    wide = _random(300, 1200, seed=6)
    x = wide[:, :1100]  # rows 1,200 values apart
    all_rows = layer(x, bias)
    for m in range(1, 26):  # up to 5 blocks of 6 rows, the last one short
        assert torch.equal(layer(x[:m], bias), all_rows[:m]), m
        assert torch.equal(layer(x[-m:].contiguous(), bias), all_rows[-m:]), m
    for blocking in [(1, 16, False), (7, 32, True), (200, 1024, False), (6, 992, True)]:
        out = torch.ops.qwen_embed.f32_linear(x, layer.packed, bias, 1000, *blocking)
        assert torch.equal(out, all_rows), blocking
    # batched inputs are rows too
    assert torch.equal(layer(x[:12].reshape(3, 4, 1100), bias), all_rows[:12].reshape(3, 4, 1000))


@NEEDS_OPERATOR
@pytest.mark.parametrize(
    "n, k",
    [(64, 32), (1000, 777), (40, 2500), (16, 300), (8, 5)],
    ids=["one-block", "tails", "depth-blocks", "one-panel", "narrow"],
)
def test_bf16_values_are_held_in_bf16_with_the_same_bits(n, k):
    """A 16-bit checkpoint's weights, served in fp32: held in half the bytes, widened exactly
    as they are loaded, so every output is the fp32-held weights' to the bit."""
    w = (_random(n, k, seed=1) * 0.05).bfloat16()
    x, bias = _random(37, k, seed=2), _random(n, seed=3)
    layer = Avx2F32Weight(w.float())
    assert layer.packed.dtype == torch.bfloat16
    assert layer.packed.nbytes * 2 == _fp32_held(w).nbytes
    assert torch.equal(Avx2F32Weight(w).packed, layer.packed)  # held as bf16 or as fp32 values
    for rows in (1, 5, 37):
        out = layer(x[:rows], bias)
        f32 = torch.ops.qwen_embed.f32_linear(x[:rows], _fp32_held(w), bias, n)
        assert torch.equal(out, f32), rows
    torch.testing.assert_close(out.double(), _product(x, w, bias), rtol=1e-5, atol=1e-5)


@NEEDS_OPERATOR
def test_weights_past_bf16_stay_in_fp32():
    w = (_random(48, 64, seed=4) * 0.05).bfloat16().float()
    w[17, 33] += 2**-20  # one value between two bf16 ones
    layer = Avx2F32Weight(w)
    assert layer.packed.dtype == torch.float32 and torch.equal(layer.packed, _fp32_held(w))


@NEEDS_OPERATOR
def test_16_bit_rows_widen_and_round_back():
    w, x = _random(48, 64, seed=7) * 0.1, _random(5, 64, seed=8).bfloat16()
    layer = Avx2F32Weight(w)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, layer(x.float()).bfloat16())


@NEEDS_OPERATOR
def test_the_operator_names_what_it_refuses():
    packed, x = Avx2F32Weight(_random(32, 16, seed=9)).packed, _random(2, 16, seed=1)
    f32_linear = torch.ops.qwen_embed.f32_linear
    with pytest.raises(RuntimeError, match="float32 rows"):
        f32_linear(x.double(), packed, None, 32)
    with pytest.raises(RuntimeError, match=r"\[n_pad / 16, k, 16\] weights of 32 channels of 8"):
        f32_linear(x[:, :8], packed, None, 32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        f32_linear(x, packed.half(), None, 32)
    with pytest.raises(RuntimeError, match=r"bias must be float32 \[32\]"):
        f32_linear(x, packed, _random(31, seed=2), 32)
    with pytest.raises(RuntimeError, match="multiple of the panel's 16 channels"):
        f32_linear(x, packed, None, 32, 8, 24)


def test_fp32_gemms_on_avx2_cpus_take_the_operator():
    assert route_for(EPYC_AVX2).gemm is Gemm.NATIVE_F32  # fp32 by default there
    assert "native AVX2 fp32 GEMM" in route_for(EPYC_AVX2).describe()
    # bf16 and fp16 weights held in fp32 there, and int8's float layers, multiply on it too
    for settings in ({"dtype": "bfloat16"}, {"dtype": "float16"}, {"quantization": "int8"}):
        assert route_for(EPYC_AVX2, **settings).gemm is Gemm.NATIVE_F32, settings
    # prepack_weights "on" asks for oneDNN's packing, "off" for F.linear
    assert route_for(EPYC_AVX2, prepack_weights=True).gemm is Gemm.ONEDNN
    assert route_for(EPYC_AVX2, prepack_weights=False).gemm is Gemm.TORCH
    assert route_for(EPYC_AVX2, avx2_f32=False).gemm is Gemm.ONEDNN  # not built here
    # AVX-512 CPUs keep oneDNN's GEMM (unmeasured there), in fp32 and in fp32-held fp16
    for features in (ZEN4, SAPPHIRE):
        assert route_for(features, dtype="float32").gemm is Gemm.ONEDNN
        route = route_for(features, dtype="float16")
        assert (route.linear, route.gemm) == (Linear.FP32_GEMM, Gemm.ONEDNN)
    assert route_for(EPYC_AVX2, "cuda:0", dtype="float32").gemm is Gemm.TORCH


@NEEDS_OPERATOR
def test_an_avx2_encoder_multiplies_every_text_layer_on_it(checkpoint):
    with Encoder.from_pretrained(checkpoint("qwen3"), device="cpu", dtype="float32") as enc:
        if enc.route.gemm is not Gemm.NATIVE_F32:
            pytest.skip(f"this CPU takes {enc.route.gemm.value} ({enc.route.reason})")
        linears = [m for m in enc.model.modules() if isinstance(m, _Linear)]
        assert linears and all(isinstance(m.kernel, Avx2F32Weight) for m in linears)
        assert all(m.weight is None for m in linears)  # the packed copy is the only one


@NEEDS_OPERATOR
def _loaded_as(monkeypatch) -> dict[str, torch.dtype]:
    """What each linear weight's storage is as the checkpoint is loaded into it."""
    seen = {}

    def spy(model, *args, **kwargs):
        seen.update({n: m.weight.dtype for n, m in model.named_modules() if isinstance(m, _Linear)})
        return load_weights(model, *args, **kwargs)

    monkeypatch.setattr(engine, "load_weights", spy)
    return seen


@NEEDS_OPERATOR
def test_a_bf16_checkpoint_in_fp32_holds_its_layers_in_bf16(tmp_path, monkeypatch):
    """Served in fp32, a checkpoint saved in bf16 loads every text layer's weights into bf16
    (never the fp32 model), keeps them in bf16, and gives the vectors of the same weights
    loaded and held in fp32, to the bit."""
    ckpt = make_checkpoint(tmp_path / "bf16", "qwen3", dtype=torch.bfloat16)
    ids = [list(range(3, 3 + n)) for n in (1, 9, 40)]
    loaded = _loaded_as(monkeypatch)
    with Encoder.from_pretrained(ckpt, device="cpu", dtype="float32") as enc:
        if enc.route.gemm is not Gemm.NATIVE_F32:
            pytest.skip(f"this CPU takes {enc.route.gemm.value} ({enc.route.reason})")
        assert loaded and set(loaded.values()) == {torch.bfloat16}, loaded
        kernels = [m.kernel for m in enc.model.modules() if isinstance(m, _Linear)]
        assert kernels and all(k.packed.dtype == torch.bfloat16 for k in kernels)
        held = enc.embed(ids)
    monkeypatch.setattr(avx2_gemm, "pack", _fp32_held)
    monkeypatch.setattr(engine, "_linears_as_stored", lambda *_: None)
    loaded.clear()
    with Encoder.from_pretrained(ckpt, device="cpu", dtype="float32") as enc:
        assert set(loaded.values()) == {torch.float32}
        kernels = [m.kernel for m in enc.model.modules() if isinstance(m, _Linear)]
        assert all(k.packed.dtype == torch.float32 for k in kernels)
        assert torch.equal(torch.as_tensor(enc.embed(ids)), torch.as_tensor(held))


@NEEDS_OPERATOR
def test_layers_fed_by_other_dtypes_load_in_fp32(tmp_path, monkeypatch):
    """A linear weight fed by any tensor not stored in bf16 (here one of the q|k|v shards in
    fp32) and every layer under a merged adapter load in fp32 as before."""
    ckpt = make_checkpoint(tmp_path / "bf16", "qwen3", dtype=torch.bfloat16)
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    key = next(k for k in tensors if k.endswith("layers.0.self_attn.k_proj.weight"))
    tensors[key] = tensors[key].float()
    save_file(tensors, path, metadata={"format": "pt"})
    loaded = _loaded_as(monkeypatch)
    with Encoder.from_pretrained(ckpt, device="cpu", dtype="float32") as enc:
        if enc.route.gemm is not Gemm.NATIVE_F32:
            pytest.skip(f"this CPU takes {enc.route.gemm.value} ({enc.route.reason})")
    fp32 = {n for n, d in loaded.items() if d == torch.float32}
    assert fp32 == {"layers.0.self_attn.qkv_proj"}, loaded
    loaded.clear()
    adapter = build_demo_adapter(tmp_path / "adapter", ckpt, rank=4, seed=1)
    with Encoder.from_pretrained(adapter, device="cpu", dtype="float32") as enc:
        assert enc.route.adapter == "lora"  # merged at load: its layers' values are fp32 ones
        assert loaded and set(loaded.values()) == {torch.float32}, loaded


@NEEDS_OPERATOR
def test_the_int8_route_quantises_bf16_storage_as_its_fp32_copy(tmp_path, monkeypatch):
    """The int8 route on AVX2 loads a bf16 checkpoint into bf16 storage too: the same codes,
    scales and vectors as from the fp32 copies it loaded before."""
    ckpt = make_checkpoint(tmp_path / "bf16", "qwen3", dtype=torch.bfloat16)
    ids = [list(range(3, 3 + n)) for n in (1, 9, 40)]
    loaded = _loaded_as(monkeypatch)
    settings = {"device": "cpu", "dtype": "float32", "quantization": "int8"}
    with Encoder.from_pretrained(ckpt, **settings) as enc:
        if enc.route.gemm is not Gemm.NATIVE_F32:
            pytest.skip(f"this CPU takes {enc.route.gemm.value} ({enc.route.reason})")
        assert loaded and set(loaded.values()) == {torch.bfloat16}, loaded
        held = enc.embed(ids)
    monkeypatch.setattr(engine, "_linears_as_stored", lambda *_: None)
    loaded.clear()
    with Encoder.from_pretrained(ckpt, **settings) as enc:
        assert set(loaded.values()) == {torch.float32}
        assert torch.equal(torch.as_tensor(enc.embed(ids)), torch.as_tensor(held))


@NEEDS_OPERATOR
def test_a_bf16_model_packs_its_layers_without_widening_them(tmp_path, monkeypatch):
    """dtype bfloat16 on the AVX2 GEMM (its layers held for one fp32 GEMM): every layer
    reaches the packing in bf16, none widened to fp32 first (the load never holds the fp32
    copies), with the vectors of the layers widened first, to the bit (Qwen2: q|k|v bias)."""
    ckpt = make_checkpoint(tmp_path / "bf16", "qwen2", dtype=torch.bfloat16)
    ids = [list(range(3, 3 + n)) for n in (1, 9, 40)]
    packed_from, pack = [], avx2_gemm.pack
    monkeypatch.setattr(avx2_gemm, "pack", lambda w: packed_from.append(w.dtype) or pack(w))
    with Encoder.from_pretrained(ckpt, device="cpu", dtype="bfloat16") as enc:
        if enc.route.gemm is not Gemm.NATIVE_F32:
            pytest.skip(f"this CPU takes {enc.route.gemm.value} ({enc.route.reason})")
        assert enc.route.linear is Linear.FP32_GEMM
        assert packed_from and set(packed_from) == {torch.bfloat16}, packed_from
        linears = [m for m in enc.model.modules() if isinstance(m, _Linear)]
        assert all(m.kernel.packed.dtype == torch.bfloat16 for m in linears)
        biases = [b for m in linears if (b := getattr(m, "bias", None)) is not None]  # at load
        assert biases and all(b.dtype == torch.float32 for b in biases)
        unwidened = enc.embed(ids)
    # widened first, as for the other GEMMs
    monkeypatch.setattr(Avx2F32Weight, "takes_16_bit_weights", False)
    packed_from.clear()
    with Encoder.from_pretrained(ckpt, device="cpu", dtype="bfloat16") as enc:
        assert packed_from and set(packed_from) == {torch.float32}, packed_from
        assert torch.equal(torch.as_tensor(enc.embed(ids)), torch.as_tensor(unwidened))
