"""jina-reranker-m0 (`JinaVLForRanking`): a Qwen2-VL that scores a (document, query) pair by an
MLP on the last token's hidden state, the document first, an image standing for its side's
text. On a replica of the published layout (replicas.jina_reranker_m0), against its remote
code's recipe written out with transformers' Qwen2-VL (ids and image grids given, so that it
numbers an image's tokens on three axes): `formatting_prompts_func`, its processor (the pixel
budget compute_score gives it), the score token appended, sigmoid(logit - 2.65)."""

import io

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_qwen3_vl import Texts, image_files, visual_inputs
from transformers import Qwen2VLForConditionalGeneration

from qwen_embed import Encoder
from qwen_embed.config import ModelConfig
from qwen_embed.media import MediaText, Visual
from qwen_embed_client.contract import RequestError, RerankOptions
from qwen_embed_deploy.serving.rerank import PairTokenizer
from qwen_embed_deploy.serving.tokenizer import image_blocks

from replicas import jina_reranker_m0, qwen3_embedding

SCORE_TOKEN = 100


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    return jina_reranker_m0(tmp_path_factory.mktemp("jina-m0"))


class Recipe:
    """JinaVLForRanking's forward: transformers' Qwen2-VL from the directory, the last token's
    final hidden state through its `score` MLP, then compute_score's sigmoid(x - 2.65)."""

    def __init__(self, model_dir):
        self.model = Qwen2VLForConditionalGeneration.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()
        tensors = {k: t.float() for k, t in load_file(model_dir / "model.safetensors").items()}
        hidden = tensors["score.0.weight"].shape[0]
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )
        with torch.no_grad():
            for i in (0, 2):
                self.mlp[i].weight.copy_(tensors[f"score.{i}.weight"])
                self.mlp[i].bias.copy_(tensors[f"score.{i}.bias"])

    def score(self, text: MediaText) -> float:
        ids = torch.as_tensor(np.asarray(text.ids))[None]
        types = (ids == self.model.config.image_token_id).int()
        with torch.no_grad():
            out = self.model.model(input_ids=ids, mm_token_type_ids=types, **visual_inputs(text))
            logit = self.mlp(out.last_hidden_state[0, -1])
        return float(torch.sigmoid(logit - 2.65))


def test_the_layout_is_a_multimodal_reranker(replica):
    config = ModelConfig.from_dir(replica)
    assert config.mlp_score and config.family == "qwen2" and config.is_causal
    assert config.media.vision.generation == "qwen2_vl" and not config.media.reads_video
    with Encoder.from_pretrained(replica, dtype="float32") as enc:
        assert enc.task == "rerank" and enc.route.pooling == "last"


@pytest.mark.server  # whole-model runs against transformers': seconds
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scores_match_the_recipe(replica, dtype):
    """Pairs as its formatting writes them (ids here): text with text, an image document, an
    image query, images on both sides; in one call (several forwards)."""
    media = ModelConfig.from_dir(replica).media
    t = Texts(media, seed=3)
    pairs = [
        t.text(14, 9),
        t.text(4, t.visual(6, 4), 11),
        t.text(20, t.visual(4, 8), 3),
        t.text(3, t.visual(4, 4), 5, t.visual(6, 6), 2),
    ]
    pairs = [MediaText(np.append(p.ids, SCORE_TOKEN), p.visuals) for p in pairs]
    recipe = Recipe(replica)
    want = np.array([recipe.score(p) for p in pairs])
    with Encoder.from_pretrained(replica, dtype=dtype, max_batch_tokens=64) as enc:
        got = enc.score_media(pairs)
    assert np.abs(got - want).max() <= (1e-4 if dtype == "float32" else 1e-2), (got, want)
    assert np.ptp(want) > 0.05  # the pairs score apart: a check that can fail


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_scores_on_a_gpu_match_the_recipe(replica):
    """bf16 on the GPU (text pairs also through the CUDA graphs) against the recipe in fp32
    on the CPU, within 1e-2."""
    t = Texts(ModelConfig.from_dir(replica).media, seed=4)
    pairs = [t.text(14, 9), t.text(4, t.visual(6, 4), 11), t.text(3, t.visual(4, 8), 20)]
    pairs = [MediaText(np.append(p.ids, SCORE_TOKEN), p.visuals) for p in pairs]
    recipe = Recipe(replica)
    want = np.array([recipe.score(p) for p in pairs])
    with Encoder.from_pretrained(replica, dtype="bfloat16", device="cuda") as enc:
        got = enc.score_media(pairs)
        text = enc.score([pairs[0].ids])[0]
    assert np.abs(got - want).max() <= 1e-2, (got, want)
    assert abs(text - want[0]) <= 1e-2


