"""jina-embeddings-v4: a Qwen2.5-VL embedder with its task adapters (three tasks' LoRA pairs in
one adapter), a mean of every token of a text, of an image's span for an image, and a
projection of every token for its multi-vector side. On a replica of the published layout
(replicas.jina_embeddings_v4), against its remote code's recipe written out with
transformers' Qwen2.5-VL: the adapter's pairs added to each adapted layer's output (its
MultiAdapterLinear's forward, unmerged), the three-axis positions (ids and image grids
given), `get_single_vector_embeddings` and `get_multi_vector_embeddings`."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_colqwen3 import large_page
from test_qwen3_vl import BF16_COSINE, FP32_COSINE, Texts, image_files, visual_inputs
from transformers import Qwen2_5_VLForConditionalGeneration

from qwen_embed import Encoder
from qwen_embed.adapters import AdapterError, adapter_names, read_lora
from qwen_embed.config import ModelConfig
from qwen_embed.media import MediaText
from qwen_embed_client.contract import RequestError
from qwen_embed_deploy.serving.retrievers import JinaV4Template

from reference import cosine
from replicas import JINA_V4_TASKS, JINA_V4_WIDTH, jina_embeddings_v4

IMAGE_TURN = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image.<|im_end|>\n"
)


def least_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The least cosine of vectors (or rows) a with b's."""
    return float(cosine(np.atleast_2d(a), np.atleast_2d(b)).min())


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    return jina_embeddings_v4(tmp_path_factory.mktemp("jina-v4"))


class Recipe:
    """The remote code's forward with one task's adapter: transformers' Qwen2.5-VL from the
    directory (its first layout's tensors mapped by from_pretrained), each adapted layer's
    output plus scale * B(A(x)), the projector's too; a text's last hidden states given its
    ids and image grids."""

    def __init__(self, model_dir, task: str | None):
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()
        tensors = load_file(model_dir / "model.safetensors")
        self.projector = torch.nn.Linear(*tensors["multi_vector_projector.weight"].T.shape)
        with torch.no_grad():
            self.projector.weight.copy_(tensors["multi_vector_projector.weight"].float())
            self.projector.bias.copy_(tensors["multi_vector_projector.bias"].float())
        if task is None:
            return
        lora = json.loads((model_dir / "adapters" / "adapter_config.json").read_text())
        scale = lora["lora_alpha"] / lora["r"]
        pairs = load_file(model_dir / "adapters" / "adapter_model.safetensors")
        modules = dict(self.model.named_modules(), multi_vector_projector=self.projector)
        for key, a in pairs.items():
            name, _, part = key.removeprefix("base_model.model.").rpartition(".lora_")
            if part == f"A.{task}.weight":
                b = pairs[key.replace(".lora_A.", ".lora_B.")]
                modules[name].register_forward_hook(
                    lambda m, args, out, a=a, b=b: out + scale * F.linear(F.linear(args[0], a), b)
                )

    def hidden(self, text: MediaText) -> torch.Tensor:
        config = self.model.config
        ids = torch.as_tensor(np.asarray(text.ids))[None]
        types = (ids == config.image_token_id).int()
        inputs = visual_inputs(text)
        with torch.no_grad():
            out = self.model.model(input_ids=ids, mm_token_type_ids=types, **inputs)
        return out.last_hidden_state[0]

    def pooled(self, text: MediaText) -> np.ndarray:
        """get_single_vector_embeddings: an image's span, vision start to end, else all."""
        hidden, ids, config = self.hidden(text), np.asarray(text.ids), self.model.config
        if config.vision_start_token_id in ids:
            start = int(np.flatnonzero(ids == config.vision_start_token_id)[0])
            end = int(np.flatnonzero(ids == config.vision_end_token_id)[0])
            hidden = hidden[start : end + 1]
        return F.normalize(hidden.mean(0), dim=-1).numpy()

    def tokens(self, text: MediaText) -> np.ndarray:
        """get_multi_vector_embeddings: every token projected, normalised."""
        with torch.no_grad():
            return F.normalize(self.projector(self.hidden(text)), dim=-1).numpy()


