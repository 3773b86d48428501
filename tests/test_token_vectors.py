"""Per-token vectors (`Encoder.embed_tokens`): the final hidden states of every token, for late
interaction (MaxSim) and a client's own pooling, against transformers' `last_hidden_state`
on the same ids (cosine >= 0.9999 per token in fp32). They are computed by forwards that skip
nothing (no shared prefix, no pruned last layer) and leave the pooled vectors' bits alone."""

import numpy as np
import pytest
import torch

from qwen_embed import Encoder

from reference import _CLASSES, cosine, random_sequences

MIN_COSINE = 0.9999


def last_hidden_states(model_dir, sequences) -> list[np.ndarray]:
    family = "qwen3" if "qwen3" in (model_dir / "config.json").read_text() else "qwen2"
    model = _CLASSES[family][2].from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [
            model(input_ids=torch.tensor([list(s)])).last_hidden_state[0].numpy() for s in sequences
        ]


@pytest.mark.parametrize("name", ["qwen3", "gte_qwen2"])  # causal, bidirectional
def test_token_vectors_are_the_last_hidden_states(checkpoint, name):
    seqs = random_sequences([5, 40, 17, 1])
    reference = last_hidden_states(checkpoint(name), seqs)
    # a budget that splits the texts over forwards: each keeps its own rows, in order
    with Encoder.from_pretrained(checkpoint(name), dtype="float32", max_batch_tokens=48) as enc:
        raw = enc.embed_tokens(seqs, normalize=False)
        cut = enc.embed_tokens(seqs, dimensions=16)
        assert enc.stats["forwards"] == 4  # two calls of two forwards: 40 | 17 + 5 + 1
    for got, want, short in zip(raw, reference, cut, strict=True):
        assert got.shape == want.shape
        assert cosine(got, want).min() >= MIN_COSINE
        assert np.abs(got - want).max() <= 1e-3
        assert short.shape == (len(want), 16)
        assert np.allclose(np.linalg.norm(short, axis=1), 1, atol=1e-5)
        assert cosine(short, want[:, :16]).min() >= MIN_COSINE


def test_every_row_is_computed_and_pooled_vectors_keep_their_bits(checkpoint):
    """With prefix reuse and last-layer pruning on, token forwards compute every token of
    texts that share a prefix, and the pooled vectors before and after are the same bits."""
    prefix = list(range(100, 140))
    seqs = [prefix + [7, 8, 9], prefix + [10, 11], prefix + [12]]
    reference = last_hidden_states(checkpoint("qwen3"), seqs)
    with Encoder.from_pretrained(checkpoint("qwen3"), dtype="float32", prefix_reuse="on") as enc:
        assert enc.route.prune and enc.route.prefix_reuse
        before = enc.embed(seqs)
        computed = enc.stats["computed_tokens"]
        tokens = enc.embed_tokens(seqs, normalize=False)
        assert enc.stats["computed_tokens"] - computed == sum(len(s) for s in seqs)
        after = enc.embed(seqs)
    assert np.array_equal(before, after)
    for got, want in zip(tokens, reference, strict=True):
        assert cosine(got, want).min() >= MIN_COSINE


def test_bad_dimensions_are_refused(checkpoint):
    with Encoder.from_pretrained(checkpoint("qwen3"), dtype="float32") as enc:
        with pytest.raises(ValueError, match=r"dimensions must be an integer in 1\.\.96"):
            enc.embed_tokens([[1, 2]], dimensions=97)


@pytest.mark.server
def test_token_vectors_under_tensor_parallelism(checkpoint):
    seqs = random_sequences([9, 30])
    reference = last_hidden_states(checkpoint("qwen3"), seqs)
    with Encoder.from_pretrained(checkpoint("qwen3"), dtype="float32", tp_size=2) as enc:
        tokens = enc.embed_tokens(seqs, normalize=False)
        pooled = enc.embed(seqs)  # the workers follow a normal forward after a token one
    for got, want in zip(tokens, reference, strict=True):
        assert cosine(got, want).min() >= MIN_COSINE
    assert cosine(pooled, np.stack([r[-1] for r in reference])).min() >= MIN_COSINE
