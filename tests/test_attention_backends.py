"""Backend registry; GPU backends fail clearly on CPU and are checked on a GPU when present."""

import pytest
import torch

from qwen_embed import Encoder, native
from qwen_embed.attention import AttentionSpec, available_backends, choose_backend, create_backend
from qwen_embed.attention.native_cpu import AUTO_ISAS
from qwen_embed.engine import check_gpu_group
from qwen_embed.serving.config import encoder_device

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
    def only(*names):
        return lambda module: module in names

    def choose(device, head_dim, *names, flashinfer="0.2.5"):
        return choose_backend(device, head_dim, only(*names), lambda: flashinfer)

    assert choose("cpu", 128, "flash_attn", "flashinfer")[0] in ("native", "torch")
    assert choose("cuda", 128, "flash_attn", "flashinfer")[0] == "flash_attn"
    assert choose("cuda", 128, "flashinfer")[0] == "flashinfer"
    name, reason = choose("cuda", 32, "flashinfer")  # no kernel for 32
    assert name == "torch" and "no kernels for head size 32" in reason
    name, reason = choose("cuda", 64, "flashinfer")  # nor prebuilt for 64
    assert name == "torch" and "no kernels for head size 64" in reason
    assert choose("cuda", 64, "flash_attn", "flashinfer")[0] == "flash_attn"
    # flashinfer before 0.2.4 has no device guard: never chosen
    name, reason = choose("cuda", 128, "flashinfer", flashinfer="0.2.0.post2")
    assert name == "torch" and "current CUDA device" in reason
    name, reason = choose("cuda", 128)
    assert name == "torch" and "flashinfer is not installed" in reason and "setup-gpu" in reason
    # fp32 on a GPU (e.g. a reference run): both kernels are half precision only
    name, reason = choose_backend("cuda", 128, only("flash_attn", "flashinfer"), dtype="float32")
    assert name == "torch" and "not float32" in reason


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
@pytest.mark.parametrize("name", ["flash_attn", "flashinfer"])
@pytest.mark.parametrize("config_name", ["qwen3_head64", "qwen3_head128"])
def test_gpu_backend_bf16_matches_transformers(checkpoint, name, config_name):
    pytest.importorskip("flash_attn" if name == "flash_attn" else "flashinfer")
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
def test_torch_backend_on_gpu_fp32(checkpoint):
    seqs = random_sequences([1, 17, 90], seed=13)
    ref = reference_embeddings(checkpoint("qwen3"), seqs)
    with Encoder.from_pretrained(checkpoint("qwen3"), device="cuda", dtype="float32") as enc:
        out = enc.embed(seqs)
    assert cosine(out, ref).min() >= 0.99999
