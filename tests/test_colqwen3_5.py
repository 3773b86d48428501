"""ColQwen3.5 as colpali-engine saves it (athrael-soju/colqwen3.5-4.5B-v3): Qwen3.5's
multimodal model (linear-attention layers between full-attention ones, Qwen3-VL's tower
without DeepStack) and `custom_text_proj`, a vector per token. On a replica of that layout
(replicas.colqwen3_5). The reference is colpali-engine's own ColQwen3_5 and
ColQwen3_5Processor (0.3.18, the first release with them) on the same directory, in a process
of its own (colpali_reference.py): `process_queries` (no prefix: the versions that trained it
write none) and `process_images`. Asserted: fp32 cosine >= 0.9999 per token, MaxSim within 1e-3
per query token.
"""

import dataclasses
import json

import colpali_reference
import numpy as np
import pytest
from test_colpali_engine import assert_served_as, page_files, page_tokens
from test_qwen3_vl import Texts

from qwen_embed import Encoder
from qwen_embed.config import ModelConfig
from qwen_embed_deploy.serving.retrievers import ColPaliTemplate

from reference import cosine
from replicas import COLQWEN3_5_WIDTH, colqwen3_5

FP32_COSINE = 0.9999
QUERIES = ["which chart shows a yellow circle?", "quarterly report, page 2"]
NEEDS_COLPALI = pytest.mark.skipif(
    not colpali_reference.available(),
    reason="the reference is colpali-engine with torchvision (.venv/video-reference: make setup)",
)


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    return colqwen3_5(tmp_path_factory.mktemp("colqwen3_5"), files=True)


def test_the_layout_is_read(replica):
    config = ModelConfig.from_dir(replica)
    assert config.family == "qwen3_5" and config.multi_vector
    assert config.linear_attention.layers == (True, False, True, False)
    assert config.rotary_dim == 16 and config.media.mrope_section == (3, 3, 2)
    assert config.media.vision.generation == "qwen3_vl"
    assert config.media.vision.deepstack_visual_indexes == ()
    assert config.token_size == config.embedding_size == COLQWEN3_5_WIDTH
    assert config.sentence.token_projection.prefix == "custom_text_proj."


def test_the_processor_forms(replica, tmp_path):
    template = ColPaliTemplate.from_dir(replica, "<|endoftext|>")
    pads = "<|endoftext|>" * 10
    assert template.parts(None, "", False, " a query ") == ("", " a query ", pads)
    # pages as colpali-engine's ColQwen2 writes them; only the trained query prefix differs
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["ColQwen2"]}))
    assert template == dataclasses.replace(
        ColPaliTemplate.from_dir(tmp_path, "<|endoftext|>"), query_prefix=""
    )


@pytest.fixture(scope="module")
def served(replica, tmp_path_factory):
    from qwen_embed_deploy.repository import render
    from qwen_embed_deploy.triton import TritonServer

    where = tmp_path_factory.mktemp("colqwen3_5-served")
    repo = render(where / "repo", {"embed": replica}, {"encoder": {"dtype": "float32"}})
    with TritonServer(repo, log_path=where / "server.log") as server:
        yield server


@pytest.mark.server
@NEEDS_COLPALI
def test_queries_and_pages_through_triton_match_colpali_engine(replica, served, tmp_path):
    pages, paths = page_files(tmp_path)
    spec = {
        "model_dir": str(replica),
        "model": "ColQwen3_5",
        "queries": QUERIES,
        "images": [str(p) for p in paths],
    }
    queries, want = colpali_reference.run(spec, tmp_path)
    preprocessor = json.loads((replica / "preprocessor_config.json").read_text())
    budget = preprocessor["size"]["longest_edge"] // (4 * 2) ** 2  # tokens of 8 x 8 pixels
    image_tokens = len(want[2]) - len(page_tokens(replica, "<|image_pad|>"))
    assert budget * 0.8 < image_tokens + 1 <= budget  # resized into the budget, and near it
    assert_served_as(served, "embed", QUERIES, pages, queries, want)


@pytest.mark.server  # the reference runs in a process of its own
@NEEDS_COLPALI
def test_a_query_in_process(replica, tmp_path):
    """The engine alone on a query's ids (the processor's form) against colpali-engine."""
    spec = {"model_dir": str(replica), "model": "ColQwen3_5", "queries": QUERIES[:1], "images": []}
    (want,), _ = colpali_reference.run(spec, tmp_path)
    before, text, after = ColPaliTemplate.from_dir(replica, "<|endoftext|>").parts(
        None, "", False, QUERIES[0]
    )
    tokens = page_tokens(replica, before + text + after)
    assert len(tokens) == len(want)
    with Encoder.from_pretrained(replica, dtype="float32") as enc:
        (got,) = enc.embed_tokens([tokens])
    assert got.shape == (len(tokens), COLQWEN3_5_WIDTH)
    assert cosine(got, want).min() >= FP32_COSINE


@pytest.mark.server  # starts the rank-1 worker process
def test_tensor_parallel_equals_one_process(replica):
    """tp_size 2: rank 0 runs the tower and sends the visuals' tokens to rank 1; both kinds of
    layer split by heads. Pages, a query, and a batch split over forwards (fp32: only the
    all-reduces' summation order differs)."""
    t = Texts(ModelConfig.from_dir(replica).media, seed=3)
    texts = [t.text(5, t.visual(4, 4), 3), t.text(t.visual(2, 4), 2), t.text(40), t.text(9)]
    runs = {}
    for tp_size in (1, 2):
        with Encoder.from_pretrained(
            replica, tp_size=tp_size, dtype="float32", max_batch_tokens=48
        ) as encoder:
            runs[tp_size] = encoder.embed_tokens(texts)
    for one, two in zip(runs[1], runs[2], strict=True):
        assert one.shape == two.shape and np.abs(one - two).max() <= 1e-5
