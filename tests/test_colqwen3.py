"""ColQwen3 (tomoro-colqwen3-embed): a multi-vector retriever over Qwen3-VL, one vector per
token through its `embedding_proj_layer`, normalised, for late interaction. Against its recipe
written out with transformers' Qwen3-VL on a replica of the published layout
(replicas.colqwen3): in process (token vectors of texts with images and without), and through
Triton with its processor's query and document forms (serving/retrievers.py)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_qwen3_vl import (
    BF16_COSINE,
    FP32_COSINE,
    Texts,
    image_files,
    last_hidden_states,
    official_features,
    tokenizer_of,
    visual_inputs,
)
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from qwen_embed import Encoder
from qwen_embed.config import ModelConfig, UnsupportedModelError
from qwen_embed_deploy.serving.retrievers import ColPaliTemplate

from reference import cosine
from replicas import COLQWEN3_WIDTH, colqwen3, qwen3_vl


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    return colqwen3(tmp_path_factory.mktemp("colqwen3"))


class Recipe:
    """tomoro-colqwen3-embed's modeling written out: Qwen3-VL from the config's text and vision
    parts (its tensors without `vlm.`), the final hidden states of every token through
    `embedding_proj_layer` (a Linear with its bias), each normalised."""

    def __init__(self, model_dir: Path):
        hf = json.loads((model_dir / "config.json").read_text())
        tokens = ("image_token_id", "video_token_id", "vision_start_token_id")
        config = Qwen3VLConfig(
            text_config=hf["text_config"],
            vision_config=hf["vision_config"],
            tie_word_embeddings=hf["text_config"].get("tie_word_embeddings", False),
            **{k: hf[k] for k in tokens + ("vision_end_token_id",)},
        )
        tensors = load_file(model_dir / "model.safetensors")
        self.vlm = Qwen3VLForConditionalGeneration(config).eval()
        backbone = {k[len("vlm.") :]: v for k, v in tensors.items() if k.startswith("vlm.")}
        missing, unexpected = self.vlm.load_state_dict(backbone, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
        self.weight = tensors["embedding_proj_layer.weight"].float()
        self.bias = tensors["embedding_proj_layer.bias"].float()

    def tokens(self, ids, inputs: dict) -> np.ndarray:
        hidden = last_hidden_states(self.vlm, ids, inputs)
        projected = torch.nn.functional.linear(hidden, self.weight, self.bias)
        return (projected / projected.norm(dim=-1, keepdim=True).clamp_min(1e-6)).numpy()


@pytest.fixture(scope="module")
def recipe(replica):
    return Recipe(replica)


def cases(media) -> dict:
    t = Texts(media, seed=3)
    return {
        "text alone": t.text(9),
        "an image alone": t.text(2, t.visual(4, 6), 2),
        "text with an image": t.text(12, t.visual(6, 4), 9),
    }


def test_the_layout_is_a_multi_vector_qwen3_vl(replica, tmp_path):
    config = ModelConfig.from_dir(replica)
    assert config.multi_vector and config.media is not None
    assert config.token_size == config.embedding_size == COLQWEN3_WIDTH
    # the projection and the architecture go together, either way
    plain = qwen3_vl(tmp_path / "plain")
    tensors = load_file(plain / "model.safetensors")
    tensors["embedding_proj_layer.weight"] = torch.zeros(8, 64)
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="projection found"):
        ModelConfig.from_dir(plain)
    bare = colqwen3(tmp_path / "bare")
    tensors = load_file(bare / "model.safetensors")
    del tensors["embedding_proj_layer.weight"], tensors["embedding_proj_layer.bias"]
    save_file(tensors, bare / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="projection absent"):
        ModelConfig.from_dir(bare)


@pytest.mark.server  # whole-model runs against transformers': seconds
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_vectors_match_the_recipe(replica, recipe, dtype):
    config = ModelConfig.from_dir(replica)
    texts = cases(config.media)
    want = {name: recipe.tokens(t.ids, visual_inputs(t)) for name, t in texts.items()}
    floor = FP32_COSINE if dtype == "float32" else BF16_COSINE
    with Encoder.from_pretrained(replica, dtype=dtype, max_batch_tokens=64) as enc:
        # every token is computed: no prefix cache kept, no last layer planned pruned
        assert not enc.route.prefix_reuse and not enc.route.prune
        got = dict(zip(texts, enc.embed_tokens(list(texts.values())), strict=True))
        plain = enc.embed_tokens([texts["text alone"].ids])[0]  # ids alone, no media path
        with pytest.raises(ValueError, match="multi-vector retriever"):
            enc.embed([texts["text alone"].ids])
        short = enc.embed_tokens([texts["text alone"].ids], dimensions=8)[0]
        with pytest.raises(ValueError, match=rf"in 1\.\.{COLQWEN3_WIDTH}"):
            enc.embed_tokens([[5, 6]], dimensions=COLQWEN3_WIDTH + 1)
    for name, vectors in got.items():
        assert vectors.shape == (len(texts[name].ids), COLQWEN3_WIDTH), name
        assert cosine(vectors, want[name]).min() >= floor, name
    assert cosine(plain, want["text alone"]).min() >= floor
    assert short.shape == (9, 8)
    assert np.allclose(np.linalg.norm(short, axis=1), 1, atol=1e-5)
    # the image moves the tokens after it: a check that can fail
    after = slice(-9, None)
    alone = recipe.tokens(texts["text with an image"].ids[after], {})
    assert cosine(got["text with an image"][after], alone).min() < 0.99


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_token_vectors_on_a_gpu_match_the_recipe(replica, recipe):
    """bf16 on the GPU (a text alone through the CUDA graphs, the others through the tower)
    against the recipe in fp32 on the CPU."""
    assert_gpu_tokens(replica, recipe, cases(ModelConfig.from_dir(replica).media))


def assert_gpu_tokens(replica, recipe, texts: dict) -> None:
    """bf16 token vectors on the GPU (`texts`' "text alone" also through the CUDA graphs)
    against `recipe.tokens` in fp32 on the CPU."""
    want = [recipe.tokens(t.ids, visual_inputs(t)) for t in texts.values()]
    with Encoder.from_pretrained(replica, dtype="bfloat16", device="cuda") as enc:
        got = enc.embed_tokens(list(texts.values()))
        got[list(texts).index("text alone")] = enc.embed_tokens([texts["text alone"].ids])[0]
    for vectors, expected in zip(got, want, strict=True):
        assert cosine(vectors, expected).min() >= BF16_COSINE


def test_only_embedding_is_its_task(replica):
    with pytest.raises(ValueError, match="multi-vector retriever only embeds"):
        Encoder.from_pretrained(replica, dtype="float32", task="rerank")


def test_the_processor_forms(tmp_path):
    template = ColPaliTemplate.from_dir(tmp_path, "<|endoftext|>")
    assert template.parts(None, "", False, "  a query \n") == ("", "a query", "<|endoftext|>" * 10)
    image = "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>"
    assert template.parts(None, image, False, " a page ") == (
        f"<|im_start|>user\n{image}Describe the image. ",
        "a page",
        "<|im_end|><|endoftext|>",
    )
    assert template.parts(None, image, False, "")[0].endswith("Describe the image.")
    (tmp_path / "processor_config.json").write_text(
        json.dumps({"query_prefix": "Query: ", "visual_prompt_suffix": "<|im_end|>"})
    )
    changed = ColPaliTemplate.from_dir(tmp_path, "<pad>")
    assert changed.parts(None, "", False, "q") == ("Query: ", "q", "<pad>" * 10)
    assert changed.parts(None, image, False, "")[2] == "<|im_end|>"
    with pytest.raises(ValueError, match="no pad_token"):
        ColPaliTemplate.from_dir(tmp_path, None)


# Through Triton: the tokenizer writes queries and image documents as the processor does and
# resizes images within its budget; the encoder runs the tower and the projection.


def official_query(text: str) -> str:
    return text.strip() + "<|endoftext|>" * 10


def official_document(text: str, pads: str) -> str:
    text = text.strip()
    body = f" {text}" if text else ""
    return f"<|im_start|>user\n{pads}Describe the image.{body}<|im_end|><|endoftext|>"


# The processor's budget in the replica's tokens of 8 x 8 pixels: preprocessor_config.json's
# least size, 1,280 tokens at most (max_num_visual_tokens)
COLPALI_PIXELS = {"shortest_edge": 4096, "longest_edge": 1280 * 8 * 8}


def official_tokens(recipe, model_dir, text: str, images: list[bytes]) -> np.ndarray:
    inputs, pads = official_features(images, COLPALI_PIXELS)
    prompt = official_document(text, pads[0]) if images else official_query(text)
    return recipe.tokens(tokenizer_of(model_dir).encode(prompt).ids, inputs)


def serving(where: Path, replica):
    """A server of `replica(dir, files=True)` as the embed model, fp32: (its dir, the server)."""
    from qwen_embed_deploy.repository import render
    from qwen_embed_deploy.triton import TritonServer

    model_dir = replica(where / "model", files=True)
    repo = render(where / "repo", {"embed": model_dir}, {"encoder": {"dtype": "float32"}})
    with TritonServer(repo, log_path=where / "server.log") as server:
        yield model_dir, server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("colqwen3-served"), colqwen3)


def large_page() -> bytes:
    """A page larger than the processor's budget: resized down to at most 1,280 tokens."""
    import io

    from PIL import Image, ImageDraw

    image = Image.new("RGB", (420, 300), (240, 240, 235))
    draw = ImageDraw.Draw(image)
    for row in range(12):
        draw.rectangle((20, 20 + 22 * row, 400 - 15 * row, 32 + 22 * row), fill=(20, 20, 20))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


@pytest.mark.server
def test_queries_and_pages_through_triton_match_the_official_recipe(served):
    model_dir, server = served
    recipe = Recipe(model_dir)
    inputs = pages()
    want = [official_tokens(recipe, model_dir, t, im) for t, im in inputs]
    assert want[3].shape[0] > 1000  # the budget bit: 1,280 image tokens at most, and used
    assert_served_tokens(server, inputs, want)


def pages() -> list[tuple[str, list[bytes]]]:
    """A query, then pages: an image alone, one with its text, one over ColQwen3's budget."""
    files = image_files()
    return [
        ("which chart shows a yellow circle?", []),
        ("", [files["png"]]),
        ("quarterly report, page 2", [files["jpeg"]]),
        ("", [large_page()]),
    ]


def assert_served_tokens(server, inputs: list, want: list[np.ndarray]) -> None:
    """The server's token vectors of `inputs` (text, images) over HTTP and gRPC are `want`'s
    (fp32 floor per token), and so are the query's MaxSim scores against the pages."""
    from qwen_embed_client import EmbeddingClient, maxsim_scores

    for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
        with EmbeddingClient(url, protocol=protocol) as client:
            got = client.embed_tokens([t for t, _ in inputs], images=[im for _, im in inputs])
        for i, (vectors, expected) in enumerate(zip(got, want, strict=True)):
            assert vectors.shape == expected.shape, (protocol, i)
            assert cosine(vectors, expected).min() >= FP32_COSINE, (protocol, i)
        scores = maxsim_scores(got[0], got[1:])
        expected = maxsim_scores(want[0], want[1:])
        assert np.abs(scores - expected).max() <= 1e-3 * len(want[0])
    assert np.ptp(expected) > 0.01  # the pages score apart: a check that can fail


@pytest.mark.server
def test_what_it_cannot_answer_is_refused_for_that_request(served):
    from qwen_embed_client import EmbeddingClient, EmbeddingError

    model_dir, server = served
    files = image_files()
    with EmbeddingClient(server.grpc_url) as client:
        with pytest.raises(EmbeddingError, match="multi-vector retriever.*'per_token'"):
            client.embed(["a query"])
        with pytest.raises(EmbeddingError, match=r"'IMAGES\[0\]' holds 2 images.*1 per text"):
            client.embed_tokens(["two"], images=[[files["png"], files["jpeg"]]])
        with pytest.raises(EmbeddingError, match="input 'VIDEOS' holds videos.*texts and images"):
            client.embed_tokens(["a clip"], videos=[[[files["png"], files["png"]]]])
        with pytest.raises(EmbeddingError, match="'instruction' is not read by this model"):
            client.embed_tokens(["a query"], instruction="Find charts")
        rows = len(tokenizer_of(model_dir).encode("still served").ids) + 10
        assert client.embed_tokens(["still served"])[0].shape == (rows, COLQWEN3_WIDTH)


@pytest.mark.server
def test_late_interaction_through_the_gateway(served):
    """vLLM's score API scores by MaxSim over the model's token vectors, texts and pages
    given as image parts (its {"content": [parts]}: one document per part, or one input per
    item), its pooling API's token_embed answers them; OpenAI's embeddings, which want one
    vector per input, are a 400 naming per_token."""
    import base64

    import httpx
    from test_qwen3_vl import data_url

    from qwen_embed_client import EmbeddingClient, maxsim_scores

    from triton_helpers import gateway_process

    _, server = served
    files = image_files()
    query, documents = "a yellow circle", ["a blue square", "yellow circles on a page"]
    with EmbeddingClient(server.grpc_url) as client:
        vectors = client.embed_tokens([query, *documents])
        page = client.embed_tokens([""], images=[[files["png"]]])[0]
        chart, bare_chart = client.embed_tokens(
            ["the chart", ""], images=[[files["jpeg"]], [files["jpeg"]]]
        )
    want = maxsim_scores(vectors[0], vectors[1:])
    image_part = {"type": "image_url", "image_url": {"url": data_url(files["png"])}}
    chart_parts = [
        {"type": "text", "text": "the chart"},
        {"type": "image_url", "image_url": {"url": data_url(files["jpeg"], "jpeg")}},
    ]
    pages = maxsim_scores(vectors[0], [page, chart])
    bare_pages = maxsim_scores(vectors[0], [page, bare_chart])
    assert chart.shape[0] > bare_chart.shape[0]  # the text's tokens: one page is not the other
    with gateway_process(server) as base:
        for text_2, want_pages in (
            ({"content": [image_part, chart_parts[1]]}, bare_pages),  # a document per part
            ([{"content": [image_part]}, {"content": chart_parts}], pages),
            ([[image_part], chart_parts], pages),
        ):
            body = {"model": "embed", "text_1": query, "text_2": text_2}
            scored = httpx.post(f"{base}/v1/score", json=body, timeout=60)
            assert scored.status_code == 200, scored.text
            got = np.array([d["score"] for d in scored.json()["data"]])
            assert np.abs(got - want_pages).max() <= 1e-4, (text_2, got, want_pages)
        scored = httpx.post(
            f"{base}/v1/score",
            json={"model": "embed", "text_1": query, "text_2": documents},
            timeout=60,
        )
        assert scored.status_code == 200, scored.text
        got = np.array([d["score"] for d in scored.json()["data"]])
        assert np.abs(got - want).max() <= 1e-4
        for inputs, want_tokens in (([[image_part]], page), ([query], vectors[0])):
            body = {"model": "embed", "task": "token_embed", "input": inputs, "priority": "bulk"}
            pooled = httpx.post(f"{base}/pooling", json=body, timeout=60)
            assert pooled.status_code == 200, pooled.text
            tokens = np.array(pooled.json()["data"][0]["data"], dtype=np.float32)
            assert cosine(tokens, want_tokens).min() >= FP32_COSINE
        # /v1/rerank with the embed model: its own ranking, MaxSim best first (vLLM's)
        body = {"model": "embed", "query": query, "documents": [[image_part], chart_parts]}
        ranked = httpx.post(f"{base}/v1/rerank", json=body | {"return_documents": True}, timeout=60)
        assert ranked.status_code == 200, ranked.text
        results = ranked.json()["results"]
        assert [r["index"] for r in results] == list(np.argsort(-pages, kind="stable"))
        assert np.abs([r["relevance_score"] for r in results] - np.sort(pages)[::-1]).max() < 1e-4
        assert results[[r["index"] for r in results].index(1)]["document"]["text"] == "the chart"
        top = httpx.post(
            f"{base}/v1/rerank", json=body | {"top_n": 1, "max_tokens_per_doc": 8}, timeout=60
        )
        assert top.status_code == 400 and "max_tokens_per_doc" in top.text, top.text
        one = httpx.post(f"{base}/v1/rerank", json=body | {"top_n": 1}, timeout=60)
        assert len(one.json()["results"]) == 1
        bad = httpx.post(f"{base}/v1/rerank", json=body | {"top_n": -1}, timeout=60)
        assert bad.status_code == 400 and "top_n" in bad.text, bad.text
        (entry,) = httpx.get(f"{base}/v1/models", timeout=60).json()["data"]
        assert entry["multi_vector"] is True
        # Jina's v4 form (what RAGFlow's JinaMultiVecEmbed sends): an image by its base64 bytes
        body = {"input": [query, {"image": base64.b64encode(files["png"]).decode()}]}
        body |= {"task": "retrieval.passage", "truncate": True, "return_multivector": True}
        answer = httpx.post(f"{base}/v1/embeddings", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        for item, want_tokens in zip(answer.json()["data"], (vectors[0], page), strict=True):
            assert cosine(np.array(item["embeddings"]), want_tokens).min() >= FP32_COSINE
        refused = httpx.post(f"{base}/v1/embeddings", json={"input": "q"}, timeout=60)
        assert refused.status_code == 400 and "per_token" in refused.text, refused.text


@pytest.mark.server
def test_the_cli_writes_a_pages_token_vectors(served, tmp_path):
    import subprocess
    import sys

    model_dir, server = served
    files = image_files()
    want = official_tokens(Recipe(model_dir), model_dir, "page 1", [files["png"]])
    (tmp_path / "page.png").write_bytes(files["png"])
    out = tmp_path / "page.jsonl"
    command = [sys.executable, "-m", "qwen_embed_client", "embed", "page 1", "--per-token"]
    command += ["--image", str(tmp_path / "page.png"), "--url", server.grpc_url, "-o", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (line,) = out.read_text().splitlines()
    record = json.loads(line)
    assert record["tokens"] == len(want)
    assert cosine(np.array(record["embeddings"], dtype=np.float32), want).min() >= FP32_COSINE