def cases(media) -> dict[str, MediaText]:
    """A text, images in the processor's turn (several windows of the tower, the last ones
    partial), and an image between texts (the engine's mean of its span)."""
    t = Texts(media, seed=7)
    return {
        "text alone": t.text(11),
        "an image": t.text(3, t.visual(6, 10), 7),
        "another image": t.text(3, t.visual(10, 4), 7),
        "an image between texts": t.text(9, t.visual(4, 4), 12),
    }


def test_the_layout_reads_as_published(replica):
    config = ModelConfig.from_dir(replica)
    assert config.family == "qwen2" and config.is_causal and not config.multi_vector
    assert config.media.vision.generation == "qwen2_5_vl" and not config.media.mrope_interleaved
    assert config.sentence.pooling == "mean" and config.visual_span_mean
    assert config.embedding_size == 128 and config.token_size == JINA_V4_WIDTH
    assert config.adapters == tuple(sorted(JINA_V4_TASKS)) == tuple(adapter_names(replica))
    pairs, scale = read_lora(replica / "adapters", "code")
    assert scale == 2.0
    assert {"layers.1.self_attn.q_proj.weight", "visual.blocks.0.mlp.gate_proj.weight"} <= set(
        pairs
    )
    assert "multi_vector_projector.weight" in pairs
    with pytest.raises(AdapterError, match="read one task at a time"):
        read_lora(replica / "adapters")


@pytest.mark.server  # whole-model runs against transformers': seconds
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vectors_match_the_recipe(replica, dtype):
    """The default adapter (retrieval): pooled and per-token vectors of texts and images."""
    recipe = Recipe(replica, "retrieval")
    texts = cases(ModelConfig.from_dir(replica).media)
    floor = FP32_COSINE if dtype == "float32" else BF16_COSINE
    with Encoder.from_pretrained(replica, dtype=dtype, max_batch_tokens=96) as enc:
        assert enc.route.adapter == "retrieval" and enc.route.pooling == "mean"
        pooled = enc.embed_media(list(texts.values()))
        plain = enc.embed([texts["text alone"].ids])[0]  # ids alone: no media path
        tokens = enc.embed_tokens(list(texts.values()))
        short = enc.embed_media([texts["an image"]], dimensions=8)[0]
    for (name, text), got in zip(texts.items(), pooled, strict=True):
        assert least_cosine(got, recipe.pooled(text)) >= floor, name
    assert least_cosine(plain, recipe.pooled(texts["text alone"])) >= floor
    for (name, text), got in zip(texts.items(), tokens, strict=True):
        assert got.shape == (len(text.ids), JINA_V4_WIDTH), name
        assert least_cosine(got, recipe.tokens(text)) >= floor, name
    # Matryoshka: the first dimensions, normalised again (its encode's truncate_dim)
    want = recipe.pooled(texts["an image"])[:8]
    assert least_cosine(short, want / np.linalg.norm(want)) >= floor
    # the image's span, not the whole text: a check that can fail
    whole = F.normalize(recipe.hidden(texts["an image between texts"]).mean(0), dim=-1)
    assert least_cosine(pooled[3], whole.numpy()) < 0.99


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vectors_on_a_gpu_match_the_recipe(replica):
    """bf16 on the GPU (a text alone also through the CUDA graphs, the others through the
    tower) against the recipe in fp32 on the CPU: pooled and per-token vectors."""
    recipe = Recipe(replica, "retrieval")
    texts = cases(ModelConfig.from_dir(replica).media)
    with Encoder.from_pretrained(replica, dtype="bfloat16", device="cuda") as enc:
        pooled = enc.embed_media(list(texts.values()))
        plain = enc.embed([texts["text alone"].ids])[0]
        tokens = enc.embed_tokens(list(texts.values()))
    for (name, text), got, got_tokens in zip(texts.items(), pooled, tokens, strict=True):
        assert least_cosine(got, recipe.pooled(text)) >= BF16_COSINE, name
        assert least_cosine(got_tokens, recipe.tokens(text)) >= BF16_COSINE, name
    assert least_cosine(plain, recipe.pooled(texts["text alone"])) >= BF16_COSINE


