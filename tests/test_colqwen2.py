"""ColQwen2 (vidore/colqwen2-v1.0-hf, transformers' `ColQwen2ForRetrieval`): a multi-vector
retriever over Qwen2-VL, one vector per token through its `embedding_proj_layer`, normalised,
for late interaction. On replicas saved by transformers' own class (replicas.colqwen2), and
the same class over Qwen2.5-VL (colqwen2.5 in that format: replicas.colqwen2_5, its tower's
attention windows).

Its text model numbers an image's tokens on three axes (Qwen2-VL's multimodal rotary, in
sections), as colpali-engine, which trained the published checkpoints, runs it. transformers'
port hands its language model embeddings without the ids, so it numbers every token in
sequence: its queries (text alone) are the recipe's exactly, its pages are not. The reference
for pages is therefore the recipe written out with transformers' Qwen2-VL (ids and image grids
given, so that it computes the three-axis positions), and the test shows where the port parts
from it."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_colqwen3 import assert_gpu_tokens, assert_served_tokens, large_page, serving
from test_qwen3_vl import BF16_COSINE, FP32_COSINE, Texts, image_files, visual_inputs
from transformers import ColQwen2ForRetrieval, ColQwen2Processor
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

from qwen_embed import Encoder
from qwen_embed.config import ModelConfig, UnsupportedModelError
from qwen_embed.layers import rotary_cos_sin
from qwen_embed.media import MediaText, Visual
from qwen_embed.models.vision import window_order
from qwen_embed_client.contract import RequestError
from qwen_embed_deploy.serving.retrievers import ColPaliTemplate

from reference import cosine
from replicas import COLQWEN2_WIDTH, colqwen2, colqwen2_5


@pytest.fixture(scope="module", params=[colqwen2, colqwen2_5], ids=["qwen2_vl", "qwen2_5_vl"])
def replica(tmp_path_factory, request):
    return request.param(tmp_path_factory.mktemp(request.param.__name__))


class Recipe:
    """The published model: transformers' ColQwen2ForRetrieval from the directory; a text's
    token vectors through its Qwen2-VL given the ids and image grids (three-axis positions,
    as colpali-engine runs it), or through the port's own forward (`port`)."""

    def __init__(self, model_dir):
        self.model = ColQwen2ForRetrieval.from_pretrained(model_dir, dtype=torch.float32).eval()
        tensors = load_file(model_dir / "model.safetensors")
        self.weight = tensors["embedding_proj_layer.weight"].float()
        self.bias = tensors["embedding_proj_layer.bias"].float()

    def tokens(self, ids, inputs: dict) -> np.ndarray:
        config = self.model.config.vlm_config
        ids = torch.as_tensor(np.asarray(ids))[None]
        types = (ids == config.image_token_id).int()
        with torch.no_grad():
            hidden = self.model.vlm(input_ids=ids, mm_token_type_ids=types, **inputs)
        projected = torch.nn.functional.linear(hidden.last_hidden_state[0], self.weight, self.bias)
        return (projected / projected.norm(dim=-1, keepdim=True)).numpy()

    def port(self, ids, inputs: dict) -> np.ndarray:
        ids = torch.as_tensor(np.asarray(ids))[None]
        if inputs:  # the port's pixels come padded per image
            inputs = {**inputs, "pixel_values": inputs["pixel_values"][None]}
        with torch.no_grad():
            return self.model(input_ids=ids, **inputs).embeddings[0].numpy()


@pytest.fixture(scope="module")
def recipe(replica):
    return Recipe(replica)


def cases(media) -> dict[str, MediaText]:
    """Texts with images; on Qwen2.5-VL's replica (windows of 2 x 2 merge blocks) the images
    span several windows, the last ones partial."""
    t = Texts(media, seed=5)
    return {
        "text alone": t.text(9),
        "an image alone": t.text(2, t.visual(6, 10), 2),
        "text with an image": t.text(12, t.visual(10, 4), 9),
        "two images": t.text(3, t.visual(4, 4), 2, t.visual(6, 6), 1),
    }