class Official:
    """compute_score's inputs from the served directory: formatting_prompts_func's prompt, its
    processor (the tokenizer; Qwen2-VL's image processor at min_pixels 3,136 and max_pixels
    602,112, the document's image before the query's) and the score token."""

    def __init__(self, model_dir):
        from transformers import AutoTokenizer, Qwen2VLImageProcessor

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.images = Qwen2VLImageProcessor.from_pretrained(
            model_dir, min_pixels=3136, max_pixels=602112
        )
        self.images.size = {"shortest_edge": 3136, "longest_edge": 602112}

    def pair(self, query, document, query_image=None, document_image=None) -> MediaText:
        from PIL import Image

        image = "<|vision_start|><|image_pad|><|vision_end|>"
        prompt = f"**Document**:\n{image if document_image else document}\n**Query**:\n"
        prompt += image if query_image else query
        visuals = []
        for data in (document_image, query_image):  # in the prompt's order
            if data:
                picture = Image.open(io.BytesIO(data)).convert("RGB")
                batch = self.images(images=[picture], return_tensors="np")
                grid = tuple(int(g) for g in batch["image_grid_thw"][0])
                visuals.append(Visual(batch["pixel_values"].astype(np.float32), grid))
        pads = iter("<|image_pad|>" * (int(np.prod(v.grid)) // 4) for v in visuals)
        prompt = "".join(next(pads) if part == "" else part for part in _split(prompt))
        ids = self.tokenizer(prompt)["input_ids"] + [SCORE_TOKEN]
        return MediaText(np.array(ids), tuple(visuals))


def _split(prompt: str) -> list[str]:
    """The prompt with each image's one placeholder as an empty part (its expansion's)."""
    parts = prompt.split("<|image_pad|>")
    return [x for part in parts[:-1] for x in (part, "")] + [parts[-1]]


def test_the_pair_tokenizer_writes_its_formatting(tmp_path):
    model_dir = jina_reranker_m0(tmp_path / "m0", files=True)
    official = Official(model_dir)
    encode = PairTokenizer(model_dir, 8192).encode
    query, documents = "which chart has a legend?", ["a bar chart with a legend", ""]
    ours = encode(query, documents, RerankOptions(), "", ["", image_blocks([6])])
    assert ours[0] == official.pair(query, documents[0]).ids.tolist()
    want = official.tokenizer(
        "**Document**:\n<|vision_start|>"
        + "<|image_pad|>" * 6
        + "<|vision_end|>\n**Query**:\n"
        + query
    )["input_ids"]
    assert ours[1] == want + [SCORE_TOKEN]
    prefixed = encode(query, documents[:1], RerankOptions(instruction="Find charts."))[0]
    assert prefixed == official.tokenizer(
        f"Find charts.\n**Document**:\n{documents[0]}\n**Query**:\n{query}"
    )["input_ids"] + [SCORE_TOKEN]
    # a long document is cut to the tokens that fit, as its script cuts one; the query stays
    long = "a bar chart with a legend and many labelled axes " * 20
    cut = PairTokenizer(model_dir, 40).encode(query, [long], RerankOptions())[0]
    own = official.tokenizer(long)
    keep = next(
        k
        for k in range(len(own["input_ids"]), 0, -1)
        if len(official.pair(query, official.tokenizer.decode(own["input_ids"][:k])).ids) <= 40
    )
    assert (
        cut == official.pair(query, official.tokenizer.decode(own["input_ids"][:keep])).ids.tolist()
    )
    assert len(cut) <= 40 and cut[-1] == SCORE_TOKEN
    with pytest.raises(RequestError, match=r"'DOCUMENTS\[0\]' holds text beside an image"):
        encode(query, ["a caption"], RerankOptions(), "", [image_blocks([4])])
    with pytest.raises(RequestError, match=r"'DOCUMENTS\[0\]' holds several images"):
        encode(query, [""], RerankOptions(), "", [image_blocks([4, 4])])
    with pytest.raises(RequestError, match=r"'QUERY' holds text beside an image"):
        encode(query, [""], RerankOptions(), image_blocks([4]), [""])


# Through Triton: the rerank ensemble writes pairs as its formatting does, with images.


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from qwen_embed_deploy.repository import render
    from qwen_embed_deploy.triton import TritonServer

    where = tmp_path_factory.mktemp("jina-m0-served")
    reranker = jina_reranker_m0(where / "m0", files=True)
    repo = render(
        where / "repo",
        {"embed": qwen3_embedding(where / "embed")},
        {"encoder": {"dtype": "float32"}},
        rerankers={"rerank": reranker},
    )
    with TritonServer(repo, log_path=where / "server.log") as server:
        yield reranker, server


@pytest.mark.server
def test_reranking_through_triton_matches_its_script(served):
    from test_colqwen3 import large_page

    from qwen_embed_client import EmbeddingClient

    model_dir, server = served
    recipe, official = Recipe(model_dir), Official(model_dir)
    files = image_files()
    documents = [("a yellow circle over blue", None), ("", files["png"]), ("", large_page())]
    queries = [("which picture has a yellow circle?", None), ("", files["jpeg"])]
    for query, query_image in queries:
        want = np.array(
            [recipe.score(official.pair(query, d, query_image, im)) for d, im in documents]
        )
        for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
            with EmbeddingClient(url, protocol=protocol) as client:
                got = client.rerank(
                    query,
                    [d for d, _ in documents],
                    query_images=[query_image] if query_image else None,
                    document_images=[[im] if im else [] for _, im in documents],
                )
            assert np.abs(got.scores - want).max() <= 1e-4, (protocol, got.scores, want)
        assert np.ptp(want) > 0.01  # the images move the scores: a check that can fail


@pytest.mark.server
def test_what_it_cannot_read_is_refused_for_that_request(served):
    from qwen_embed_client import EmbeddingClient, EmbeddingError

    _, server = served
    files = image_files()
    with EmbeddingClient(server.grpc_url) as client:
        with pytest.raises(EmbeddingError, match=r"'DOCUMENTS\[0\]' holds text beside an image"):
            client.rerank("q", ["a caption"], document_images=[[files["png"]]])
        with pytest.raises(EmbeddingError, match="'DOCUMENT_VIDEOS' holds videos.*reads images"):
            client.rerank("q", [""], document_videos=[[[files["png"], files["png"]]]])
        assert client.rerank("still served", ["a document"]).scores.shape == (1,)
