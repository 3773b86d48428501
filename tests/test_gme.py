"""GME (gme-Qwen2-VL-Instruct): a Qwen2-VL embedder whose script feeds the text model token
embeddings alone, so that every token, an image's too, takes the next position on all three
rotary axes; the last token's state, normalised. On replicas of its published layouts
(replicas.gme: Qwen2-VL's own architecture with its script beside the weights, and its later
GmeQwen2VL saves), against its script's forward written out with transformers' Qwen2-VL, and
its script's inputs: `embed`'s chat turn (the instruction its system turn, the image before
the text, <|endoftext|> after the assistant's turn begun), `fetch_image`'s resize to whole
blocks, then its processor's at 256 to 1,280 tokens per image."""

import io
import math

import numpy as np
import pytest
import torch
from test_qwen3_vl import Texts, image_files, visual_inputs
from transformers import Qwen2VLForConditionalGeneration

from qwen_embed import Encoder
from qwen_embed.config import ModelConfig, UnsupportedModelError
from qwen_embed.media import MediaText, Visual
from qwen_embed_client.contract import EmbedOptions
from qwen_embed_deploy.serving.images import ImageSettings, decode, patchify, resized
from qwen_embed_deploy.serving.tokenizer import TextTokenizer, image_blocks

from replicas import gme

DEFAULT_INSTRUCTION = "You are a helpful assistant."


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    return gme(tmp_path_factory.mktemp("gme"))


class Recipe:
    """GmeQwen2VL.forward: the token embeddings with the tower's features at the image's
    placeholders, through the text model with no positions given (transformers before 4.52
    counts them in sequence on every axis: given so here), the last token's state
    normalised."""

    def __init__(self, model_dir):
        self.model = Qwen2VLForConditionalGeneration.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()

    def vector(self, text: MediaText, axes: bool = False) -> np.ndarray:
        """`axes`: positions on three axes instead (Qwen2-VL's own, DSE's): not GME's."""
        model, ids = self.model, torch.as_tensor(np.asarray(text.ids))[None]
        with torch.no_grad():
            if axes:
                types = (ids == model.config.image_token_id).int()
                out = model.model(input_ids=ids, mm_token_type_ids=types, **visual_inputs(text))
            else:
                embeds = model.get_input_embeddings()(ids)
                if text.visuals:
                    inputs = visual_inputs(text)
                    features = model.model.get_image_features(
                        inputs["pixel_values"], inputs["image_grid_thw"]
                    ).pooler_output
                    embeds[ids == model.config.image_token_id] = torch.cat(list(features))
                positions = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
                out = model.model.language_model(inputs_embeds=embeds, position_ids=positions)
            hidden = out.last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden, dim=-1).numpy()


def test_the_layouts_are_gme_and_qwen2_vl_alone_is_refused(replica, tmp_path):
    config = ModelConfig.from_dir(replica)
    assert config.family == "qwen2" and config.is_causal and config.media.sequential_positions
    assert config.media.vision.generation == "qwen2_vl" and not config.media.reads_video
    later = ModelConfig.from_dir(gme(tmp_path / "later", image_tokens=(16, 60)))
    assert later.media.sequential_positions
    with Encoder.from_pretrained(replica, dtype="float32") as enc:
        assert enc.task == "embed" and enc.route.pooling == "last"
    (replica / "gme_inference.py").rename(tmp_path / "moved.py")
    try:  # Qwen2-VL's own architecture without GME's script: which numbering is not told
        with pytest.raises(UnsupportedModelError, match="GME checkpoint.*gme_inference.py"):
            ModelConfig.from_dir(replica)
    finally:
        (tmp_path / "moved.py").rename(replica / "gme_inference.py")