def test_the_layout_is_a_multi_vector_qwen2_vl(tmp_path):
    replica = colqwen2(tmp_path / "colqwen2")
    config = ModelConfig.from_dir(replica)
    assert config.family == "qwen2" and config.has_qkv_bias and not config.has_qk_norm
    assert config.multi_vector and config.token_size == config.embedding_size == COLQWEN2_WIDTH
    media = config.media
    assert media.vision.generation == "qwen2_vl" and not media.reads_video
    assert media.mrope_section == (8, 12, 12) and not media.mrope_interleaved
    assert (media.vision.hidden_size, media.vision.intermediate_size) == (64, 128)
    assert media.vision.out_hidden_size == config.hidden_size == 128
    # transformers 4.x saved Qwen2-VL flat: the text model's fields beside `vision_config`,
    # multimodal rotary named "mrope"; read the same
    hf = json.loads((replica / "config.json").read_text())
    vlm = dict(hf["vlm_config"])
    text = dict(vlm.pop("text_config"))
    rope = text.pop("rope_parameters")
    flat = {**vlm, **text, "rope_theta": rope["rope_theta"]}
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    flat["vision_config"] = {**vlm["vision_config"], "in_chans": 3}
    assert ModelConfig.from_hf({**hf, "vlm_config": flat}) == ModelConfig.from_hf(hf)
    # over Qwen2.5-VL: its tower's windows of 16 pixels, 2 x 2 merge blocks; its rotary alike
    over = ModelConfig.from_dir(colqwen2_5(tmp_path / "colqwen2_5")).media
    assert over.vision.generation == "qwen2_5_vl" and over.vision.window_units == 2
    assert over.vision.fullatt_block_indexes == (1,) and not over.mrope_interleaved
    # Qwen2-VL's own architectures are refused: what their embedders run is not in the files
    bare = {**hf["vlm_config"], "architectures": ["Qwen2VLForConditionalGeneration"]}
    with pytest.raises(UnsupportedModelError, match="unsupported architectures"):
        ModelConfig.from_hf(bare)


def test_sectioned_rotary_is_qwen2_vls():
    """Multimodal rotary in sections (time, rows, columns one after the other) against
    transformers' Qwen2-VL rotary: cos and sin of random three-axis positions."""
    from transformers import Qwen2VLTextConfig

    config = Qwen2VLTextConfig(
        hidden_size=256,
        num_attention_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
    )
    positions = torch.randint(0, 4000, (37, 3))
    cos, sin = Qwen2VLRotaryEmbedding(config)(torch.zeros(1), positions.T[:, None])
    got_cos, got_sin = rotary_cos_sin(positions, 128, 1e6, torch.float32, (16, 24, 24), False)
    assert torch.allclose(got_cos, cos[0, :, :64], atol=1e-6)
    assert torch.allclose(got_sin, sin[0, :, :64], atol=1e-6)
    interleaved, _ = rotary_cos_sin(positions, 128, 1e6, torch.float32, (16, 24, 24))
    assert not torch.allclose(interleaved, cos[0, :, :64], atol=1e-3)  # a check that can fail


def test_windows_are_qwen2_5_vls():
    """Qwen2.5-VL's windows: the merge blocks in transformers' window order, and the windows'
    lengths its boundaries give, for frames of whole, partial and single windows."""
    from transformers.vision_utils import get_vision_window_index

    grids = [(1, 10, 6), (1, 4, 4), (2, 6, 10), (1, 2, 18)]
    order, sizes = window_order(grids, merge=2, window=2)
    index, bounds = get_vision_window_index(
        torch.tensor(grids), spatial_merge_size=2, window_size=16, patch_size=4
    )
    assert np.array_equal(order, index.numpy())
    assert np.array_equal(np.cumsum([0, *sizes]), bounds.numpy())
    assert len(sizes) > len(grids) + 1  # frames of several windows: a check that can fail


