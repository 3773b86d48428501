"""Engine vs transformers' Qwen2Model/Qwen3Model (one unpadded sequence at a time).

Tolerances: fp32 cosine >= 0.99999 per text and max-abs <= 1e-4 (on unit vectors, or relative
to the largest reference component without normalisation); bf16 and fp16 cosine >= 0.999.
"""

import json

import numpy as np
import pytest
import torch

from qwen_embed import Encoder, layers
from qwen_embed.cpu import cpu_features

from reference import cosine, random_sequences, reference_embeddings

FP32_COSINE = 0.99999
FP32_MAX_ABS = 1e-4
BF16_COSINE = 0.999

CASES = {
    "one_text": dict(lengths=[23]),
    "mixed_lengths": dict(lengths=[7, 130, 1, 45, 300, 12, 64]),
    "length_1": dict(lengths=[1, 1, 1]),
    # 64-token budget: several forward batches, and a 150-token text that runs alone.
    "crosses_max_batch_tokens": dict(lengths=[40, 30, 150, 10, 60, 5, 33], max_batch_tokens=64),
    "dimensions": dict(lengths=[9, 50, 120], dimensions=16),
    "no_normalize": dict(lengths=[9, 50, 120], normalize=False),
    "mean_pooling": dict(lengths=[9, 50, 120], pooling="mean"),
    "mean_no_normalize_dims": dict(lengths=[3, 77], pooling="mean", normalize=False, dimensions=8),
}


def assert_close_fp32(out: np.ndarray, ref: np.ndarray) -> None:
    assert out.shape == ref.shape and out.dtype == np.float32
    assert cosine(out, ref).min() >= FP32_COSINE
    scale = max(1.0, float(np.abs(ref).max()))
    assert float(np.abs(out - ref).max()) <= FP32_MAX_ABS * scale


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp32_matches_transformers(checkpoint, config_name, case):
    spec = dict(CASES[case])
    lengths = spec.pop("lengths")
    pooling = spec.pop("pooling", "last")
    max_batch_tokens = spec.pop("max_batch_tokens", 16384)
    seqs = random_sequences(lengths, seed=len(case))
    ref = reference_embeddings(checkpoint(config_name), seqs, pooling=pooling, **spec)
    with Encoder.from_pretrained(
        checkpoint(config_name), dtype="float32", pooling=pooling, max_batch_tokens=max_batch_tokens
    ) as enc:
        out = enc.embed(seqs, **spec)
    assert_close_fp32(out, ref)
    if spec.get("normalize", True):
        np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("native_bf16", [False, True], ids=["fp32_gemm", "bf16_kernel"])
def test_bf16_matches_transformers(checkpoint, config_name, native_bf16, monkeypatch):
    # Both CPU routes for bf16 linear layers (layers.linear_weight_dtype), whatever this CPU has;
    # the bf16 one as batch_invariant "auto" takes it here (the native bf16 operator where it runs).
    monkeypatch.setattr(layers, "has_native_bf16", lambda: native_bf16)
    seqs = random_sequences([1, 17, 90, 200], seed=3)
    ref = reference_embeddings(checkpoint(config_name), seqs, dtype=torch.bfloat16)
    invariant = "auto" if native_bf16 else "off"  # fp32 GEMMs are row-invariant already
    # oneDNN packs bf16 weights with AVX-512 only: elsewhere the bf16 kernel is F.linear's
    prepack = "auto" if cpu_features().avx512 else "off"
    with Encoder.from_pretrained(
        checkpoint(config_name),
        dtype="bfloat16",
        batch_invariant=invariant,
        prepack_weights=prepack,
    ) as enc:
        linears = (layers.ColumnParallelLinear, layers.RowParallelLinear)
        held = [m.kernel or m.weight for m in enc.model.modules() if isinstance(m, linears)]
        weights = {w.dtype for w in held}  # a packed weight keeps its dtype
        assert weights == {torch.bfloat16 if native_bf16 else torch.float32}
        out = enc.embed(seqs)
    assert cosine(out, ref).min() >= BF16_COSINE


def test_fp16_matches_transformers(checkpoint, config_name):
    """fp16 on CPU: the weights held in fp32 (oneDNN packs fp16 ones only on CPUs that
    convert fp16 themselves, and torch's emulated fp16 GEMM is slower than fp32's), the
    activations, norms and attention in fp16."""
    seqs = random_sequences([1, 17, 90, 200], seed=3)
    ref = reference_embeddings(checkpoint(config_name), seqs, dtype=torch.float16)
    with Encoder.from_pretrained(checkpoint(config_name), dtype="float16") as enc:
        linears = (layers.ColumnParallelLinear, layers.RowParallelLinear)
        held = [m.kernel or m.weight for m in enc.model.modules() if isinstance(m, linears)]
        assert {w.dtype for w in held} == {torch.float32}
        out = enc.embed(seqs)
    assert cosine(out, ref).min() >= BF16_COSINE


def test_bf16_linear_through_fp32_gemm_is_a_bf16_gemm(monkeypatch):
    """bf16 activations on fp32-stored bf16 weights (upcast, fp32 GEMM, round to bf16) land
    within bf16 rounding of the exact product, as torch's own bf16 kernel does."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g).bfloat16() for shape in [(37, 64), (48, 64), (48,)])
    exact = x.double() @ w.double().T + b.double()
    cpu = torch.device("cpu")
    for native in (False, True):
        monkeypatch.setattr(layers, "has_native_bf16", lambda native=native: native)
        stored = layers.linear_weight_dtype(torch.bfloat16, cpu)
        assert stored == (torch.bfloat16 if native else torch.float32)
        out = layers.linear(x, w.to(stored), b.to(stored))
        assert out.dtype == torch.bfloat16 and out.shape == (37, 48)
        torch.testing.assert_close(out.double(), exact, rtol=2**-7, atol=1e-2)


def test_bidirectional_config_is_not_causal(checkpoint, tmp_path):
    """is_causal=false (gte-Qwen2) must really attend both ways: flipping it changes vectors."""
    source = checkpoint("gte_qwen2")
    config = json.loads((source / "config.json").read_text())
    assert config["is_causal"] is False
    for f in source.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "is_causal": True}))
    seqs = random_sequences([20, 40], seed=9)
    with Encoder.from_pretrained(source) as enc:
        bidirectional = enc.embed(seqs)
    with Encoder.from_pretrained(tmp_path) as enc:
        causal = enc.embed(seqs)
    assert cosine(bidirectional, causal).max() < 0.999
