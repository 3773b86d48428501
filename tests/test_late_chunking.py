"""Late chunking in the engine (qwen_embed.chunking) against transformers computed the same way:
causal last-token models read each chunk out as the text cut after the chunk (plus the
appended EOS), bidirectional ones average the chunk's tokens in the whole text's forward.

Tolerances as test_parity: fp32 cosine >= 0.99999 and max-abs <= 1e-4 on unit vectors."""

import numpy as np
import pytest
import torch

from qwen_embed import ChunkedText, Encoder

from reference import cosine, random_sequences, reference_embeddings

EOS = 7  # any id: the tiny replicas have no tokenizer; it stands for the appended EOS


def assert_close(out, ref):
    assert out.shape == ref.shape and out.dtype == np.float32
    assert cosine(out, ref).min() >= 0.99999
    assert float(np.abs(out - ref).max()) <= 1e-4


def hidden_states(model_dir, ids):
    """transformers' final hidden states of one sequence (float32 [T, H])."""
    name = "qwen3" if "qwen3" in (model_dir / "config.json").read_text() else "qwen2"
    from reference import _CLASSES

    model = _CLASSES[name][2].from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(ids)])).last_hidden_state[0].float()


SPANS = [(0, 40), (40, 95), (95, 160), (10, 20), (159, 160)]  # overlapping and 1-token ones too


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "qwen3_kv1"])
def test_causal_chunks_are_the_text_cut_after_them(checkpoint, name):
    model_dir = checkpoint(name)
    body = random_sequences([160], seed=3)[0]
    encoder = Encoder.from_pretrained(model_dir, dtype="float32")
    text = ChunkedText(np.array(body + [EOS]), np.array(SPANS), tail=1)
    (out,) = encoder.embed_chunks([text])
    ref = reference_embeddings(model_dir, [body[:end] + [EOS] for _, end in SPANS])
    assert_close(out, ref)
    # A chunk that ends the text is the whole text's vector.
    whole = encoder.embed([body + [EOS]])
    assert_close(out[2:3], whole)


def test_without_appended_tokens_a_chunk_is_read_at_its_last_token(checkpoint):
    model_dir = checkpoint("qwen3")
    body = random_sequences([120], seed=4)[0]
    encoder = Encoder.from_pretrained(model_dir, dtype="float32")
    (out,) = encoder.embed_chunks([ChunkedText(np.array(body), np.array(SPANS[:2]), tail=0)])
    hidden = hidden_states(model_dir, body)
    ref = torch.nn.functional.normalize(hidden[[39, 94]], dim=-1).numpy()
    assert_close(out, ref)


def test_bidirectional_chunks_average_their_tokens_in_the_whole_text(checkpoint):
    model_dir = checkpoint("gte_qwen2")
    body = random_sequences([160], seed=5)[0]
    encoder = Encoder.from_pretrained(model_dir, dtype="float32")
    (out,) = encoder.embed_chunks([ChunkedText(np.array(body + [EOS]), np.array(SPANS), tail=1)])
    hidden = hidden_states(model_dir, body + [EOS])  # every token sees the whole text
    ref = torch.stack([hidden[a:b].mean(0) for a, b in SPANS])
    assert_close(out, torch.nn.functional.normalize(ref, dim=-1).numpy())