@pytest.mark.server  # whole-model runs against transformers': seconds
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_vectors_match_the_recipe(replica, recipe, dtype):
    config = ModelConfig.from_dir(replica)
    texts = cases(config.media)
    want = {name: recipe.tokens(t.ids, visual_inputs(t)) for name, t in texts.items()}
    floor = FP32_COSINE if dtype == "float32" else BF16_COSINE
    with Encoder.from_pretrained(replica, dtype=dtype, max_batch_tokens=64) as enc:
        assert not enc.route.prefix_reuse and not enc.route.prune
        got = dict(zip(texts, enc.embed_tokens(list(texts.values())), strict=True))
        plain = enc.embed_tokens([texts["text alone"].ids])[0]  # ids alone, no media path
        video = Visual(np.zeros((32, config.media.vision.patch_dim), np.float32), (2, 4, 4), True)
        with pytest.raises(ValueError, match="videos are not read"):
            enc.embed_tokens([MediaText(texts["text alone"].ids, (video,))])
    for name, vectors in got.items():
        assert vectors.shape == (len(texts[name].ids), COLQWEN2_WIDTH), name
        assert cosine(vectors, want[name]).min() >= floor, name
    assert cosine(plain, want["text alone"]).min() >= floor
    # transformers' port: a query is the recipe's; a page's tokens are numbered in sequence
    text = texts["text alone"]
    assert cosine(recipe.port(text.ids, {}), want["text alone"]).min() >= FP32_COSINE
    page = texts["text with an image"]
    assert (
        cosine(recipe.port(page.ids, visual_inputs(page)), want["text with an image"]).min() < 0.99
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_token_vectors_on_a_gpu_match_the_recipe(replica, recipe):
    """bf16 on the GPU (a text alone through the CUDA graphs, the others through the tower)
    against the recipe in fp32 on the CPU."""
    assert_gpu_tokens(replica, recipe, cases(ModelConfig.from_dir(replica).media))


def test_the_processor_forms(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["ColQwen2ForRetrieval"]}))
    template = ColPaliTemplate.from_dir(tmp_path, "<|endoftext|>")
    pads = "<|endoftext|>" * 10
    assert template.parts(None, "", False, " a query ") == ("Query: ", " a query ", pads + "\n")
    image = "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>"
    assert template.parts(None, image, False, "") == (
        f"<|im_start|>user\n{image}Describe the image.<|im_end|><|endoftext|>",
        "",
        "",
    )
    with pytest.raises(RequestError, match="pages are an image alone"):
        template.parts(None, image, False, "a caption")
    prefix = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Read it.<|im_end|>"
    (tmp_path / "processor_config.json").write_text(
        json.dumps({"query_prefix": "Q: ", "visual_prompt_prefix": prefix})
    )
    changed = ColPaliTemplate.from_dir(tmp_path, "<pad>")
    assert changed.parts(None, "", False, "q") == ("Q: ", "q", "<pad>" * 10 + "\n")
    assert changed.parts(None, image, False, "")[0].endswith("Read it.<|im_end|>")


# Through Triton: the tokenizer writes queries and pages as transformers' ColQwen2Processor
# does (read from the served directory) and resizes images within its budget.


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("colqwen2-served"), colqwen2)


def image(data: bytes):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def official_tokens(recipe, processor, text: str, images: list[bytes]) -> np.ndarray:
    """What the checkpoint's own processor makes of a query or a page, through the recipe."""
    if not images:
        batch = processor.process_queries([text])
        return recipe.tokens(batch["input_ids"][0], {})
    batch = processor.process_images([image(images[0])])
    grid = batch["image_grid_thw"]
    pixels = batch["pixel_values"][0, : int(grid[0].prod())]
    return recipe.tokens(batch["input_ids"][0], {"pixel_values": pixels, "image_grid_thw": grid})


@pytest.mark.server
def test_queries_and_pages_through_triton_match_the_official_processor(served):
    model_dir, server = served
    recipe, processor = Recipe(model_dir), ColQwen2Processor.from_pretrained(model_dir)
    files = image_files()
    inputs = [
        ("which chart shows a yellow circle?", []),
        ("", [files["png"]]),
        ("", [files["jpeg"]]),
        ("", [large_page()]),  # resized down into the budget of 60 tokens
    ]
    want = [official_tokens(recipe, processor, t, im) for t, im in inputs]
    (grid,) = processor.image_processor(images=[image(large_page())])["image_grid_thw"]
    assert 50 < grid.prod() // 4 <= 60  # the budget bit: 60 text-model tokens at most, used
    assert_served_tokens(server, inputs, want)


@pytest.mark.server
def test_what_it_cannot_answer_is_refused_for_that_request(served):
    from qwen_embed_client import EmbeddingClient, EmbeddingError

    _, server = served
    files = image_files()
    with EmbeddingClient(server.grpc_url) as client:
        with pytest.raises(EmbeddingError, match="multi-vector retriever.*'per_token'"):
            client.embed(["a query"])
        with pytest.raises(EmbeddingError, match=r"input 'TEXT\[0\]' holds text beside its"):
            client.embed_tokens(["a caption"], images=[[files["png"]]])
        with pytest.raises(EmbeddingError, match="input 'VIDEOS' holds videos.*texts and images"):
            client.embed_tokens(["a clip"], videos=[[[files["png"], files["png"]]]])
        page = client.embed_tokens([""], images=[[files["png"]]])[0]
        assert page.shape[1] == COLQWEN2_WIDTH
