"""CUDA graphs over token buckets (qwen_embed/cuda_graphs.py): a forward through the captured
stretches gives the eager forward's vectors, whatever the batch's sequences, bucket padding,
pruning or shared prefixes.

On CPU the capture runs each stretch as it is, which checks the static buffers' plumbing (views
of the largest bucket, stale padding rows, eager attention between stretches, the pruned last
layer, shared prefixes) with the real model; tests marked `gpu` capture real graphs and count
what the host launches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwen_embed import Encoder
from qwen_embed.chunking import ChunkedText
from qwen_embed.cpu import cpu_features
from qwen_embed.cuda_graphs import BUCKETS, TokenGraphs, buckets_up_to
from qwen_embed.settings import MAX_GRAPH_TOKENS, EncoderSettings
from qwen_embed_deploy.demo import build_demo_adapter

from reference import cosine, random_sequences, reference_embeddings, route_for


def _run_as_is(fn):
    return fn


def _graphed(enc: Encoder, buckets) -> TokenGraphs:
    enc.model.graphs = TokenGraphs(enc.model, buckets, _run_as_is)
    return enc.model.graphs


def _same(graphed: np.ndarray, eager: np.ndarray) -> None:
    # A bucket's padding changes the GEMMs' row count, which may change their blocking: the
    # same vectors to fp32 rounding, not bitwise.
    assert graphed.shape == eager.shape
    assert cosine(graphed, eager).min() >= 0.999999
    np.testing.assert_allclose(graphed, eager, atol=2e-5)


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
@pytest.mark.parametrize("pooling", ["last", "mean"])  # last prunes the last layer; mean not
def test_batches_through_the_buckets_equal_the_eager_forward(checkpoint, name, pooling):
    batches = [
        random_sequences([5, 30, 11], seed=1),  # 46 rows: the 64 bucket
        random_sequences([3], seed=2),  # 3 rows after 46: stale rows past them
        random_sequences([60, 60, 60, 60, 60], seed=3),  # 300 rows: more than the largest
    ]
    with Encoder.from_pretrained(checkpoint(name), dtype="float32", pooling=pooling) as enc:
        assert enc.route.prune == (pooling == "last")
        eager = [enc.embed(seqs) for seqs in batches]
        graphs = _graphed(enc, [16, 64, 128])
        graphed = [enc.embed(seqs) for seqs in batches]
    assert graphs.replays == 2  # the 300-row batch ran eagerly
    for g, e in zip(graphed, eager, strict=True):
        _same(g, e)
    ref = reference_embeddings(checkpoint(name), batches[0], pooling=pooling)
    assert cosine(graphed[0], ref).min() >= 0.99999


def test_shared_prefixes_under_graphs(checkpoint):
    """Prefix reuse: attention reads the cached prefix's keys beside the graphs' rows."""
    prefix = random_sequences([24], seed=4)[0]
    tails = random_sequences([6, 9, 4], seed=5)
    first = [prefix + t for t in tails[:2]]
    second = [prefix + tails[2], tails[1]]  # the prefix from the cache
    with Encoder.from_pretrained(checkpoint("qwen3"), dtype="float32") as enc:
        assert enc.route.prefix_reuse
        eager = [enc.embed(first), enc.embed(second)]
        cached = enc.prefix_cache.hits
        graphs = _graphed(enc, [32, 64])
        graphed = [enc.embed(first), enc.embed(second)]
        assert enc.prefix_cache.hits > cached
        assert enc.stats["computed_tokens"] < enc.stats["received_tokens"]
    assert graphs.replays == 2
    for g, e in zip(graphed, eager, strict=True):
        _same(g, e)


@pytest.mark.server  # a reranker replica's build and two engines: seconds
def test_late_chunks_and_rerank_scores_under_graphs(checkpoint, reranker):
    """Late chunking's read-out rows and a reranker's last-token scores through the graphs."""
    body = random_sequences([70], seed=6)[0]
    text = ChunkedText(np.array(body + [1]), np.array([(0, 30), (30, 70), (5, 9)]), tail=1)
    pairs = random_sequences([12, 40, 25], vocab_size=1000, seed=7)
    with Encoder.from_pretrained(checkpoint("qwen3"), dtype="float32") as enc:
        (eager,) = enc.embed_chunks([text])
        graphs = _graphed(enc, [64, 128])
        (graphed,) = enc.embed_chunks([text])
    assert graphs.replays >= 1
    _same(graphed, eager)
    with Encoder.from_pretrained(reranker, dtype="float32", task="rerank") as enc:
        eager = enc.score(pairs)
        graphs = _graphed(enc, [64, 128])
        graphed = enc.score(pairs)
    assert graphs.replays == 1
    np.testing.assert_allclose(graphed, eager, atol=1e-5)


def test_buckets():
    assert buckets_up_to(0) == []
    assert buckets_up_to(100) == [16, 32, 64, 100]  # the setting is the largest
    assert buckets_up_to(8192)[-1] == 8192 and buckets_up_to(16384)[-2:] == [12288, 16384]
    assert BUCKETS[-1] == MAX_GRAPH_TOKENS
    for tokens in (17, 100, 8192, 10000, 16384, MAX_GRAPH_TOKENS):
        steps = buckets_up_to(tokens)
        assert all(b / a <= 2 for a, b in zip(steps, steps[1:], strict=False)), tokens
    with pytest.raises(ValueError, match="cuda_graph_tokens must be <= 65536"):
        EncoderSettings(cuda_graph_tokens=MAX_GRAPH_TOKENS + 1)


def test_the_route_takes_graphs_on_a_single_gpu_only():
    features = cpu_features()
    assert route_for(features, device="cpu").cuda_graph_tokens == 0
    gpu = route_for(features, device="cuda:0")
    assert gpu.cuda_graph_tokens == 8192 and "CUDA graphs up to 8192 tokens" in gpu.describe()
    assert route_for(features, device="cuda:0", cuda_graph_tokens=0).cuda_graph_tokens == 0
    assert route_for(features, device="cuda:0", tp_size=2).cuda_graph_tokens == 0
    with pytest.raises(ValueError, match="cuda_graph_tokens must be >= 0"):
        route_for(features, device="cuda:0", cuda_graph_tokens=-1)


GPU = pytest.mark.gpu


def _host_launches(enc: Encoder, seqs) -> dict[str, int]:
    """What the host launched for one embed() after a warm-up: kernels and graphs."""
    from torch.profiler import ProfilerActivity, profile

    enc.embed(seqs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        enc.embed(seqs)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]  # the runtime/driver calls the host made
    return {
        "kernels": sum(n.startswith(("cudaLaunchKernel", "cuLaunchKernel")) for n in names),
        "graphs": sum(n.startswith("cudaGraphLaunch") for n in names),
    }


def _cuda_encoders(checkpoint, pooling: str):
    """The same 4-layer bf16 model eager and with graphs, on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    model_dir = checkpoint("qwen3_head128_4layers")
    for tokens in (0, 8192):
        with Encoder.from_pretrained(
            model_dir, dtype="bfloat16", device="cuda:0", pooling=pooling, cuda_graph_tokens=tokens
        ) as enc:
            yield tokens, enc


