"""Backend registry; GPU backends fail clearly on CPU and are checked on a GPU when present."""

import numpy as np
import pytest
import torch

from qwen_embed import Encoder, native
from qwen_embed.attention import (
    VARLEN_REASON,
    AttentionSpec,
    available_backends,
    choose_backend,
    create_backend,
)
from qwen_embed.attention.native_cpu import AUTO_ISAS
from qwen_embed.attention.torch_varlen import (
    KEYWORDS,
    flash_problem,
    kernel_keywords,
    varlen_problem,
)
from qwen_embed.engine import check_gpu_group
from qwen_embed_deploy.serving.config import encoder_device

from reference import cosine, random_sequences, reference_embeddings

CPU_SPEC = AttentionSpec(
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    causal=True,
    device=torch.device("cpu"),
    dtype=torch.float32,
)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_registry_names():
    assert available_backends() == ["flash_attn", "flashinfer", "native", "torch"]
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        create_backend("nope", CPU_SPEC)


@pytest.mark.parametrize("name", ["flash_attn", "flashinfer"])
def test_gpu_backend_on_cpu_is_a_clear_error(checkpoint, name):
    with pytest.raises(RuntimeError, match=f"'{name}' runs only on CUDA"):
        create_backend(name, AttentionSpec(4, 2, 128, True, torch.device("cpu"), torch.bfloat16))
    with pytest.raises((RuntimeError, ValueError), match=f"'{name}'"):
        Encoder.from_pretrained(checkpoint("qwen3"), attn_backend=name, device="cpu")


@pytest.mark.parametrize("head_dim", [8, 16, 32, 64, 96, 512])
def test_flashinfer_refuses_head_sizes_without_kernels(head_dim):
    """64 included: the prebuilt wheels ship 128 and 256 only (a head-64 model such as
    Qwen2-0.5B would JIT-compile at its first request)."""
    spec = AttentionSpec(4, 2, head_dim, True, torch.device("cuda", 0), torch.bfloat16)
    with pytest.raises(ValueError, match=f"head sizes \\(128, 256\\), not {head_dim}"):
        create_backend("flashinfer", spec)


def test_auto_backend_choice():
    def choose(device, head_dim, *installed, dtype="bfloat16", capability=(9, 0)):
        return choose_backend(
            device,
            head_dim,
            dtype=dtype,
            import_problem=lambda m: None if m in installed else f"no {m}",
            gpu_problem=lambda *a: varlen_problem(*a, lambda d: capability, lambda: KEYWORDS),
            flash_attn_problem=lambda *a: flash_problem(*a, lambda d: capability),
        )

    assert choose("cpu", 128, "flash_attn")[0] in ("native", "torch")
    assert choose("cuda:1", 128, "flash_attn", "flashinfer")[0] == "flash_attn"
    assert choose("cuda", 64, "flash_attn")[0] == "flash_attn"
    # Nothing beyond PyPI's torch: its varlen FlashAttention, one call per layer. flashinfer
    # only by name.
    for head_dim in (64, 128):
        name, reason = choose("cuda", head_dim, "flashinfer")
        assert (name, reason) == ("torch", VARLEN_REASON)
    # Where that cannot run: the per-segment loop, saying why.
    name, reason = choose("cuda", 128, capability=(7, 5))
    assert name == "torch" and "per segment" in reason and "7.5" in reason
    name, reason = choose("cuda", 100)
    assert name == "torch" and "multiples of 8, not 100" in reason
    name, reason = choose("cuda", 128, "flash_attn", dtype="float32")  # a reference run
    assert name == "torch" and "not float32" in reason
    # flash-attn installed where its kernels cannot run (flash_api.cpp refuses them at the
    # first call): a T4 (sm75), or a head size above 256, goes to torch instead.
    name, reason = choose("cuda", 128, "flash_attn", capability=(7, 5))
    assert name == "torch" and "7.5" in reason
    assert choose("cuda", 512, "flash_attn")[0] == "torch"
    assert choose("cuda", 128, "flash_attn", capability=(8, 0))[0] == "flash_attn"


