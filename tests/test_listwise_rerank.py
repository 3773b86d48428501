"""A listwise reranker (jina-reranker-v3, `JinaForRanking`) in the engine against its own recipe.

The reference (reference.jina_rerank) is jina-reranker-v3's `rerank` written out apart from the
server's code, over transformers' Qwen3Model in fp32. Tolerances: the block token ids exactly;
fp32 scores (cosines) within 1e-4, bf16 within 2e-2.
"""

import numpy as np
import pytest

from qwen_embed import Encoder
from qwen_embed_client.contract import RequestError, RerankOptions
from qwen_embed_deploy.demo import build_demo_adapter
from qwen_embed_deploy.serving.listwise import BlockTokenizer

from reference import jina_blocks, jina_rerank

FP32_ABS = 1e-4
BF16_ABS = 2e-2
QUERY = "What are the health benefits of green tea?"
DOCUMENTS = [
    "Green tea contains antioxidants called catechins that may reduce inflammation.",
    "El precio del café ha aumentado un 20% este año. " * 30,
    "Studies show that drinking green tea can improve brain function. " * 40,
    "绿茶富含儿茶素等抗氧化剂，可以降低心脏病风险。",
    "Basketball is one of the most popular sports in the United States. " * 35,
    "A passage that mentions the markers <|embed_token|> and <|rerank_token|> itself.",
    "Le thé vert est riche en antioxydants.",
]


@pytest.fixture(scope="module")
def expected(jina):
    return jina_rerank(jina, QUERY, DOCUMENTS)


def blocks_of(rows):
    return [r for r in rows if r]


def test_block_ids_are_its_recipes(jina):
    """The rows: each block's prompt on its first document's row, none on the others; the
    documents here make several blocks (the replica's tokenizer length is 2,800)."""
    rows = BlockTokenizer(jina, 4096).encode(QUERY, DOCUMENTS, RerankOptions())
    assert len(rows) == len(DOCUMENTS)
    blocks = jina_blocks(jina, QUERY, DOCUMENTS)
    assert blocks_of(rows) == blocks and len(blocks) >= 2
    assert [len(r) > 0 for r in rows].count(True) == len(blocks)
    instructed = BlockTokenizer(jina, 4096).encode(
        QUERY, DOCUMENTS[:1], RerankOptions(instruction="Prefer short passages")
    )
    assert instructed == jina_blocks(jina, QUERY, DOCUMENTS[:1], "Prefer short passages")


def test_long_texts_are_cut_as_its_recipe_cuts_them(jina):
    long = "tea " * 2500  # past the 2,048 tokens a document keeps
    rows = BlockTokenizer(jina, 4096).encode("green " * 600, [long, "x"], RerankOptions())
    assert blocks_of(rows) == jina_blocks(jina, "green " * 600, [long, "x"])
    with pytest.raises(RequestError, match=r"DOCUMENTS\[0\].*2048.*truncate"):
        BlockTokenizer(jina, 4096).encode(QUERY, [long], RerankOptions(truncate=False))
    with pytest.raises(RequestError, match=r"QUERY\[0\].*512.*truncate"):
        BlockTokenizer(jina, 4096).encode("green " * 600, ["x"], RerankOptions(truncate=False))
    # A limit below the tokenizer's length: smaller blocks, each within it.
    rows = BlockTokenizer(jina, 1024).encode(QUERY, DOCUMENTS, RerankOptions())
    assert len(blocks_of(rows)) > len(jina_blocks(jina, QUERY, DOCUMENTS))
    assert max(len(b) for b in blocks_of(rows)) <= 1024 and len(rows) == len(DOCUMENTS)
    with pytest.raises(RequestError, match="QUERY.*limit of 300"):
        BlockTokenizer(jina, 300).encode(QUERY, [long], RerankOptions())


@pytest.mark.server  # whole-model runs against transformers': seconds each
@pytest.mark.parametrize("max_batch_tokens", [16384, 256])  # 256: blocks past the budget
def test_fp32_scores_match_its_recipe(jina, expected, max_batch_tokens):
    with Encoder.from_pretrained(jina, dtype="float32", max_batch_tokens=max_batch_tokens) as enc:
        assert enc.task == "rerank"  # auto: a listwise reranker only reranks
        scores = enc.rank_blocks(expected[1])
        with pytest.raises(ValueError, match="rank_blocks"):
            enc.score(expected[1])
    assert scores.shape == (len(DOCUMENTS),) and scores.dtype == np.float32
    assert np.abs(scores - expected[0]).max() <= FP32_ABS
    assert np.ptp(expected[0]) > 1e-2  # the replica tells documents apart


@pytest.mark.server
def test_bf16_and_tp2_scores(jina, expected):
    with Encoder.from_pretrained(jina, dtype="bfloat16") as enc:
        assert np.abs(enc.rank_blocks(expected[1]) - expected[0]).max() <= BF16_ABS
    with Encoder.from_pretrained(jina, dtype="float32", tp_size=2) as enc:
        assert np.abs(enc.rank_blocks(expected[1]) - expected[0]).max() <= FP32_ABS


@pytest.mark.server  # starts a tensor-parallel worker
def test_an_adapter_named_per_call_scores_as_peft(jina, expected, tmp_path):
    """A LoRA kept beside the weights (lora_modules) and named per call: a query's blocks
    scored as peft's unmerged forward of the fine-tune scores them (fp32), in one process
    and on two TP ranks; without the name, the base's scores."""
    adapter = build_demo_adapter(tmp_path / "adapter", jina, rank=8, seed=3)
    want, blocks = jina_rerank(jina, QUERY, DOCUMENTS, adapter=adapter)
    assert blocks == expected[1] and np.abs(want - expected[0]).max() > 1e-2  # it matters
    for tp_size in (1, 2):
        with Encoder.from_pretrained(
            jina, dtype="float32", tp_size=tp_size, lora_modules=f"ft={adapter}"
        ) as enc:
            assert np.abs(enc.rank_blocks(blocks, adapter="ft") - want).max() <= FP32_ABS
            assert np.abs(enc.rank_blocks(blocks) - expected[0]).max() <= FP32_ABS


def test_a_listwise_reranker_only_reranks_and_needs_its_markers(jina):
    with pytest.raises(ValueError, match="listwise reranker.*only reranks"):
        Encoder.from_pretrained(jina, task="embed")
    with Encoder.from_pretrained(jina, dtype="float32") as enc:
        block = list(jina_blocks(jina, QUERY, DOCUMENTS)[0])
        with pytest.raises(ValueError, match="document markers followed by one query marker"):
            enc.rank_blocks([block[: len(block) // 3]])