@pytest.mark.server
def test_each_task_is_its_adapter(replica):
    """A deployment per task merges that task's pairs (the tower's and the projector's too);
    the tasks' vectors differ."""
    text = cases(ModelConfig.from_dir(replica).media)["an image"]
    got = {}
    for task in ("text-matching", "code"):
        recipe = Recipe(replica, task)
        with Encoder.from_pretrained(replica, dtype="float32", adapter=task) as enc:
            got[task] = enc.embed_media([text])[0]
            tokens = enc.embed_tokens([text])[0]
        assert least_cosine(got[task], recipe.pooled(text)) >= FP32_COSINE, task
        assert least_cosine(tokens, recipe.tokens(text)) >= FP32_COSINE, task
    assert least_cosine(got["text-matching"], got["code"]) < 0.99


@pytest.mark.server  # starts a tensor-parallel worker
def test_each_request_names_its_task(replica):
    """One deployment keeping the three tasks per request (`lora_modules`): texts and images
    of every task (and of none: the base) in one forward, pooled and per token, are what a
    deployment merging that task gives them: its pairs on the text model, on the tower (per
    image: the same image under two tasks goes through the tower twice) and on the projector."""
    media = ModelConfig.from_dir(replica).media
    texts = list(cases(media).values())
    texts += [texts[1], texts[1]]  # one image under several tasks
    names = ["code", "retrieval", "text-matching", None, "code", "retrieval"]
    settings = {"dtype": "float32", "max_batch_tokens": 4096}
    merged = {}
    for task in ("retrieval", "text-matching", "code", "none"):
        with Encoder.from_pretrained(replica, adapter=task, **settings) as enc:
            merged[task] = enc.embed_media(texts), enc.embed_tokens(texts)
    with Encoder.from_pretrained(
        replica, lora_modules="retrieval,text-matching,code", **settings
    ) as enc:
        assert enc.adapters == ("retrieval", "text-matching", "code")
        assert enc.route.adapter is None
        patches = []
        tower = enc.model.visual
        run = tower.forward
        tower.forward = lambda pixels, grids: patches.append(len(pixels)) or run(pixels, grids)
        pooled = enc.embed_media(texts, adapter=names)
        tokens = enc.embed_tokens(texts, adapter=names)
        plain = enc.embed([texts[0].ids], adapter="code")[0]
    image = [len(v.pixels) for v in texts[1].visuals][0]
    others = sum(len(v.pixels) for t in texts[2:4] for v in t.visuals)
    # the image of texts 1, 4 and 5 once per task: retrieval's (1 and 5) and code's (4)
    assert patches == [2 * image + others] * 2
    for i, name in enumerate(names):
        want, want_tokens = merged[name or "none"]
        assert least_cosine(pooled[i], want[i]) >= 0.99999, (i, name)
        assert least_cosine(tokens[i], want_tokens[i]) >= 0.99999, (i, name)
    assert least_cosine(plain, merged["code"][0][0]) >= 0.99999
    assert least_cosine(pooled[1], pooled[5]) >= 0.99999
    assert least_cosine(pooled[1], pooled[4]) < 0.99  # the tasks differ: this can fail
    with pytest.raises(AdapterError, match=r"sql is none of the tasks .*\['code', "):
        Encoder.from_pretrained(replica, lora_modules="retrieval,sql", **settings)
    # two ranks: rank 1 holds neither the tower nor the projector, and leaves their pairs
    with Encoder.from_pretrained(
        replica, lora_modules="retrieval,text-matching,code", tp_size=2, **settings
    ) as enc:
        assert np.abs(enc.embed_media(texts, adapter=names) - pooled).max() <= 1e-5
        for got, want in zip(enc.embed_tokens(texts, adapter=names), tokens, strict=True):
            assert np.abs(got - want).max() <= 1e-5


def test_the_processor_forms():
    template = JinaV4Template()
    assert template.parts("Query: ", "", False, "a question") == ("Query: ", "a question", "")
    image = "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>"
    turn = IMAGE_TURN.replace("<|vision_start|><|image_pad|><|vision_end|>", image)
    assert template.parts("Query: ", image, False, "") == (turn, "", "")
    with pytest.raises(RequestError, match="embeds an image alone"):
        template.parts("Query: ", image, False, "a caption")