def test_flash_problem_states_the_kernels_limits():
    def problem(dtype="bfloat16", head_dim=128, capability=(8, 6), device="cuda:0"):
        return flash_problem(device, dtype, head_dim, lambda d: capability)

    assert problem() is None and problem(dtype="float16", head_dim=256) is None
    assert "compute capability 8.0+" in problem(capability=(7, 5))
    assert "not 264" in problem(head_dim=264) and "not 100" in problem(head_dim=100)
    assert "not float32" in problem(dtype="float32")
    assert "CUDA only" in problem(device="cpu")


# aten::_flash_attention_forward's keywords in torch 2.5.1 (native_functions.yaml); 2.13 adds
# block_table and num_splits.
KEYWORDS_2_5 = frozenset(
    {"scale", "window_size_left", "window_size_right", "seqused_k", "alibi_slopes"}
)


def test_varlen_problem():
    def problem(
        device="cuda:0", dtype="bfloat16", head_dim=128, capability=(8, 0), keywords=KEYWORDS_2_5
    ):
        return varlen_problem(device, dtype, head_dim, lambda d: capability, lambda: keywords)

    assert problem() is None and problem(dtype="float16", head_dim=256) is None
    assert "CUDA only" in problem(device="cpu")
    assert "not float32" in problem(dtype="float32")
    assert "not 512" in problem(head_dim=512)
    assert "8.0+" in problem(capability=(7, 5))
    assert "no aten::_flash_attention_forward" in problem(keywords=None)
    # An operator without sliding windows: the per-segment SDPA loop instead
    assert "takes no window_size_left, window_size_right" in problem(keywords={"scale"})
    # This torch has it (2.13): on a GPU the torch backend needs no attention wheel.
    assert KEYWORDS_2_5 <= kernel_keywords()
    assert varlen_problem("cuda", "bfloat16", 128, lambda d: (9, 0)) is None


def test_import_problem_imports_rather_than_finds():
    """A module that is found but fails at import (a wheel built for another torch) is not
    installed as far as auto is concerned."""
    from qwen_embed.attention import _import_problem

    assert _import_problem("json") is None
    assert "does not import" in _import_problem("qwen_embed_no_such_module")


def test_encoder_reports_auto_attention(checkpoint):
    with Encoder.from_pretrained(checkpoint("qwen3"), device="cpu") as enc:
        assert enc.route.attn_backend == ("native" if native.isa() in AUTO_ISAS else "torch")
        assert enc.route.attention_reason.startswith("auto")
    with Encoder.from_pretrained(checkpoint("qwen2"), device="cpu") as enc:  # head size 8
        assert enc.route.attn_backend == "torch"
        assert "head size 8" in enc.route.attention_reason or not native.isa()


def test_instance_kinds_and_device_groups():
    assert encoder_device("CPU", "0", "auto", 1, has_cuda=True) == "cpu"  # KIND_CPU means CPU
    assert encoder_device("GPU", "3", "auto", 1, has_cuda=True) == "cuda:3"
    assert encoder_device("MODEL", "0", "auto", 2, has_cuda=True) == "cuda:0"
    assert encoder_device("MODEL", "0", "auto", 1, has_cuda=False) == "cpu"
    assert encoder_device("MODEL", "0", "cuda:2", 2, has_cuda=True) == "cuda:2"
    with pytest.raises(ValueError, match="KIND_GPU with tp_size=2"):
        encoder_device("GPU", "1", "auto", 2, has_cuda=True)
    check_gpu_group(2, 2, 4)
    with pytest.raises(ValueError, match="needs GPUs 3..4, but this machine has 4"):
        check_gpu_group(3, 2, 4)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", ["torch", "flash_attn", "flashinfer"])