@pytest.mark.server  # whole-model runs against transformers': seconds
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vectors_match_its_script(replica, dtype):
    """Text alone, an image alone, an image before text, two texts with images: in one call
    of several forwards. Positions on three axes (Qwen2-VL's own) would give other vectors
    for the texts with an image: a check that can fail."""
    t = Texts(ModelConfig.from_dir(replica).media, seed=3)
    texts = [
        t.text(14, 9),
        t.text(4, t.visual(6, 4), 11),
        t.text(3, t.visual(4, 8), 20),
        t.text(2, t.visual(4, 4), 1),
    ]
    recipe = Recipe(replica)
    want = np.stack([recipe.vector(x) for x in texts])
    with Encoder.from_pretrained(replica, dtype=dtype, max_batch_tokens=64) as enc:
        got = enc.embed_media(texts)
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1)
    assert cosine.min() >= (0.9999 if dtype == "float32" else 0.999), cosine
    axes = np.stack([recipe.vector(x, axes=True) for x in texts[1:]])
    assert (axes * want[1:]).sum(1).max() < 0.999


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vectors_on_a_gpu_match_its_script(replica):
    """bf16 on the GPU (a text alone also through the CUDA graphs) against its script's
    forward in fp32 on the CPU: min cosine 0.999."""
    t = Texts(ModelConfig.from_dir(replica).media, seed=4)
    texts = [t.text(14, 9), t.text(4, t.visual(6, 4), 11), t.text(3, t.visual(4, 8), 20)]
    recipe = Recipe(replica)
    want = np.stack([recipe.vector(x) for x in texts])
    with Encoder.from_pretrained(replica, dtype="bfloat16", device="cuda") as enc:
        got = enc.embed_media(texts)
        text = enc.embed([texts[0].ids])[0]
    assert ((got * want).sum(1) / np.linalg.norm(got, axis=1)).min() >= 0.999
    assert float(text @ want[0]) / np.linalg.norm(text) >= 0.999


