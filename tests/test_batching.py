"""Varlen batches, the token-budget planner, batch invariance and input validation."""

import numpy as np
import pytest
import torch

from qwen_embed import Encoder
from qwen_embed.batch import VarlenBatch, flatten, plan_batches, plan_requests, pool_spans

from reference import random_sequences

# Same text alone or in any mixed batch: equal up to fp32 rounding of different GEMM shapes.
BATCH_INVARIANCE_MAX_ABS = 1e-5


def test_varlen_batch_layout():
    batch = VarlenBatch.from_flat(*flatten([[1, 2, 3], [4], [5, 6]]), "cpu")
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert batch.positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.seq_lens == (3, 1, 2)
    with pytest.raises(ValueError):
        flatten([[1], []])


def test_pool_spans_means_each_span_of_rows():
    hidden = torch.randn(20, 4, dtype=torch.bfloat16)
    spans = np.array([[0, 3], [5, 12], [12, 13], [15, 20]])
    want = torch.stack([hidden[a:b].float().mean(0) for a, b in spans])
    assert torch.allclose(pool_spans(hidden, spans), want, atol=1e-6)


def test_plan_requests_shortest_first_within_the_budget():
    # Requests' token counts: the short ones share the first call, the one over budget is alone.
    assert plan_requests([500, 3, 40000, 20, 7], 1000) == [[1, 4, 3, 0], [2]]
    assert plan_requests([600, 3, 500], 1000) == [[1, 2], [0]]
    assert plan_requests([10, 10, 10], 20) == [[0, 1], [2]]
    assert plan_requests([], 100) == []


def test_plan_batches_respects_budget_and_keeps_every_index():
    lengths = [5, 100, 30, 30, 7, 64, 1, 200]
    batches = plan_batches(lengths, 64)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        total = sum(lengths[i] for i in b)
        assert total <= 64 or len(b) == 1  # only a lone over-budget text may exceed it
    assert [7] in batches and [1] in batches  # 200 and 100 tokens run alone


def test_batch_invariance(checkpoint):
    # fp32: in bf16 a sequence met again is computed after its cached prefix (segments.py), an
    # exact split whose rounding differs from the whole sequence's at bf16's precision.
    seqs = random_sequences([3, 200, 17, 1, 64, 64, 120], seed=4)
    with Encoder.from_pretrained(checkpoint("qwen3"), dtype="float32") as enc:
        together = enc.embed(seqs)
        alone = np.concatenate([enc.embed([s]) for s in seqs])
        shuffled = enc.embed(seqs[::-1])[::-1]
    assert np.abs(together - alone).max() <= BATCH_INVARIANCE_MAX_ABS
    assert np.abs(together - shuffled).max() <= BATCH_INVARIANCE_MAX_ABS


def test_results_come_back_in_input_order_across_budget_batches(checkpoint):
    seqs = random_sequences([50, 2, 40, 3, 30, 4], seed=5)
    with Encoder.from_pretrained(checkpoint("qwen2"), max_batch_tokens=45) as enc:
        many_batches = enc.embed(seqs)
    with Encoder.from_pretrained(checkpoint("qwen2")) as enc:
        one_batch = enc.embed(seqs)
    assert np.abs(many_batches - one_batch).max() <= BATCH_INVARIANCE_MAX_ABS


def test_empty_input_list_gives_empty_matrix(checkpoint):
    with Encoder.from_pretrained(checkpoint("qwen3")) as enc:
        out = enc.embed([], dimensions=8)
    assert out.shape == (0, 8) and out.dtype == np.float32


@pytest.mark.parametrize(
    "seqs, kwargs, message",
    [
        ([[1, 2], []], {}, r"token_ids\[1\] is empty"),
        ([[1, 600]], {}, r"token_ids\[0\] holds ids outside 0\.\.511"),
        ([[-1]], {}, r"outside"),
        # ids checked over every list at once, the culprit named after
        ([[1, 2], [3, 4], [5, 600]], {}, r"token_ids\[2\] holds ids outside 0\.\.511"),
        ([[1, 2], [True, False]], {}, r"token_ids\[1\] must be a flat list of integers"),
        ([list(range(10)) * 52], {}, r"520 tokens, more than the model's limit of 512"),
        ([[1.5, 2.0]], {}, r"flat list of integers"),
        ([[1, 2**70]], {}, r"token_ids\[0\] must be a flat list of integers"),
        ([[1, [2, 3]]], {}, r"flat list of integers"),
        ([[1, 2]], {"dimensions": 0}, r"dimensions must be an integer in 1\.\.96"),
        ([[1, 2]], {"dimensions": 97}, r"1\.\.96, got 97"),
        ([[1, 2]], {"dimensions": True}, r"dimensions"),
        ([[1, 2]], {"dimensions": "8"}, r"dimensions"),
    ],
)
def test_bad_input_is_a_clear_error(checkpoint, seqs, kwargs, message):
    with Encoder.from_pretrained(checkpoint("qwen3")) as enc:
        with pytest.raises(ValueError, match=message):
            enc.embed(seqs, **kwargs)
        assert enc.embed([[1, 2, 3]]).shape == (1, 96)  # still serving afterwards


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"pooling": "max"}, "pooling must be one of"),
        ({"dtype": "float64"}, "dtype must be one of \\['auto'"),
        ({"attn_backend": "xformers"}, "unknown attention backend 'xformers'"),
        ({"max_batch_tokens": 0}, "max_batch_tokens"),
        # refused only after the TP group's processes start
        pytest.param({"tp_size": 3}, "tp_size=3 does not divide", marks=pytest.mark.server),
    ],
)
def test_bad_engine_options(checkpoint, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Encoder.from_pretrained(checkpoint("qwen3"), **kwargs)