@pytest.mark.parametrize("config_name", ["qwen3_head64", "qwen3_head128"])
def test_gpu_backend_bf16_matches_transformers(checkpoint, name, config_name):
    if name != "torch":
        pytest.importorskip(name)
    if name == "flashinfer" and config_name == "qwen3_head64":
        pytest.skip("no prebuilt flashinfer kernels for head size 64 (flashinfer_limits.py)")
    seqs = random_sequences([1, 17, 90, 300], seed=12)
    ref = reference_embeddings(checkpoint(config_name), seqs)
    with Encoder.from_pretrained(
        checkpoint(config_name), attn_backend=name, dtype="bfloat16", device="cuda"
    ) as enc:
        out = enc.embed(seqs)
    assert cosine(out, ref).min() >= 0.999


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", ["torch", "flash_attn", "flashinfer"])
def test_gpu_prefix_reuse_on_equals_off(checkpoint, name):
    """Each GPU backend with a cached shared prefix (queries fewer than keys, a one-token tail:
    one-query rows, GQA) against the same texts computed whole. bf16 kernels sum in another
    order for another layout, so the bound is a cosine, not bitwise."""
    if name != "torch":
        pytest.importorskip(name)
    model = checkpoint("qwen3_head128")  # GQA, a head size every backend has kernels for
    prefix = random_sequences([40], seed=31)[0]
    texts = [prefix + tail for tail in random_sequences([1, 5, 30], seed=32)]
    settings = dict(attn_backend=name, dtype="bfloat16", device="cuda")
    with Encoder.from_pretrained(model, prefix_reuse="off", **settings) as enc:
        off = enc.embed(texts)
    with Encoder.from_pretrained(model, prefix_reuse="on", **settings) as enc:
        enc.embed(texts[1:])  # the shared prefix is found and cached
        on = enc.embed(texts)
        assert enc.prefix_cache.hits >= len(texts)
    assert cosine(on, off).min() >= 0.999


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_path_equals_the_per_segment_loop(causal):
    """The torch backend's two GPU paths on every layout: causal and bidirectional, a shared
    prefix (fewer queries than keys), one query per sequence, GQA, 1-token segments."""
    from qwen_embed.segments import AttentionLayout

    device = torch.device("cuda", 0)
    spec = AttentionSpec(8, 2, 128, causal, device, torch.bfloat16)
    varlen, loop = create_backend("torch", spec), create_backend("torch", spec)
    assert varlen._varlen is not None, (
        "the varlen FlashAttention should serve a bf16 head-128 spec here"
    )
    loop._varlen = None
    gen = torch.Generator(device).manual_seed(3)
    for q_lens, k_lens in [((1, 17, 300), (1, 17, 300)), ((5, 1, 40), (70, 33, 40))]:
        layout = AttentionLayout.build(q_lens, k_lens, np.arange(sum(k_lens)), device)
        q = torch.randn(sum(q_lens), 8, 128, device=device, generator=gen, dtype=torch.bfloat16)
        k, v = (
            torch.randn(sum(k_lens), 2, 128, device=device, generator=gen, dtype=torch.bfloat16)
            for _ in range(2)
        )
        varlen.prepare(layout)
        loop.prepare(layout)
        diff = (varlen.forward(q, k, v, layout) - loop.forward(q, k, v, layout)).abs().max()
        assert diff <= 2e-2, (q_lens, k_lens, diff)


@pytest.mark.gpu
@requires_cuda
def test_torch_backend_on_gpu_fp32(checkpoint):
    seqs = random_sequences([1, 17, 90], seed=13)
    ref = reference_embeddings(checkpoint("qwen3"), seqs)
    with Encoder.from_pretrained(checkpoint("qwen3"), device="cuda", dtype="float32") as enc:
        out = enc.embed(seqs)
    assert cosine(out, ref).min() >= 0.99999