SEQS = random_sequences([40, 100, 7, 300], seed=1)  # 447 rows: the 512 bucket


@GPU
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_captured_graphs_give_the_eager_vectors(checkpoint, pooling):
    """Real graphs (bf16: a bucket's padding may pick other GEMM kernels than the eager row
    count, so not bitwise)."""
    out = {}
    for tokens, enc in _cuda_encoders(checkpoint, pooling):
        out[tokens] = [enc.embed(SEQS), enc.embed(SEQS[:2]), enc.embed(SEQS[2:3])]
        if tokens:
            assert enc.model.graphs.replays == 3
    for graphed, eager in zip(out[8192], out[0], strict=True):
        assert cosine(graphed, eager).min() >= 0.999


@GPU
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_graphs_leave_few_launches_to_the_host(checkpoint, pooling):
    """One graph per stretch between attentions (the pruned last layer eager), each in place
    of at least five kernel launches."""
    launches = {
        tokens: _host_launches(enc, SEQS) for tokens, enc in _cuda_encoders(checkpoint, pooling)
    }
    print(f"host launches per embed(): {launches}")
    layers = 4
    assert launches[8192]["graphs"] == (layers - 1 if pooling == "last" else layers + 1)
    assert launches[0]["graphs"] == 0
    assert launches[8192]["kernels"] <= launches[0]["kernels"] - 5 * launches[8192]["graphs"]


@pytest.mark.gpu
def test_adapters_on_a_gpu_beside_its_cuda_graphs(checkpoint, tmp_path):
    """On one GPU an encoder keeping adapters (lora_modules) replays the base's graphs for a
    call naming none and runs an adapter's forwards eagerly, turn about: the adapter's vectors
    are the same fine-tune's merged (bf16, cosine >= 0.999), the base's the plain encoder's;
    one call naming the adapter for every other text alike."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    base = checkpoint("qwen3_head128_4layers")
    adapter = build_demo_adapter(tmp_path / "adapter", base, rank=8, seed=3)
    seqs = random_sequences([5, 17, 40, 3, 300], seed=4)
    settings = {"dtype": "bfloat16", "device": "cuda:0"}
    with Encoder.from_pretrained(base, lora_modules=f"x={adapter}", **settings) as enc:
        assert enc.route.cuda_graph_tokens > 0
        got = [enc.embed(seqs, adapter=a) for a in ("x", None, "x", None)]
        names = ["x", None] * 2 + ["x"]
        mixed = enc.embed(seqs, adapter=names)
    with Encoder.from_pretrained(adapter, **settings) as enc:  # the fine-tune, merged
        merged = enc.embed(seqs)
    with Encoder.from_pretrained(base, **settings) as enc:
        plain = enc.embed(seqs)
    for unmerged, own in zip(got[0::2], got[1::2], strict=True):
        assert cosine(unmerged, merged).min() >= 0.999
        assert cosine(own, plain).min() >= 0.9999
    assert cosine(got[0], plain).max() < 0.99  # the adapter matters
    for i, name in enumerate(names):
        want = (merged if name else plain)[i : i + 1]
        assert cosine(mixed[i : i + 1], want).min() >= (0.999 if name else 0.9999), (i, name)
