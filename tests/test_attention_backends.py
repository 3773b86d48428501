"""Backend registry; GPU backends fail clearly on CPU and are checked on a GPU when present."""

import pytest
import torch

from qwen_embed import Encoder
from qwen_embed.attention import AttentionSpec, available_backends, create_backend

from reference import cosine, random_sequences, reference_embeddings

CPU_SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, causal=True,
                         device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_registry_names():
    assert available_backends() == ["flash_attn", "flashinfer", "torch"]
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        create_backend("nope", CPU_SPEC)


@pytest.mark.parametrize("name", ["flash_attn", "flashinfer"])
def test_gpu_backend_on_cpu_is_a_clear_error(checkpoint, name):
    with pytest.raises(RuntimeError, match=f"'{name}' runs only on CUDA"):
        Encoder.from_pretrained(checkpoint("qwen3"), attn_backend=name, device="cpu")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", ["flash_attn", "flashinfer"])
@pytest.mark.parametrize("config_name", ["qwen2", "qwen3", "gte_qwen2"])
def test_gpu_backend_bf16_matches_transformers(checkpoint, name, config_name):
    pytest.importorskip("flash_attn" if name == "flash_attn" else "flashinfer")
    seqs = random_sequences([1, 17, 90, 300], seed=12)
    ref = reference_embeddings(checkpoint(config_name), seqs)
    with Encoder.from_pretrained(checkpoint(config_name), attn_backend=name, dtype="bfloat16",
                                 device="cuda") as enc:  # fmt: skip
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
