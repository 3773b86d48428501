"""GPU-only (skipped without CUDA): a KIND_GPU encoder under a real tritonserver, and NCCL
tensor parallelism across two GPUs. Run with `make test-gpu` on a GPU machine."""

import urllib.request

import pytest
import torch
from tokenizers import Tokenizer

from qwen_embed import Encoder
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.triton import TritonServer

from reference import cosine, random_sequences, reference_embeddings
from triton_helpers import GPU_ONLY_SERIES, infer

pytestmark = [
    pytest.mark.server,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_kind_gpu_server_answers_embed(checkpoint, demo_dir, tmp_path):
    repo = render(
        tmp_path / "repo",
        {"embed": demo_dir},
        {"encoder": {"dtype": "bfloat16"}},
        encoder_instances="count: 1, kind: KIND_GPU",
    )
    texts = ["a GPU instance", "attention picked automatically", "三"]
    with TritonServer(repo, log_path=tmp_path / "server.log") as server:
        out, _ = infer(server, texts, "grpc")
        metrics = urllib.request.urlopen(server.metrics_url).read().decode()
    # the dashboard's GPU panels read series only a GPU host exports
    assert all(f"\n{name}{{" in metrics for name in GPU_ONLY_SERIES), GPU_ONLY_SERIES
    ids = [e.ids for e in Tokenizer.from_file(str(demo_dir / "tokenizer.json")).encode_batch(texts)]
    with Encoder.from_pretrained(demo_dir, dtype="float32", device="cpu") as enc:
        ref = enc.embed(ids)
    assert cosine(out, ref).min() >= 0.999
    assert "attention flash_attn" in (tmp_path / "server.log").read_text() or not _has("flash_attn")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_tp2_matches_transformers(checkpoint):
    seqs = random_sequences([1, 40, 300], seed=21)
    model = checkpoint("qwen3_head128")
    ref = reference_embeddings(model, seqs)
    with Encoder.from_pretrained(model, tp_size=2, dtype="bfloat16", device="cuda:0") as enc:
        out = enc.embed(seqs)
    assert cosine(out, ref).min() >= 0.999


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_worker_killed_mid_forward_fails_fast(checkpoint):
    """A worker killed while forwards run: rank 0 stops waiting on its GPU and says which
    rank (parallel.wait_for_device) instead of blocking until NCCL's watchdog ends it."""
    import os
    import threading

    from test_tensor_parallel import wait_no_workers, worker_pids

    from qwen_embed import EncoderBroken

    enc = Encoder.from_pretrained(
        checkpoint("qwen3_head128"), tp_size=2, dtype="bfloat16", device="cuda:0"
    )
    (pid,) = worker_pids()
    seqs = random_sequences([2000] * 8, seed=22)
    threading.Timer(0.5, os.kill, args=(pid, 9)).start()
    with pytest.raises(EncoderBroken, match="TP rank 1 exited with code -9"):
        for _ in range(10_000):
            enc.embed(seqs)
    assert wait_no_workers() == set()
    enc.close()


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
