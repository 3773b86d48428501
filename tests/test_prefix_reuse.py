"""Shared-prefix reuse and last-layer pruning (segments.py) against transformers on the full
sequences, and reuse on vs off (max-abs <= 1e-5 in fp32).

The model is a tiny Qwen3-Embedding replica with the real Qwen tokenizer, so the prompts are
real token ids (the default instruction is ~20 tokens).
"""

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from qwen_embed import Encoder
from qwen_embed_client.contract import DEFAULT_TASK

from reference import (
    cosine,
    make_checkpoint,
    model_card_pairs,
    reference_embeddings,
    reference_scores,
)
from replicas import qwen3_embedding

FP32_COSINE = 0.99999
ON_OFF_MAX_ABS = 1e-5
QUERY = f"Instruct: {DEFAULT_TASK}\nQuery:"
QUERIES = [
    "what is the capital of China?",
    "how tall is Mount Everest",
    "x",
    "=5 and :=",
    "best pizza near me 🍕",
    "define entropy in thermodynamics and information theory",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return qwen3_embedding(tmp_path_factory.mktemp("prefix") / "Qwen3-Embedding-0.6B")


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def ids(tok, texts, prompt=""):
    return [e.ids for e in tok.encode_batch([prompt + t for t in texts])]


def embed(model_dir, seqs, *, calls=None, **kwargs):
    """Vectors (with reuse unless told otherwise), plus the encoder's token and cache stats."""
    kwargs.setdefault("dtype", "float32")
    with Encoder.from_pretrained(model_dir, **kwargs) as enc:
        out = np.concatenate([enc.embed(c) for c in calls]) if calls else enc.embed(seqs)
        cache = enc.prefix_cache
        return out, dict(
            enc.stats,
            hits=cache.hits,
            entries=len(cache.entries),
            evictions=cache.evictions,
            cached_tokens=cache.tokens,
        )


def check(model_dir, seqs, **kwargs):
    """Reuse on equals transformers and reuse off; returns the stats with reuse on."""
    on, stats = embed(model_dir, seqs, **kwargs)
    off, off_stats = embed(model_dir, seqs, **{**kwargs, "prefix_reuse": False})
    assert off_stats["computed_tokens"] == off_stats["received_tokens"]
    assert np.abs(on - off).max() <= ON_OFF_MAX_ABS
    assert cosine(on, reference_embeddings(model_dir, seqs)).min() >= FP32_COSINE
    return stats


def test_default_instruction_queries_share_it(model_dir, tok):
    seqs = ids(tok, QUERIES, QUERY)
    stats = check(model_dir, seqs)
    prompt_len = len(tok.encode(QUERY, add_special_tokens=False).ids)
    assert stats["computed_tokens"] <= stats["received_tokens"] - (len(seqs) - 1) * (prompt_len - 1)


def test_custom_instructions_and_mixed_batches(model_dir, tok):
    a = ids(tok, QUERIES[:3], "Instruct: Find the city\nQuery:")
    b = ids(tok, QUERIES[3:], "Instruct: Classify the topic of the question\nQuery:")
    plain = ids(tok, ["no prompt here at all", "another text without one"])
    stats = check(model_dir, a + plain + b)  # two different prefixes, and sequences with none
    assert stats["computed_tokens"] < stats["received_tokens"]


def test_prefix_edge_cases(model_dir, tok):
    prompt = ids(tok, [""], QUERY)[0]  # the prompt alone (with its <|endoftext|>)
    whole = tok.encode(QUERY + "the rest", add_special_tokens=False).ids
    seqs = [
        prompt,  # equal to the shared part plus its last token
        whole,  # shares everything but the tail, no EOS
        whole[:9],  # shorter than the others' common prefix
        ids(tok, [":= merges with the colon"], QUERY)[0],  # BPE across the prompt boundary
    ]
    check(model_dir, seqs)


def test_cache_hits_across_calls_and_eviction(model_dir, tok):
    seqs = ids(tok, QUERIES, QUERY)
    calls = [[s] for s in seqs]  # one-query requests, one at a time
    on, stats = embed(model_dir, seqs, calls=calls)
    # The second call discovers the prefix, the rest hit (one may merge its first token with
    # the prompt's last and discover a shorter prefix instead).
    assert stats["hits"] >= len(seqs) - 3
    assert stats["computed_tokens"] < stats["received_tokens"]
    assert cosine(on, reference_embeddings(model_dir, seqs)).min() >= FP32_COSINE
    # A cache too small for any prefix: nothing kept, nothing hit, same vectors.
    tiny, tiny_stats = embed(model_dir, seqs, calls=calls, prefix_cache_mb=1e-6)
    assert tiny_stats["hits"] == 0 and tiny_stats["entries"] == 0
    assert np.abs(tiny - on).max() <= ON_OFF_MAX_ABS
    # Room for 22 tokens: the ~20-token default prompt and the other one evict each other.
    other = ids(tok, QUERIES, "Instruct: Find the city\nQuery:")
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head_dim x fp32 bytes
    alternating = [[s] for pair in zip(seqs, other, strict=True) for s in pair]
    out, stats = embed(model_dir, None, calls=alternating, prefix_cache_mb=22 * per_token / 2**20)
    assert stats["evictions"] > 0 and stats["cached_tokens"] <= 22
    flat = [s for pair in zip(seqs, other, strict=True) for s in pair]
    assert cosine(out, reference_embeddings(model_dir, flat)).min() >= FP32_COSINE


def test_a_long_shared_prefix_is_found_across_calls(model_dir):
    # A prefix longer than any fixed history window (600 tokens) must still be told from a
    # repeated text, and be cached after the second one-text call.
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, 151643, 600).tolist()
    seqs = [prefix + rng.integers(0, 151643, n).tolist() for n in (3, 7, 2, 9, 4)]
    on, stats = embed(model_dir, seqs, calls=[[s] for s in seqs])
    assert stats["hits"] >= len(seqs) - 2 and stats["cached_tokens"] >= 600
    off, _ = embed(model_dir, seqs, prefix_reuse=False)
    assert np.abs(on - off).max() <= ON_OFF_MAX_ABS