class Script:
    """GmeQwen2VL.embed's inputs from the served directory: its chat turn, fetch_image's
    resize (28-pixel blocks there: patch x merge here), then Qwen2-VL's image processor at
    the script's token budget (config.json's min and max image tokens, else 256 and 1,280)."""

    def __init__(self, model_dir, least=256, most=1280):
        from transformers import AutoTokenizer, Qwen2VLImageProcessor

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.images = Qwen2VLImageProcessor.from_pretrained(model_dir)
        self.factor = self.images.patch_size * self.images.merge_size
        area = self.factor**2
        self.images.size = {"shortest_edge": least * area, "longest_edge": most * area}

    def fetch_image(self, data: bytes):
        """Its smart_resize: sides rounded to whole blocks, 4 to 16,384 blocks of area."""
        from PIL import Image

        image = Image.open(io.BytesIO(data)).convert("RGB")
        f, least, most = self.factor, 4 * self.factor**2, 16384 * self.factor**2
        h = max(f, round(image.height / f) * f)
        w = max(f, round(image.width / f) * f)
        if h * w > most:
            beta = math.sqrt(image.height * image.width / most)
            h, w = math.floor(image.height / beta / f) * f, math.floor(image.width / beta / f) * f
        elif h * w < least:
            beta = math.sqrt(least / (image.height * image.width))
            h, w = math.ceil(image.height * beta / f) * f, math.ceil(image.width * beta / f) * f
        return image.resize((w, h))

    def text(self, text: str, image: bytes | None = None, instruction=None) -> MediaText:
        visuals, turn = (), text
        if image is not None:
            batch = self.images(images=[self.fetch_image(image)], return_tensors="np")
            grid = tuple(int(g) for g in batch["image_grid_thw"][0])
            visuals = (Visual(batch["pixel_values"].astype(np.float32), grid),)
            pads = "<|image_pad|>" * (int(np.prod(grid)) // self.images.merge_size**2)
            turn = f"<|vision_start|>{pads}<|vision_end|>{text}"
        msg = (
            f"<|im_start|>system\n{instruction or DEFAULT_INSTRUCTION}<|im_end|>\n"
            f"<|im_start|>user\n{turn}<|im_end|>\n<|im_start|>assistant\n<|endoftext|>"
        )
        return MediaText(np.array(self.tokenizer(msg)["input_ids"]), visuals)


@pytest.mark.parametrize("image_tokens", [None, (16, 60)])
def test_the_tokenizer_writes_its_script_inputs(tmp_path, image_tokens):
    """Ids as its chat turn writes them (with an instruction or its default), and an image's
    pixels as its two resizes give them, for both layouts (the first at the script's own
    budget of 256 to 1,280 tokens, the later at its config's)."""
    model_dir = gme(tmp_path / "gme", files=True, image_tokens=image_tokens)
    script = Script(model_dir, *(image_tokens or (256, 1280)))
    tok = TextTokenizer(model_dir, 32768)
    ids, _ = tok.encode_media(["a red square"], [""], EmbedOptions(), ["TEXT"])
    assert ids[0] == script.text("a red square").ids.tolist()
    opts = EmbedOptions(instruction="Find the picture.")
    ids, _ = tok.encode_media(["a query"], [""], opts, ["TEXT"])
    assert ids[0] == script.text("a query", instruction="Find the picture.").ids.tolist()
    settings = ImageSettings.from_dir(model_dir)
    for data in image_files().values():
        want = script.text("a caption", data)
        rgb = resized(decode(data, 1 << 24), settings)
        pixels, grid = patchify(rgb, settings)
        assert grid == want.visuals[0].grid
        assert np.abs(pixels - want.visuals[0].pixels).max() < 1e-4
        blocks = image_blocks([int(np.prod(grid)) // 4])
        ids, _ = tok.encode_media(["a caption"], [blocks], EmbedOptions(), ["IMAGES"])
        assert ids[0] == want.ids.tolist()


# Through Triton: the embed ensemble writes its script's inputs and serves its vectors.


def later_layout(directory, files=True):
    return gme(directory, files=files, image_tokens=(16, 60))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from test_colqwen3 import serving

    yield from serving(tmp_path_factory.mktemp("gme-served"), later_layout)


@pytest.mark.server
def test_vectors_through_triton_match_its_script(served):
    """Texts, an image alone, an image with a caption, a query with an instruction; over HTTP
    and gRPC; min cosine 0.9999 in fp32 against its script's forward on its script's inputs."""
    from test_colqwen3 import large_page

    from qwen_embed_client import EmbeddingClient

    model_dir, server = served
    recipe, script = Recipe(model_dir), Script(model_dir, 16, 60)
    files = image_files()
    inputs = [("a yellow circle over blue", None), ("", files["png"]), ("a page", large_page())]
    want = np.stack([recipe.vector(script.text(text, image)) for text, image in inputs])
    query = recipe.vector(script.text("circles?", instruction="Find the picture."))
    for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
        with EmbeddingClient(url, protocol=protocol) as client:
            got = client.embed(
                [text for text, _ in inputs], images=[[im] if im else [] for _, im in inputs]
            )
            asked = client.embed(["circles?"], instruction="Find the picture.")[0]
        assert (got * want).sum(1).min() >= 0.9999, protocol
        assert float(asked @ query) >= 0.9999, protocol
    assert (want[1] @ want[2]) < 0.999  # the images move the vectors: a check that can fail


@pytest.mark.server
def test_what_it_cannot_read_is_refused_for_that_request(served):
    from qwen_embed_client import EmbeddingClient, EmbeddingError

    _, server = served
    png = image_files()["png"]
    with EmbeddingClient(server.grpc_url) as client:
        with pytest.raises(
            EmbeddingError, match=r"'IMAGES\[0\]' holds 2 images; this model reads 1 per text"
        ):
            client.embed(["two pictures"], images=[[png, png]])
        with pytest.raises(
            EmbeddingError, match="'VIDEOS' holds videos, and this model reads texts and images"
        ):
            client.embed(["a clip"], videos=[[[png, png]]])
        assert client.embed(["still served"]).shape == (1, 128)


@pytest.mark.server
def test_images_through_the_gateway_with_openai_and_cohere(served):
    """OpenAI's content parts and Cohere's inputs (a document: the default instruction)."""
    import cohere
    import openai
    from test_qwen3_vl import data_url

    from triton_helpers import gateway_process

    model_dir, server = served
    recipe, script = Recipe(model_dir), Script(model_dir, 16, 60)
    png = image_files()["png"]
    want_png = recipe.vector(script.text("", png))
    want_caption = recipe.vector(script.text("a yellow circle", png))
    image_part = {"type": "image_url", "image_url": {"url": data_url(png)}}
    caption = [{"type": "text", "text": "a yellow circle"}, image_part]
    with gateway_process(server) as base:
        api = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        answer = api.embeddings.create(model="embed", input=[[image_part], caption])
        got = np.array([d.embedding for d in answer.data], dtype=np.float32)
        co = cohere.ClientV2(base_url=base, api_key="unused")
        by_inputs = co.embed(
            model="embed",
            inputs=[{"content": caption}],
            input_type="search_document",
            embedding_types=["float"],
        )
    assert float(got[0] @ want_png) >= 0.9999 and float(got[1] @ want_caption) >= 0.9999
    assert float(np.array(by_inputs.embeddings.float_[0]) @ want_caption) >= 0.9999