# Through Triton: texts after its prompts, images in its processor's turn and budget.


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server of the replica twice: `embed` merging its default task, `tasks` keeping the
    three per request (`lora_modules`)."""
    from qwen_embed_deploy.repository import render
    from qwen_embed_deploy.triton import TritonServer

    where = tmp_path_factory.mktemp("jina-v4-served")
    model_dir = jina_embeddings_v4(where / "model", files=True)
    overrides = {
        "encoder": {"dtype": "float32"},
        "tasks.encoder": {"lora_modules": "retrieval,text-matching,code"},
    }
    repo = render(where / "repo", {"embed": model_dir, "tasks": model_dir}, overrides)
    with TritonServer(repo, log_path=where / "server.log") as server:
        yield model_dir, server


@pytest.mark.server
def test_each_request_names_its_task_through_triton(served):
    """Triton's `adapter` picks a task per request (Jina's `task` on the gateway sends it as
    jina-embeddings-v5's does: test_vendor_embedders.py): texts, images and per-token
    vectors as the recipe with that task's adapter computes them."""
    from qwen_embed_client import EmbeddingClient

    model_dir, server = served
    processor, files = Processor(model_dir), image_files()
    recipes = {task: Recipe(model_dir, task) for task in ("retrieval", "text-matching", "code")}
    query, image = "which chart shows a yellow circle?", processor.image(files["png"])
    with EmbeddingClient(server.grpc_url, model="tasks") as client:
        for task, recipe in recipes.items():
            want = recipe.pooled(processor.text(f"Query: {query}"))
            assert least_cosine(client.embed([query], adapter=task)[0], want) >= FP32_COSINE
            got = client.embed([""], images=[[files["png"]]], adapter=task)[0]
            assert least_cosine(got, recipe.pooled(image)) >= FP32_COSINE, task
            got = client.embed_tokens([""], images=[[files["png"]]], adapter=task)[0]
            assert least_cosine(got, recipe.tokens(image)) >= FP32_COSINE, task
    assert least_cosine(recipes["code"].pooled(image), recipes["retrieval"].pooled(image)) < 0.99


