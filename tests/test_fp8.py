"""The fp8 route (qwen_embed/fp8.py): e4m3 weights per output channel, activations per token,
torch._scaled_mm. Here on torch's CPU fp8 GEMM, which runs the route's logic; on cuBLASLt with
Triton's activation codes in the tests marked gpu. The codes' kernels against the reference:
test_kernels.py."""

from __future__ import annotations

import pytest
import torch

from qwen_embed import Encoder, int8, kernels
from qwen_embed.fp8 import Fp8Weight, weight_codes
from qwen_embed.kernels import reference
from qwen_embed.layers import _Linear

from reference import GPU_CONFIGS, cosine, random_sequences, reference_embeddings

# Against transformers' bf16 forward on the tiny replicas (2 layers, random weights); measured
# 0.9950-0.9989 over qwen2, qwen3, qwen3_kv1 and gte_qwen2 with two sets of texts. e4m3 keeps 3
# mantissa bits (int8 on Hadamard-rotated rows: >= 0.999, INT8_COSINE).
FP8_COSINE = 0.99


def _random(*shape: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_codes_round_to_nearest_even_within_448():
    """A row whose largest value is 448 keeps its scale 1: each value is its e4m3 code, ties to
    even, subnormal steps (2**-9) included, the sign of zero kept."""
    step = 2.0**-9
    row = [448.0, 1.0625, 1.1875, -1.0625, 100.0, 17.0, 1.5 * step, 2.5 * step, 0.5 * step, -0.0]
    codes, scale = reference.quantize_fp8(torch.tensor([row]))
    assert codes.dtype == torch.float8_e4m3fn and scale.tolist() == [[1.0]]
    want = [448.0, 1.0, 1.25, -1.0, 96.0, 16.0, 2 * step, 2 * step, 0.0, -0.0]
    assert codes.float().tolist() == [want]
    assert torch.signbit(codes.float()[0, -1])
    # a zero row: zero codes and a tiny scale, no division by zero
    codes, scale = reference.quantize_fp8(torch.zeros(2, 32))
    assert not codes.float().any() and (scale > 0).all()


def test_weight_codes_per_channel():
    w = _random(40, 64, seed=1) * torch.logspace(-3, 2, 40).view(-1, 1).bfloat16()
    codes, scale = weight_codes(w)
    assert codes.shape == (40, 64) and scale.shape == (1, 40)
    assert (codes.float().abs().amax(dim=1) == 448).all()  # each channel's largest value
    dequantised = codes.float() * scale.view(-1, 1)
    # e4m3 rounds a value within 2**-4 of itself, or below 2**-6 (in codes) within half a step
    # of 2**-9
    bound = torch.maximum(w.float().abs() * 2**-4, scale.view(-1, 1) * 2**-10)
    assert ((dequantised - w.float()).abs() <= bound).all()


@pytest.mark.parametrize("bias", [False, True])
def test_a_layer_multiplies_its_codes(bias):
    """Fp8Weight's product is the product of the codes it holds and the input's codes, scaled
    per row and per channel, rounded to the input's dtype once; rows of any leading shape."""
    w, x = _random(48, 64, seed=2), _random(2, 5, 64, seed=3)
    b = _random(48, seed=4) if bias else None
    layer = Fp8Weight(w)
    out = layer(x, b)
    assert out.shape == (2, 5, 48) and out.dtype == torch.bfloat16
    xq, xs = reference.quantize_fp8(x.reshape(-1, 64))
    want = ((xq.float() @ layer.codes.float().t()) * xs * layer.scale).bfloat16()
    if bias:
        want = want + b
    torch.testing.assert_close(out.reshape(-1, 48), want, rtol=2**-7, atol=1e-3)
    exact = x.float() @ w.float().t() + (b.float() if bias else 0)
    assert cosine(out.reshape(-1, 48).float().numpy(), exact.reshape(-1, 48).numpy()).min() > 0.99
    assert layer(x[:, :0], b).shape == (2, 0, 48)  # no rows


def test_widths_scaled_mm_cannot_take_are_refused():
    with pytest.raises(ValueError, match="multiples of 16: this one is 64 -> 40"):
        Fp8Weight(torch.randn(40, 64))


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_the_fp8_route_against_transformers(checkpoint, name):
    """The layers int8 quantises take fp8 (q|k, gate|up, down; v and o stay in bf16), a TP
    shard's channels their own scales, every other step the bf16 route's."""
    seqs = random_sequences([1, 17, 90, 200], seed=3)
    ref = reference_embeddings(checkpoint(name), seqs, dtype=torch.bfloat16)
    with Encoder.from_pretrained(checkpoint(name), quantization="fp8") as enc:
        linears = {n: m for n, m in enc.model.named_modules() if isinstance(m, _Linear)}
        assert sum(isinstance(m.kernel, Fp8Weight) for m in linears.values()) == (
            len(linears) - 2 * len(enc.model.layers)
        )
        assert all(isinstance(m.kernel, Fp8Weight) == int8.quantizes(n) for n, m in linears.items())
        assert enc.model.layers[0].self_attn.projections == (("q", "k"), ("v",))
        out = enc.embed(seqs)
        assert cosine(out, ref).min() >= FP8_COSINE
        # a text's vector alone is its vector in the batch (scales per row and per channel)
        alone = enc.embed(seqs[2:3])
    assert cosine(alone, out[2:3]).min() >= 0.99999
    if name == "qwen3":  # qwen2's shards are narrower than _scaled_mm takes (56 channels)
        with Encoder.from_pretrained(checkpoint(name), quantization="fp8", tp_size=2) as enc:
            assert cosine(enc.embed(seqs), ref).min() >= FP8_COSINE


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in sorted(GPU_CONFIGS) if "layers" not in n])
def test_the_fp8_route_on_the_gpu(checkpoint, name):
    """cuBLASLt's fp8 GEMM on Triton's codes, in CUDA graphs and eagerly, against transformers'
    bf16 forward; one layer's product against the CPU's on the same codes."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no GPU with fp8 tensor cores")
    seqs = random_sequences([1, 17, 90, 200, 600], seed=3)
    ref = reference_embeddings(checkpoint(name), seqs, dtype=torch.bfloat16)
    outs = []
    for graphs in (8192, 0):
        with Encoder.from_pretrained(
            checkpoint(name), quantization="fp8", device="cuda:0", cuda_graph_tokens=graphs
        ) as enc:
            assert enc.route.elementwise == "triton"
            outs.append(enc.embed(seqs))
        assert cosine(outs[-1], ref).min() >= FP8_COSINE
    assert cosine(outs[0], outs[1]).min() >= 0.9999
    w, x = _random(256, 512, seed=5), _random(33, 512, seed=6)
    layer = Fp8Weight(w)
    on_gpu = Fp8Weight(w.cuda(), ops=kernels.load("triton"))
    torch.testing.assert_close(on_gpu(x.cuda()).cpu(), layer(x), rtol=2**-7, atol=1e-2)
