"""Elementwise chains compiled by Inductor (fused.py, compiled.py): chosen by the route, exact
against the eager versions and transformers, scoped to the models that chose them, and eager
where compiling fails."""

import numpy as np
import pytest
import torch

from qwen_embed import Encoder
from qwen_embed.compiled import CompiledSet
from qwen_embed.cpu import CpuFeatures
from qwen_embed.fused import ELEMENTWISE
from qwen_embed.route import choose_route

from reference import cosine, random_sequences, reference_embeddings

ZEN4 = CpuFeatures.from_flags({"avx2", "avx512f", "avx512_bf16"}, "AMD EPYC 9B14")
AVX2 = CpuFeatures.from_flags({"avx", "avx2", "fma"}, "AMD EPYC 7B13")


def test_route_compiles_bf16_on_cpu_only():
    assert choose_route("auto", "none", "cpu", None, ZEN4).elementwise == "compiled (Inductor)"
    assert choose_route("auto", "none", "cpu", None, AVX2).elementwise == "eager"  # fp32
    assert choose_route("auto", "none", "cuda", "bfloat16", ZEN4).elementwise == "eager"
    assert choose_route("float32", "none", "cpu", None, AVX2, True).elementwise.startswith("comp")
    assert choose_route("auto", "none", "cpu", None, ZEN4, False).elementwise == "eager"
    assert "elementwise ops eager" in str(choose_route("auto", "none", "cpu", None, AVX2))


def test_compiled_matches_eager_and_transformers(checkpoint):
    # fp32, where rounding cannot hide a wrong formula: the compiled forward against the eager
    # one on the same model (toggled), and both against transformers.
    seqs = random_sequences([1, 17, 90, 3], seed=5)
    ref = reference_embeddings(checkpoint("qwen3"), seqs)
    with Encoder.from_pretrained(
        checkpoint("qwen3"), dtype="float32", compile_elementwise=True
    ) as enc:
        assert enc.model.compiled_elementwise and ELEMENTWISE.compiled
        assert enc.route.elementwise == "compiled (Inductor)"
        enc.model.compiled_min_rows = 0  # these small forwards too
        compiled = enc.embed(seqs)
        enc.model.compiled_elementwise = False
        eager = enc.embed(seqs)
    assert float(np.abs(compiled - eager).max()) <= 1e-5
    assert cosine(compiled, ref).min() >= 0.99999


def test_bf16_compiled_matches_transformers(checkpoint):
    seqs = random_sequences([1, 17, 90, 200], seed=3)
    ref = reference_embeddings(checkpoint("qwen3"), seqs, dtype=torch.bfloat16)
    with Encoder.from_pretrained(
        checkpoint("qwen3"), dtype="bfloat16", compile_elementwise=True
    ) as enc:
        assert enc.model.compiled_elementwise
        enc.model.compiled_min_rows = 0
        out = enc.embed(seqs)
    assert cosine(out, ref).min() >= 0.999


def test_small_forwards_run_the_eager_ops(checkpoint):
    # Below compiled_min_rows computed rows a compiled call's fixed cost outweighs its gain.
    ran = []
    with Encoder.from_pretrained(
        checkpoint("qwen3"), dtype="bfloat16", compile_elementwise=True
    ) as enc:
        assert enc.model.compiled_elementwise and enc.model.compiled_min_rows == 512
        enc.model.compiled_min_rows = 40
        eager = ELEMENTWISE._eager["rms_norm"]
        enc.model.norm.register_forward_pre_hook(
            lambda module, args: ran.append(ELEMENTWISE.rms_norm is eager)
        )
        small, large = random_sequences([20], seed=6), random_sequences([30, 30], seed=7)
        enc.embed(small)
        enc.embed(large)
    assert ran == [True, False]


def test_compiled_ops_stay_inside_the_models_that_chose_them():
    x, w = torch.randn(4, 8), torch.ones(8)
    assert ELEMENTWISE.rms_norm.__name__ == "rms_norm_eager"  # outside any forward
    if ELEMENTWISE.ensure_compiled(lambda: ELEMENTWISE.rms_norm(x, w, 1e-6)):
        with ELEMENTWISE.enabled(True):
            assert ELEMENTWISE.rms_norm is not ELEMENTWISE._eager["rms_norm"]
            torch.testing.assert_close(
                ELEMENTWISE.rms_norm(x, w, 1e-6), ELEMENTWISE._eager["rms_norm"](x, w, 1e-6)
            )
    assert ELEMENTWISE.rms_norm.__name__ == "rms_norm_eager"


def test_failed_compile_runs_eagerly():
    def formula(x):
        raise RuntimeError("no C++ compiler here")

    ops = CompiledSet(
        "test ops", {"f": formula}, {"f": lambda x: x + 1}, warmup=lambda: ops.f(torch.ones(2))
    )
    assert ops.ensure_compiled() is False and ops.compiled is False
    assert torch.equal(ops.f(torch.ones(2)), torch.full((2,), 2.0))
    assert ops.ensure_compiled() is False  # decided once
    with pytest.raises(AttributeError):
        ops.g  # noqa: B018


def test_route_says_eager_when_compiling_failed(checkpoint, monkeypatch):
    monkeypatch.setattr(ELEMENTWISE, "ensure_compiled", lambda warmup=None: False)
    with Encoder.from_pretrained(
        checkpoint("qwen3"), dtype="bfloat16", compile_elementwise=True
    ) as enc:
        assert not enc.model.compiled_elementwise
        assert enc.route.elementwise.startswith("eager (compiling failed")


def test_compiling_happens_at_load_not_in_requests(checkpoint):
    # Each compile costs ~0.1-3 s: the warm-up at load must meet every shape class the first
    # requests do (one token, many rows, shared prefixes in the batch and from the cache).
    from torch._dynamo.utils import counters

    prefix = random_sequences([12], seed=9)[0]
    batches = [
        [prefix + s for s in random_sequences([3, 1, 7], seed=1)],  # shared in batch
        [prefix + [5]],
        [prefix + [6, 7], prefix + [8, 9, 10]],  # from the cache
        [[11]],
        random_sequences([1, 17, 90], seed=2),
    ]
    with Encoder.from_pretrained(
        checkpoint("qwen3"), dtype="bfloat16", compile_elementwise=True
    ) as enc:
        assert enc.model.compiled_elementwise
        enc.model.compiled_min_rows = 0  # every request through the compiled ops
        compiled = counters["frames"]["ok"]
        for seqs in batches:
            enc.embed(seqs)
        assert enc.prefix_cache.hits >= 3  # the cache path really ran
    assert counters["frames"]["ok"] == compiled
