"""nemotron-colembed-vl-v2 (`Qwen3VLNemotronEmbedModel`): a multi-vector retriever over
Qwen3-VL whose remote code attends both ways and reads each token's last-layer output before
the final norm, normalised. Against that recipe written out with transformers' Qwen3-VL (its
text model made bidirectional, its final norm left out) on a replica of the layout
(replicas.nemotron_colembed): in process, and through Triton with its processor's chat-turn
query and page forms (serving/retrievers.py)."""

import numpy as np
import pytest
import torch
from test_colqwen3 import assert_served_tokens, pages, serving
from test_qwen3_vl import (
    BF16_COSINE,
    FP32_COSINE,
    Texts,
    last_hidden_states,
    official_features,
    tokenizer_of,
    visual_inputs,
)
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from qwen_embed import Encoder
from qwen_embed.config import ModelConfig
from qwen_embed_deploy.serving.retrievers import NemotronTemplate

from reference import cosine
from replicas import nemotron_colembed


def recipe_model(model_dir) -> Qwen3VLForConditionalGeneration:
    """Its remote code's model: Qwen3-VL with every text layer attending both ways, and no
    final norm (its forward returns the last layer's output)."""
    config = Qwen3VLConfig.from_pretrained(model_dir)
    config.text_config.is_causal = False
    model = Qwen3VLForConditionalGeneration.from_pretrained(
        model_dir, config=config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model.model.language_model.norm = torch.nn.Identity()
    return model


def recipe_tokens(model, ids, inputs: dict) -> np.ndarray:
    hidden = last_hidden_states(model, ids, inputs)
    return torch.nn.functional.normalize(hidden, dim=-1).numpy()


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    return nemotron_colembed(tmp_path_factory.mktemp("nemotron-colembed"))


def test_the_layout_is_a_bidirectional_multi_vector_qwen3_vl(replica):
    config = ModelConfig.from_dir(replica)
    assert config.multi_vector and not config.is_causal and not config.final_norm
    assert config.token_size == config.embedding_size == config.hidden_size
    assert config.media is not None and config.sentence.token_projection is None


@pytest.mark.server  # whole-model runs against transformers': seconds
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_vectors_match_the_recipe(replica, dtype):
    model = recipe_model(replica)
    t = Texts(ModelConfig.from_dir(replica).media, seed=5)
    texts = [t.text(9), t.text(2, t.visual(4, 6), 5), t.text(t.visual(6, 4), 7)]
    want = [recipe_tokens(model, x.ids, visual_inputs(x)) for x in texts]
    floor = FP32_COSINE if dtype == "float32" else BF16_COSINE
    with Encoder.from_pretrained(replica, dtype=dtype, max_batch_tokens=64) as enc:
        got = enc.embed_tokens(texts)
        with pytest.raises(ValueError, match="multi-vector retriever"):
            enc.embed([texts[0].ids])
    for vectors, expected in zip(got, want, strict=True):
        assert vectors.shape == expected.shape
        assert cosine(vectors, expected).min() >= floor
    # what sets it apart, each a check the vectors above would fail: the final norm left out,
    # and the first tokens reading the later ones
    normed = Qwen3VLForConditionalGeneration.from_pretrained(replica, dtype=torch.float32)
    normed.config.text_config.is_causal = False
    assert cosine(got[0], recipe_tokens(normed.eval(), texts[0].ids, {})).min() < FP32_COSINE
    causal = recipe_model(replica)
    causal.config.text_config.is_causal = True
    assert cosine(got[0][:3], recipe_tokens(causal, texts[0].ids, {})[:3]).min() < FP32_COSINE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_token_vectors_on_a_gpu_match_the_recipe(replica):
    """bf16 on the GPU (a text alone through the CUDA graphs, whose last stretch leaves the
    final norm out too) against the recipe in fp32 on the CPU."""
    model = recipe_model(replica)
    t = Texts(ModelConfig.from_dir(replica).media, seed=6)
    texts = [t.text(9), t.text(2, t.visual(4, 6), 5)]
    want = [recipe_tokens(model, x.ids, visual_inputs(x)) for x in texts]
    with Encoder.from_pretrained(replica, dtype="bfloat16", device="cuda") as enc:
        got = [enc.embed_tokens([texts[0].ids])[0], enc.embed_tokens([texts[1]])[0]]
    for vectors, expected in zip(got, want, strict=True):
        assert cosine(vectors, expected).min() >= BF16_COSINE


def test_the_processor_forms(tmp_path):
    query, page = NemotronTemplate(), "<|vision_start|><|image_pad|><|vision_end|>"
    answer = "<|im_end|>\n<|im_start|>assistant\n"
    assert query.parts(None, "", False, "a query") == (
        "<|im_start|>user\nQuery: query: ",
        "a query",
        answer,
    )
    assert query.parts(None, page, False, "") == (
        f"<|im_start|>user\n{page}passage: ",
        "",
        answer,
    )
    (tmp_path / "processor_config.json").write_text('{"query_prefix": "", "passage_prefix": "p"}')
    bare = NemotronTemplate.from_dir(tmp_path)
    assert bare.parts(None, "", False, "q")[0] == "<|im_start|>user\nQuery: "
    assert bare.parts(None, page, False, "t")[0] == f"<|im_start|>user\n{page}p "


def official_prompt(text: str, pads: str | None) -> str:
    """Its processor's chat turn (Qwen3-VL's template, the generation prompt added)."""
    content = f"Query: query: {text}" if pads is None else f"{pads}passage: {text}"
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("nemotron-colembed-served"), nemotron_colembed)


@pytest.mark.server
def test_queries_and_pages_through_triton_match_the_official_recipe(served):
    from qwen_embed_client import EmbeddingClient, EmbeddingError

    model_dir, server = served
    model = recipe_model(model_dir)
    # the image processor's own budget (the replica's preprocessor_config.json)
    budget = {"shortest_edge": 4096, "longest_edge": 1843200}
    inputs, want = pages(), []
    for text, images in inputs:
        features, pads = official_features(images, budget)
        prompt = official_prompt(text, pads[0] if images else None)
        want.append(recipe_tokens(model, tokenizer_of(model_dir).encode(prompt).ids, features))
    assert_served_tokens(server, inputs, want)
    with EmbeddingClient(server.grpc_url) as client:
        with pytest.raises(EmbeddingError, match="multi-vector retriever.*'per_token'"):
            client.embed(["a query"])
        with pytest.raises(EmbeddingError, match="'instruction' is not read by this model"):
            client.embed_tokens(["a query"], instruction="Find charts")