class Processor:
    """Its processor (Qwen2.5-VL's, which JinaEmbeddingsV4Processor extends) from the served
    directory: its tokenizer, and its image processor (Qwen2-VL's, the resizing to its
    budget) with each image's placeholder repeated for its merged patches."""

    def __init__(self, model_dir):
        from transformers import AutoTokenizer, Qwen2VLImageProcessor

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.images = Qwen2VLImageProcessor.from_pretrained(model_dir)

    def text(self, text: str) -> MediaText:
        """process_texts: `{prefix}: {text}`, as the tokenizer reads it."""
        return MediaText(np.array(self.tokenizer(text)["input_ids"]))

    def image(self, data: bytes) -> MediaText:
        """process_images: its turn, the image's pixels and grid."""
        import io

        from PIL import Image

        from qwen_embed.media import Visual

        picture = Image.open(io.BytesIO(data)).convert("RGB")
        batch = self.images(images=[picture], return_tensors="np")
        grid = tuple(int(g) for g in batch["image_grid_thw"][0])
        pads = "<|image_pad|>" * (int(np.prod(grid)) // self.images.merge_size**2)
        ids = self.tokenizer(IMAGE_TURN.replace("<|image_pad|>", pads))["input_ids"]
        visual = Visual(batch["pixel_values"].astype(np.float32), grid)
        return MediaText(np.array(ids), (visual,))


@pytest.mark.server
def test_texts_and_images_through_triton_match_the_official_processor(served):
    from qwen_embed_client import EmbeddingClient

    model_dir, server = served
    recipe, processor = Recipe(model_dir, "retrieval"), Processor(model_dir)
    files = image_files()
    queries = ["which chart shows a yellow circle?", "a red square"]
    want_queries = [recipe.pooled(processor.text(f"Query: {q}")) for q in queries]
    passage = recipe.pooled(processor.text(f"Passage: {queries[0]}"))
    images = [files["png"], files["jpeg"], large_page()]
    want_images = [processor.image(im) for im in images]
    (_, rows, columns) = want_images[2].visuals[0].grid
    assert 50 < rows * columns // 4 <= 60  # resized into its budget of 60 tokens
    for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
        with EmbeddingClient(url, protocol=protocol) as client:
            got = client.embed(queries)
            got_passage = client.embed(queries[:1], prompt_name="document")[0]
            got_images = client.embed([""] * len(images), images=[[im] for im in images])
            got_tokens = client.embed_tokens([""], images=[[images[0]]])[0]
        for vector, want in zip(got, want_queries, strict=True):
            assert least_cosine(vector, want) >= FP32_COSINE, protocol
        assert least_cosine(got_passage, passage) >= FP32_COSINE, protocol
        for vector, text in zip(got_images, want_images, strict=True):
            assert least_cosine(vector, recipe.pooled(text)) >= FP32_COSINE, protocol
        assert least_cosine(got_tokens, recipe.tokens(want_images[0])) >= FP32_COSINE
    assert least_cosine(got_passage, want_queries[0]) < 0.999  # its prompts tell them apart


@pytest.mark.server
def test_what_it_cannot_answer_is_refused_for_that_request(served):
    from qwen_embed_client import EmbeddingClient, EmbeddingError

    _, server = served
    files = image_files()
    with EmbeddingClient(server.grpc_url) as client:
        with pytest.raises(EmbeddingError, match=r"input 'TEXT\[0\]' holds text beside its"):
            client.embed(["a caption"], images=[[files["png"]]])
        with pytest.raises(EmbeddingError, match=r"'IMAGES\[0\]' holds 2 images.*1 per text"):
            client.embed([""], images=[[files["png"], files["jpeg"]]])
        with pytest.raises(EmbeddingError, match="input 'VIDEOS' holds videos.*texts and images"):
            client.embed(["a clip"], videos=[[[files["png"], files["png"]]]])
        assert client.embed(["still served"]).shape == (1, 128)


@pytest.mark.server
def test_its_apis_through_the_gateway(served):
    """OpenAI's content parts (an image as a data URL), Jina's fields (`task` picking its
    prompts, the merged task's only; `return_multivector` its per-token vectors) answer what
    the client gets from Triton."""
    import httpx
    from test_qwen3_vl import data_url

    from qwen_embed_client import EmbeddingClient

    from triton_helpers import gateway_process

    _, server = served
    files = image_files()
    query = "a yellow circle"
    with EmbeddingClient(server.grpc_url) as client:
        want_query, want_passage = (
            client.embed([query]),
            client.embed([query], prompt_name="passage"),
        )
        want_image = client.embed([""], images=[[files["png"]]])[0]
        want_tokens = client.embed_tokens([""], images=[[files["png"]]])[0]
    image_part = {"type": "image_url", "image_url": {"url": data_url(files["png"])}}

    def vectors(answer) -> np.ndarray:
        assert answer.status_code == 200, answer.text
        return np.array([d["embedding"] for d in answer.json()["data"]], dtype=np.float32)

    with gateway_process(server) as base:
        body = {"model": "embed", "input": [[image_part]]}
        got = vectors(httpx.post(f"{base}/v1/embeddings", json=body, timeout=60))
        assert least_cosine(got, want_image) >= FP32_COSINE
        for task, want in (("retrieval.query", want_query), ("retrieval.passage", want_passage)):
            body = {"model": "embed", "input": [query], "task": task}
            got = vectors(httpx.post(f"{base}/v1/embeddings", json=body, timeout=60))
            assert least_cosine(got, want) >= FP32_COSINE, task
        body = {"model": "embed", "input": [query], "task": "text-matching"}
        refused = httpx.post(f"{base}/v1/embeddings", json=body, timeout=60)
        assert refused.status_code == 400 and "merged 'retrieval'" in refused.text, refused.text
        body = {"input": [[image_part]], "task": "retrieval.passage", "return_multivector": True}
        answer = httpx.post(f"{base}/v1/embeddings", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        tokens = np.array(answer.json()["data"][0]["embeddings"], dtype=np.float32)
        assert tokens.shape == want_tokens.shape
        assert least_cosine(tokens, want_tokens) >= FP32_COSINE
    assert least_cosine(want_query, want_passage) < 0.999  # the tasks' prompts differ