def test_texts_in_one_forward_and_over_the_budget(checkpoint):
    """Several texts share forwards (and one over the token budget runs alone) with the same
    vectors as each alone; dimensions and normalize apply per chunk."""
    model_dir = checkpoint("qwen3")
    bodies = random_sequences([50, 300, 9], seed=6)
    texts = [
        ChunkedText(np.array(b + [EOS]), np.array([(0, len(b) // 2), (len(b) // 2, len(b))]), 1)
        for b in bodies
    ]
    encoder = Encoder.from_pretrained(model_dir, dtype="float32", max_batch_tokens=128)
    together = encoder.embed_chunks(texts, dimensions=16, normalize=False)
    for text, out in zip(texts, together, strict=True):
        (alone,) = encoder.embed_chunks([text], dimensions=16, normalize=False)
        assert out.shape == (2, 16)
        np.testing.assert_allclose(out, alone, rtol=1e-5, atol=1e-5)
    ref = reference_embeddings(model_dir, [bodies[1][:150] + [EOS]], normalize=False, dimensions=16)
    np.testing.assert_allclose(together[1][:1], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "spans, tail, message",
    [
        ([(0, 0)], 1, r"chunks\[0\]\[0\] = \(0, 0\).*0 <= start < end <= 10"),
        ([(0, 5), (3, 11)], 1, r"chunks\[0\]\[1\] = \(3, 11\).*<= 10"),
        ([(-1, 4)], 1, r"chunks\[0\]\[0\]"),
        ([], 1, "non-empty list"),
        ([(0, 3)], 11, "tail must be in 0..10"),
    ],
)
def test_bad_chunks_name_the_span_and_the_limit(checkpoint, spans, tail, message):
    encoder = Encoder.from_pretrained(checkpoint("qwen3"), dtype="float32")
    text = ChunkedText(np.arange(11), np.array(spans).reshape(-1, 2), tail)
    with pytest.raises(ValueError, match=message):
        encoder.embed_chunks([text])


def test_many_chunks_and_bf16(checkpoint):
    """More read-out rows than one dense block, in bf16 (the CPU default where it is fast)."""
    model_dir = checkpoint("qwen3")
    body = random_sequences([400], seed=8)[0]
    spans = [(i, i + 5) for i in range(0, 400, 5)]  # 80 chunks
    text = ChunkedText(np.array(body + [EOS]), np.array(spans), tail=1)
    ref = reference_embeddings(model_dir, [body[:end] + [EOS] for _, end in spans])
    (fp32,) = Encoder.from_pretrained(model_dir, dtype="float32").embed_chunks([text])
    assert_close(fp32, ref)
    (bf16,) = Encoder.from_pretrained(model_dir, dtype="bfloat16").embed_chunks([text])
    assert cosine(bf16, ref).min() >= 0.999


def test_last_layer_computes_only_the_read_out_rows(checkpoint):
    """Pruning: with one appended token per chunk, the last layer's MLP sees one row per
    chunk; without appended tokens (pooled at text rows) it sees every row."""
    encoder = Encoder.from_pretrained(checkpoint("qwen3"), dtype="float32")
    rows = []
    encoder.model.layers[-1].mlp.register_forward_hook(lambda m, i, o: rows.append(len(i[0])))
    body = random_sequences([100], seed=9)[0]
    encoder.embed_chunks(
        [ChunkedText(np.array(body + [EOS]), np.array([(0, 40), (40, 95), (95, 100)]), tail=1)]
    )
    encoder.embed_chunks(
        [ChunkedText(np.array(body), np.array([(0, 40), (40, 95), (95, 100)]), tail=0)]
    )
    assert rows == [3, 100]


def test_a_text_split_into_pieces_equals_it_whole(checkpoint):
    """A text whose read-outs would gather more keys than the budget allows runs as pieces of
    its chunks (each the text up to its last chunk's end); the vectors are the same, in the
    chunks' order."""
    model_dir = checkpoint("qwen3")
    body = random_sequences([300], seed=10)[0]
    spans = np.array([(i, i + 20) for i in range(0, 300, 20)][::-1])  # 15 chunks, any order
    text = ChunkedText(np.array(body + [EOS]), spans, tail=1)
    assert text.cost(readout=True) > 330
    pieces = text.pieces(readout=True, budget=330)
    # each within the budget, but a chunk alone (a text over the budget runs alone anyway)
    assert len(pieces) > 1 and all(p.cost(True) <= 330 or len(c) == 1 for p, c in pieces)
    assert sorted(np.concatenate([c for _, c in pieces]).tolist()) == list(range(15))
    (whole,) = Encoder.from_pretrained(model_dir, dtype="float32").embed_chunks([text])
    small = Encoder.from_pretrained(model_dir, dtype="float32", max_batch_tokens=330)
    (split,) = small.embed_chunks([text])
    np.testing.assert_allclose(split, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_prefix_reuse_on_equals_off(checkpoint, backend):
    """Chunk forwards take the segment plan of their own (read-out segments), whatever the
    prefix-reuse switch says; texts with a shared instruction give the same chunk vectors."""
    model_dir = checkpoint("qwen3")
    prompt = random_sequences([24], seed=11)[0]
    bodies = [prompt + b for b in random_sequences([60, 90], seed=12)]
    texts = [ChunkedText(np.array(b + [EOS]), np.array([(24, 50), (50, 84)]), 1) for b in bodies]
    outs = [
        Encoder.from_pretrained(
            model_dir, dtype="float32", attn_backend=backend, prefix_reuse=reuse
        ).embed_chunks(texts)
        for reuse in ("on", "off")
    ]
    for on, off in zip(*outs, strict=True):
        np.testing.assert_allclose(on, off, rtol=1e-6, atol=1e-6)