@pytest.mark.server
def test_tensor_parallel_ranks_agree(model_dir, tok):
    seqs = ids(tok, QUERIES, QUERY)
    calls = [seqs[:3], [seqs[3]], seqs[4:]]  # in-batch sharing, then cache hits on both ranks
    tp2, stats = embed(model_dir, seqs, calls=calls, tp_size=2)
    assert stats["hits"] >= 3
    assert cosine(tp2, reference_embeddings(model_dir, seqs)).min() >= FP32_COSINE


def test_bf16(model_dir, tok):
    seqs = ids(tok, QUERIES, QUERY)
    out, stats = embed(model_dir, seqs, dtype="bfloat16")
    assert stats["computed_tokens"] < stats["received_tokens"]
    ref = reference_embeddings(model_dir, seqs, dtype=torch.bfloat16)
    assert cosine(out, ref).min() >= 0.999


@pytest.mark.server  # whole-model runs: seconds each
def test_reranker_template_is_shared(reranker):
    """Pairs of one query share the whole template up to the document."""
    pairs = model_card_pairs(
        reranker, "capital of China?", ["Beijing.", "Paris.", "Gravity."], instruction=DEFAULT_TASK
    )
    with Encoder.from_pretrained(reranker, task="rerank", dtype="float32") as enc:
        scores = enc.score(pairs)
        assert enc.stats["computed_tokens"] < enc.stats["received_tokens"] / 2
    assert np.abs(scores - reference_scores(reranker, pairs)).max() <= 1e-4


def test_bidirectional_and_mean_pooling_never_share(checkpoint, model_dir, tok):
    seqs = [[7] * 12 + [i] for i in range(1, 5)]  # a 12-token common prefix
    for directory, kwargs in [(checkpoint("gte_qwen2"), {}), (model_dir, {"pooling": "mean"})]:
        out, stats = embed(directory, seqs, **kwargs)
        assert stats["computed_tokens"] == stats["received_tokens"]
        pooling = kwargs.get("pooling", "last")
        ref = reference_embeddings(directory, seqs, pooling=pooling)
        assert cosine(out, ref).min() >= FP32_COSINE
        with pytest.raises(ValueError, match="prefix_reuse needs causal attention and last"):
            Encoder.from_pretrained(directory, prefix_reuse=True, **kwargs)


def test_last_layer_pruning_alone(tmp_path):
    """One layer: pruning is all of the model's work beyond keys/values."""
    one = make_checkpoint(tmp_path / "one", "qwen2")
    seqs = [[5, 6, 7], list(range(1, 90)), [9]]
    out, _ = embed(one, seqs, prefix_reuse=False)
    assert cosine(out, reference_embeddings(one, seqs)).min() >= FP32_COSINE
    # Its queries are projected for the pooled rows only; the mean-pooling model keeps q|k|v.
    with Encoder.from_pretrained(one, dtype="float32", prefix_reuse=False) as enc:
        attn = enc.model.layers[-1].self_attn
        assert attn.qkv_proj is None and attn.q_proj.weight is None  # packed for oneDNN
        kv = 2 * attn.num_kv_heads * attn.head_dim
        assert attn.q_proj.kernel.out_features == attn.num_heads * attn.head_dim
        assert attn.kv_proj.kernel.out_features == kv and attn.kv_proj.bias.shape == (kv,)
        assert all(layer.self_attn.qkv_proj is not None for layer in enc.model.layers[:-1])
        rows = {}
        for name in ("q", "kv"):  # rows each projection computes (the hooks return None)
            getattr(attn, f"{name}_proj").register_forward_pre_hook(
                lambda m, args, name=name: rows.update({name: len(args[0])})
            )
        enc.embed(seqs)
        assert rows == {"q": len(seqs), "kv": sum(map(len, seqs))}
    with Encoder.from_pretrained(one, dtype="float32", pooling="mean") as enc:
        assert enc.model.layers[-1].self_attn.qkv_proj is not None


def test_split_packed_shards():
    from qwen_embed.layers import ColumnParallelLinear, TPGroup

    fused = ColumnParallelLinear(8, {"q": 6, "k": 2, "v": 2}, TPGroup(), bias=True)
    torch.nn.init.normal_(fused.weight)
    torch.nn.init.normal_(fused.bias)
    x = torch.randn(5, 8)
    q, kv = fused.split(("q",), ("k", "v"))
    torch.testing.assert_close(torch.cat([q(x), kv(x)], dim=-1), fused(x))
    with pytest.raises(ValueError, match="not consecutive"):
        fused.split(("q", "v"))
