"""Qwen3-VL checkpoints (Qwen3-VL-Embedding): the vision tower (models/vision.py), images and
video in the text model's forward (media.py) and the text path, against transformers'
Qwen3-VL classes on a replica of the published layout (replicas.qwen3_vl)."""

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from tokenizers import Tokenizer
from transformers.models.qwen3_vl.modeling_qwen3_vl import (
    Qwen3VLForConditionalGeneration,
    Qwen3VLVisionModel,
)

from qwen_embed import Encoder, kernels, layers, native
from qwen_embed.config import ModelConfig, VisionConfig
from qwen_embed.media import MediaText, Visual, mrope_positions, visual_blocks
from qwen_embed.models.vision import VisionTower
from qwen_embed_deploy.serving import videos

from replicas import LORA_TARGETS, lora_model, qwen3_vl

FP32_COSINE, BF16_COSINE = 0.9999, 0.999


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    return qwen3_vl(tmp_path_factory.mktemp("qwen3-vl"))


@pytest.fixture(scope="module")
def media(replica):
    return ModelConfig.from_dir(replica).media


@pytest.fixture(scope="module")
def reference_model(replica):
    return Qwen3VLForConditionalGeneration.from_pretrained(replica, dtype=torch.float32).eval()


class Texts:
    """Texts with visuals in Qwen3-VL's form: <vision_start> placeholders <vision_end> per
    image and per temporal patch of a video (a timestamp's tokens between them)."""

    def __init__(self, media, seed=0):
        self.media, self.rng = media, np.random.default_rng(seed)

    def visual(self, h, w, t=1):
        pixels = self.rng.standard_normal((t * h * w, self.media.vision.patch_dim))
        return Visual(pixels.astype(np.float32), (t, h, w), video=t > 1)

    def text(self, *parts) -> MediaText:
        m, ids, visuals = self.media, [], []
        for part in parts:
            if isinstance(part, Visual):
                t, h, w = part.grid
                token = m.video_token_id if part.video else m.image_token_id
                for frame in range(t):
                    ids += list(self.rng.integers(5, 900, 2)) if frame else []
                    ids += [m.vision_start_token_id] + [token] * (h * w // m.vision.merge_unit)
                    ids += [m.vision_start_token_id + 1]  # vision_end
                visuals.append(part)
            else:
                ids += list(self.rng.integers(5, 900, part))
        return MediaText(np.array(ids), tuple(visuals))


def reference_vector(model, text: MediaText) -> np.ndarray:
    """transformers' Qwen3VLModel, its last token's final hidden state, normalised (the
    official recipe's pooling)."""
    return torch.nn.functional.normalize(reference_hidden(model, text), dim=-1).numpy()


@lru_cache(maxsize=4)
def tokenizer_of(model_dir: Path) -> Tokenizer:
    """The checkpoint's tokenizer.json, read once: the references score many inputs."""
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def yes_minus_no(model, model_dir, hidden: torch.Tensor) -> float:
    """Qwen3-VL-Reranker's score of a last hidden state: sigmoid of it through the output
    head's "yes" row minus its "no" row."""
    tok = tokenizer_of(model_dir)
    head = model.lm_head.weight.detach()
    yes, no = head[tok.token_to_id("yes")], head[tok.token_to_id("no")]
    return float(torch.sigmoid(hidden @ (yes - no).float()))


def visual_inputs(text: MediaText) -> dict[str, torch.Tensor]:
    """A text's images and videos as transformers' Qwen3-VL takes them."""
    inputs = {}
    for kind, video in (("", False), ("_videos", True)):
        chosen = [v for v in text.visuals if v.video == video]
        if chosen:
            inputs[f"pixel_values{kind}"] = torch.from_numpy(
                np.concatenate([v.pixels for v in chosen])
            )
            inputs[f"{'video' if video else 'image'}_grid_thw"] = torch.tensor(
                [v.grid for v in chosen]
            )
    return inputs


def last_hidden_states(model, ids, inputs: dict) -> torch.Tensor:
    """transformers' Qwen3VLModel's final hidden states [tokens, hidden] of one text (its
    images' and videos' placeholders typed as its processor types them)."""
    config = model.config
    ids = torch.as_tensor(np.asarray(ids))[None]
    types = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
    with torch.no_grad():
        hidden = model.model(input_ids=ids, mm_token_type_ids=types, **inputs).last_hidden_state
    return hidden[0].float()


def reference_hidden(model, text: MediaText) -> torch.Tensor:
    return last_hidden_states(model, text.ids, visual_inputs(text))[-1]


def cases(media) -> dict[str, MediaText]:
    t = Texts(media)
    return {
        "text alone": t.text(9),
        "an image alone": t.text(2, t.visual(4, 6), 2),
        "text with an image": t.text(12, t.visual(6, 4), 9),
        "two images": t.text(4, t.visual(4, 4), 3, t.visual(2, 6), 5),
        "a short video": t.text(5, t.visual(4, 4, t=2), 4),
    }


@pytest.mark.parametrize("table", ["torch", "native"])
def test_the_vision_tower_matches_transformers(media, table):
    if table == "native" and native.isa() is None:
        pytest.skip("the native kernels are not built here")
    torch.manual_seed(0)
    from transformers import Qwen3VLConfig

    config = Qwen3VLConfig(
        vision_config=dict(media.vision.__dict__, deepstack_visual_indexes=[0, 2])
    )
    reference = Qwen3VLVisionModel(config.vision_config).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.2)
    t = Texts(media)
    visuals = [t.visual(4, 6), t.visual(2, 4, t=2), t.visual(8, 2)]  # frames attend apart
    pixels = torch.from_numpy(np.concatenate([v.pixels for v in visuals]))
    grids = [v.grid for v in visuals]
    with torch.no_grad():
        want = reference(pixels, grid_thw=torch.tensor(grids))
    vision = VisionConfig.from_hf(config.vision_config.to_dict())
    tower = VisionTower(vision, "torch", "cpu", torch.float32, kernels.load(table))
    params, state = dict(tower.named_parameters()), reference.state_dict()
    assert set(params) <= set(state)
    for name, param in params.items():  # through the loaders, as loader.load_weights does
        param.weight_loader(param, state[name])
    with torch.no_grad():
        tokens, deepstack = tower(pixels, grids)
    assert tokens.shape == (sum(t * h * w for t, h, w in grids) // 4, vision.out_hidden_size)
    assert torch.allclose(tokens, want.pooler_output, atol=1e-5)
    assert len(deepstack) == 2
    for ours, theirs in zip(deepstack, want.deepstack_features, strict=True):
        assert torch.allclose(ours, theirs, atol=1e-5)


def test_positions_are_transformers_rope_index(media, reference_model):
    text = cases(media)["two images"]
    video = cases(media)["a short video"]
    for sample in (text, video):
        ids = torch.tensor(sample.ids)[None]
        types = (ids == media.image_token_id).int() + 2 * (ids == media.video_token_id).int()
        grids = {
            key: torch.tensor([v.grid for v in sample.visuals if v.video == video_])
            for key, video_ in (("image_grid_thw", False), ("video_grid_thw", True))
            if any(v.video == video_ for v in sample.visuals)
        }
        want, _ = reference_model.model.get_rope_index(ids, types, **grids)
        ours = mrope_positions(len(sample.ids), visual_blocks(sample, media))
        assert np.array_equal(ours.T, want[:, 0].numpy())


@pytest.mark.server  # whole-model runs against transformers': seconds
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("attn_backend", ["torch", "native"])
def test_vectors_match_transformers(replica, media, reference_model, dtype, attn_backend):
    texts = cases(media)
    want = {name: reference_vector(reference_model, t) for name, t in texts.items()}
    try:
        encoder = Encoder.from_pretrained(replica, dtype=dtype, attn_backend=attn_backend)
    except RuntimeError as e:  # the native operator not built for this dtype here
        pytest.skip(str(e))
    with encoder:
        together = encoder.embed_media(list(texts.values()))
        alone = [encoder.embed_media([t])[0] for t in texts.values()]
        plain = encoder.embed([texts["text alone"].ids])[0]  # the text path, 1-D rotary
    floor = FP32_COSINE if dtype == "float32" else BF16_COSINE
    for (name, vector), batched, single in zip(want.items(), together, alone, strict=True):
        assert float(vector @ batched) >= floor, name
        assert float(vector @ single) >= floor, name
    assert float(want["text alone"] @ plain) >= floor
    # the pixels matter: the same text with another image is another vector
    t = Texts(media, seed=1)
    other = t.text(12, t.visual(6, 4), 9)
    other = MediaText(texts["text with an image"].ids, other.visuals)
    with Encoder.from_pretrained(replica, dtype=dtype, attn_backend="torch") as encoder:
        assert float(encoder.embed_media([other])[0] @ want["text with an image"]) < 0.999


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attn_backend", ["auto", "torch"])
def test_vectors_on_a_gpu_match_transformers(replica, media, reference_model, attn_backend):
    """The text model and the vision tower on the GPU in bf16 (the chosen attention backend and
    torch's), against transformers in fp32 on the CPU."""
    texts = cases(media)
    want = {name: reference_vector(reference_model, t) for name, t in texts.items()}
    with Encoder.from_pretrained(
        replica, dtype="bfloat16", device="cuda", attn_backend=attn_backend
    ) as encoder:
        got = encoder.embed_media(list(texts.values()))
    for (name, vector), row in zip(want.items(), got, strict=True):
        assert float(vector @ row) >= BF16_COSINE, name


@pytest.mark.parametrize("quantization", ["none", "int8", "fp8"])
def test_the_towers_linear_layers_take_the_routes_gemm(replica, media, quantization):
    """Every linear layer of the tower (its patch embedding too) multiplies as the text model's
    float layers do: in the same GEMM on weights of the same dtype (bf16 ones in fp32 on a CPU
    without bf16 instructions: torch's emulated bf16 GEMM ran the tower several times slower),
    in floats under int8 and fp8."""
    with Encoder.from_pretrained(replica, dtype="bfloat16", quantization=quantization) as enc:
        linears = {n: m for n, m in enc.model.named_modules() if isinstance(m, layers._Linear)}
        o_proj = enc.model.layers[0].self_attn.o_proj  # a float layer on every route
        tower = {n: m for n, m in linears.items() if n.startswith("visual.")}
    vision = media.vision
    assert len(tower) == 1 + 4 * vision.depth + 2 * (1 + len(vision.deepstack_visual_indexes))

    def gemm(m: layers._Linear) -> tuple:
        return (None, m.weight.dtype) if m.kernel is None else (type(m.kernel), m.kernel.dtype)

    assert {gemm(m) for m in tower.values()} == {gemm(o_proj)}


def test_a_repeated_visual_goes_through_the_tower_once(replica, media):
    """A visual met twice in a forward (a rerank query's image in every pair) is run once; each
    text's vector is the one it has alone."""
    t = Texts(media, seed=5)
    image, other, clip = t.visual(4, 4), t.visual(2, 6), t.visual(2, 4, t=2)
    texts = [t.text(3, image, 5), t.text(image, 2), t.text(4, other, image, 1), t.text(clip, 6)]
    texts.append(t.text(clip, image, 2))
    with Encoder.from_pretrained(replica, dtype="float32", attn_backend="torch") as encoder:
        alone = np.stack([encoder.embed_media([x])[0] for x in texts])
        patches = []
        tower = encoder.model.visual
        run = tower.forward
        tower.forward = lambda pixels, grids: patches.append(len(pixels)) or run(pixels, grids)
        together = encoder.embed_media(texts)
    assert patches == [4 * 4 + 2 * 6 + 2 * 2 * 4]  # one forward, each visual once
    assert np.abs(together - alone).max() <= 1e-5


def test_a_lora_finetune_over_the_text_model_and_the_tower(replica, media, tmp_path):
    """A fine-tune saved as peft's adapter alone, over both the text model's and the vision
    tower's linear layers (their checkpoint names: `model.language_model.`, `model.visual.`),
    merged at load and named per request, against peft's unmerged forward."""
    targets = [*LORA_TARGETS, "qkv", "linear_fc1"]
    finetune = lora_model(
        tmp_path / "finetune", replica, Qwen3VLForConditionalGeneration, targets=targets
    )
    adapted = PeftModel.from_pretrained(
        Qwen3VLForConditionalGeneration.from_pretrained(replica, dtype=torch.float32), finetune
    ).eval()
    texts = cases(media)
    want = np.stack([reference_vector(adapted.base_model.model, t) for t in texts.values()])
    with Encoder.from_pretrained(finetune, dtype="float32", attn_backend="torch") as encoder:
        assert encoder.route.adapter == "lora"
        got = encoder.embed_media(list(texts.values()))
    assert (got * want).sum(-1).min() >= FP32_COSINE
    with Encoder.from_pretrained(  # the same fine-tune named per request: the tower's too
        replica, dtype="float32", attn_backend="torch", lora_modules=f"ft={finetune}"
    ) as encoder:
        got = encoder.embed_media(list(texts.values()), adapter="ft")
    assert (got * want).sum(-1).min() >= FP32_COSINE
    with Encoder.from_pretrained(replica, dtype="float32", attn_backend="torch") as encoder:
        base = encoder.embed_media(list(texts.values()))
    assert (base * want).sum(-1).max() < 0.999  # the adapter matters: this can fail


@pytest.mark.server  # whole-model runs: seconds
def test_an_adapter_a_request_names_with_images_and_per_token(replica, media, tmp_path):
    """An adapter of the text model a request names (lora_modules), for texts with images and
    for per-token vectors: each text is what the fine-tune merged at load gives it, texts of
    the base and of the adapter in one forward; the prefix cache keeps their prefixes apart."""
    finetune = lora_model(tmp_path / "finetune", replica, Qwen3VLForConditionalGeneration)
    texts = prefixed(list(range(10, 30)), list(cases(media).values()))
    names = ["ft", None, "ft", None, "ft"]
    settings = {"dtype": "float32", "attn_backend": "torch"}
    with Encoder.from_pretrained(finetune, **settings) as encoder:
        merged, merged_tokens = encoder.embed_media(texts), encoder.embed_tokens(texts)
    with Encoder.from_pretrained(replica, lora_modules=f"ft={finetune}", **settings) as encoder:
        base, base_tokens = encoder.embed_media(texts), encoder.embed_tokens(texts)
        forwards = encoder.stats["forwards"]
        got = encoder.embed_media(texts, adapter=names)
        tokens = encoder.embed_tokens(texts, adapter=names)
        assert encoder.stats["forwards"] == forwards + 2
    for i, name in enumerate(names):
        want, want_tokens = (merged, merged_tokens) if name else (base, base_tokens)
        assert np.abs(got[i] - want[i]).max() <= 1e-5, i
        assert np.abs(tokens[i] - want_tokens[i]).max() <= 1e-5, i
    assert (merged * base).sum(-1).max() < 0.999  # the adapter matters: this can fail


def prefixed(prefix: list[int], texts: list[MediaText]) -> list[MediaText]:
    return [MediaText(np.array(prefix + list(t.ids)), t.visuals) for t in texts]


def test_a_shared_prefix_ends_before_the_first_visual(replica, media):
    """Texts that begin alike (an instruction) share that beginning up to their first visual,
    in a batch and from the cache: the placeholders are the same ids whatever the pixels, so
    what follows is each text's own. The vectors are those computed without sharing."""
    t = Texts(media, seed=9)
    start = [media.vision_start_token_id]
    prefix = list(range(10, 40))  # each text's next token is a visual's start
    batch = prefixed(prefix, [t.text(t.visual(4, 4), 2), t.text(t.visual(2, 4), 5, t.visual(4, 2))])
    later = prefixed(prefix, [t.text(t.visual(2, 6, t=2), 3)])
    runs = {}
    for reuse in (False, True):
        with Encoder.from_pretrained(
            replica, dtype="float32", attn_backend="torch", prefix_reuse=reuse
        ) as encoder:
            first = encoder.embed_media(batch)
            computed = encoder.stats["computed_tokens"]
            second = encoder.embed_media(later)
            runs[reuse] = first, second, computed, encoder.stats["computed_tokens"] - computed
    shared = len(prefix + start)
    assert runs[False][2:] == (sum(len(x.ids) for x in batch), len(later[0].ids))
    assert runs[True][2:] == (
        shared + sum(len(x.ids) - shared for x in batch),
        len(later[0].ids) - shared,
    )
    assert np.abs(runs[True][0] - runs[False][0]).max() <= 1e-5
    assert np.abs(runs[True][1] - runs[False][1]).max() <= 1e-5


@pytest.mark.server  # starts the rank-1 worker process
def test_tensor_parallel_equals_one_process(replica, media, reranker_dir, tmp_path):
    """tp_size 2: rank 0 runs the tower and sends the visuals' tokens to rank 1, which loads no
    tower; every case and a batch split over forwards give one process's vectors, per-token
    vectors and scores (fp32: the all-reduces' summation order differs), and so do texts
    naming an adapter (rank 1 hears each text's)."""
    finetune = lora_model(tmp_path / "finetune", replica, Qwen3VLForConditionalGeneration)
    texts = list(cases(media).values())
    t = Texts(media, seed=3)
    texts += [t.text(t.visual(2, 4, t=2), 3, t.visual(4, 2), 2), t.text(7, t.visual(2, 2), 1)]
    texts += prefixed(list(range(10, 30)), [t.text(t.visual(2, 2), 3), t.text(t.visual(4, 2))])
    runs = {}
    for tp_size in (1, 2):
        with Encoder.from_pretrained(
            replica,
            tp_size=tp_size,
            dtype="float32",
            attn_backend="torch",
            max_batch_tokens=64,
            lora_modules=f"ft={finetune}",
        ) as encoder:
            runs[tp_size] = encoder.embed_media(texts)
            # every row's state, the plain texts beside those with visuals in one call
            runs[tp_size, "tokens"] = encoder.embed_tokens(texts + [texts[0].ids])
            names = ["ft", None] * (len(texts) // 2) + ["ft"] * (len(texts) % 2)
            runs[tp_size, "adapted"] = encoder.embed_media(texts, adapter=names)
            runs[tp_size, "adapted tokens"] = encoder.embed_tokens(texts, adapter=names)
        with Encoder.from_pretrained(
            reranker_dir, task="rerank", tp_size=tp_size, dtype="float32", max_batch_tokens=64
        ) as encoder:
            runs[tp_size, "scores"] = encoder.score_media(
                list(cases(encoder.config.media).values())
            )
            runs[tp_size, "text"] = encoder.score([texts[0].ids])
    assert np.abs(runs[2] - runs[1]).max() <= 1e-5
    assert np.abs(runs[2, "adapted"] - runs[1, "adapted"]).max() <= 1e-5
    assert (runs[1, "adapted"] * runs[1]).sum(-1).min() < 0.999  # the adapter was added
    for two, one in zip(
        runs[2, "tokens"] + runs[2, "adapted tokens"],
        runs[1, "tokens"] + runs[1, "adapted tokens"],
        strict=True,
    ):
        assert np.abs(two - one).max() <= 1e-5
    assert np.abs(runs[2, "scores"] - runs[1, "scores"]).max() <= 1e-5
    assert np.abs(runs[2, "text"] - runs[1, "text"]).max() <= 1e-5


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    """Qwen3-VL-Reranker's layout: the embedder's, with an output head of its own (the 8B's;
    the 2B ties it to the embeddings, as the text path's tests cover) read for "yes" and
    "no", and the tokenizer that names them."""
    return qwen3_vl(tmp_path_factory.mktemp("qwen3-vl-reranker"), files=True, tied=False, seed=7)


@pytest.fixture(scope="module")
def reranker_model(reranker_dir):
    return Qwen3VLForConditionalGeneration.from_pretrained(reranker_dir, dtype=torch.float32).eval()


@pytest.mark.server  # whole-model runs against transformers': seconds
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reranker_scores_match_transformers(reranker_dir, reranker_model, dtype):

    media = ModelConfig.from_dir(reranker_dir).media
    texts = cases(media)
    want = np.array(
        [
            yes_minus_no(reranker_model, reranker_dir, reference_hidden(reranker_model, t))
            for t in texts.values()
        ]
    )
    with Encoder.from_pretrained(reranker_dir, task="rerank", dtype=dtype) as encoder:
        together = encoder.score_media(list(texts.values()))
        alone = np.concatenate([encoder.score_media([t]) for t in texts.values()])
        with pytest.raises(ValueError, match="task='embed'"):
            encoder.pool_media_checked(list(texts.values()))
    tolerance = 1e-4 if dtype == "float32" else 1e-2
    assert np.abs(together - want).max() <= tolerance, (together, want)
    assert np.abs(alone - want).max() <= tolerance, (alone, want)
    assert np.ptp(want) > 0.05  # the cases score apart: a check that can fail


def test_the_pair_tokenizer_writes_the_official_template(reranker_dir, reranker):
    from qwen_embed_client.contract import RequestError, RerankOptions
    from qwen_embed_deploy.serving.rerank import PairTokenizer
    from qwen_embed_deploy.serving.tokenizer import image_blocks

    tok = tokenizer_of(reranker_dir)
    pad = "<|image_pad|>"
    query, documents = "which picture?", ["a yellow circle over blue " * 8, ""]
    images = [[6], [2, 4]]
    blocks = [image_blocks(counts) for counts in images]
    encode = PairTokenizer(reranker_dir, 8192).encode
    ours = encode(query, documents, RerankOptions(), image_blocks([4]), blocks)
    for pair, document, counts in zip(ours, documents, images, strict=True):
        written = "".join(f"<|vision_start|>{pad * n}<|vision_end|>" for n in counts)
        prompt = (
            "<|im_start|>system\nJudge whether the Document meets the requirements based on "
            'the Query and the Instruct provided. Note that the answer can only be "yes" or '
            '"no".<|im_end|>\n<|im_start|>user\n'
            f"<Instruct>: {RERANK_INSTRUCTION}<Query>:<|vision_start|>{pad * 4}<|vision_end|>"
            f"{query}\n<Document>:{written}{document}<|im_end|>\n<|im_start|>assistant\n"
        )
        assert pair == tok.encode(prompt).ids
    # Truncation cuts the document's text only: every placeholder and the template's end stay.
    limit = len(ours[0]) - 20
    cut = PairTokenizer(reranker_dir, limit).encode(
        query, documents, RerankOptions(), image_blocks([4]), blocks
    )
    pad_id = tok.token_to_id(pad)
    assert len(cut[0]) == limit and cut[0].count(pad_id) == 10
    assert cut[0][-5:] == ours[0][-5:] and cut[1] == ours[1]
    with pytest.raises(RequestError, match=r"'DOCUMENT_IMAGES\[0\]' with 'QUERY'.*no room"):
        PairTokenizer(reranker_dir, 90).encode(
            query, documents, RerankOptions(), image_blocks([4]), [image_blocks([60]), ""]
        )
    with pytest.raises(RequestError, match="reads text only"):
        PairTokenizer(reranker, 8192).encode(query, documents, RerankOptions(), "", blocks)


def test_a_video_that_leaves_no_room_is_refused_saying_how_to_fit_it(reranker_dir):
    from qwen_embed_client.contract import EmbedOptions, RequestError, RerankOptions
    from qwen_embed_deploy.serving.rerank import PairTokenizer
    from qwen_embed_deploy.serving.tokenizer import TextTokenizer

    clip = "<0.5 seconds><|vision_start|>" + "<|video_pad|>" * 80 + "<|vision_end|>"
    fewer = "a video keeps fewer frames with the options 'video_fps' and 'video_max_frames'"
    embed = TextTokenizer(reranker_dir, 64).encode_media
    with pytest.raises(RequestError, match=rf"'VIDEOS\[1\]' takes \d+ .* limit of 64; {fewer}$"):
        embed(["a", "b"], ["", clip], EmbedOptions(), ["IMAGES", "VIDEOS"])
    pairs = PairTokenizer(reranker_dir, 64).encode
    with pytest.raises(RequestError, match=rf"'DOCUMENT_VIDEOS\[0\]' with 'QUERY'.* 64; {fewer}$"):
        pairs("q", ["d"], RerankOptions(), "", [clip], ["DOCUMENT_VIDEOS"])


def test_media_refusals(replica, media, checkpoint):
    t = Texts(media)
    good = t.text(3, t.visual(4, 4), 2)
    with Encoder.from_pretrained(replica, dtype="float32", attn_backend="torch") as encoder:
        with pytest.raises(ValueError, match=r"texts\[0\]: the text holds 1 runs .* for 0"):
            encoder.embed_media([MediaText(good.ids)])
        wrong_size = Visual(good.visuals[0].pixels[:8], (1, 2, 4))  # right pixels, wrong run
        with pytest.raises(ValueError, match="has 4 tokens; its visual needs 2"):
            encoder.embed_media([MediaText(good.ids, (wrong_size,))])
        short = Visual(good.visuals[0].pixels[:-1], (1, 4, 4))
        with pytest.raises(ValueError, match=r"pixels must be \[16, 96\]"):
            encoder.embed_media([MediaText(good.ids, (short,))])
    with Encoder.from_pretrained(checkpoint("qwen3"), dtype="float32") as text_only:
        with pytest.raises(ValueError, match="no vision tower"):
            text_only.embed_media([good])


# Through Triton: the tokenizer writes every text in the chat template and resizes the images
# (serving/images.py), the encoder runs the tower; against the official recipe written here.


def image_files() -> dict[str, bytes]:
    """Small real image files: a PNG and a JPEG of drawn shapes, a PNG with an alpha channel."""
    from PIL import Image, ImageDraw

    files = {}
    for name, size, mode, fmt in (
        ("png", (90, 60), "RGB", "PNG"),
        ("jpeg", (48, 120), "RGB", "JPEG"),
        ("alpha", (70, 70), "RGBA", "PNG"),
    ):
        image = Image.new(mode, size, (30, 90, 160) + ((128,) if mode == "RGBA" else ()))
        draw = ImageDraw.Draw(image)
        draw.ellipse((5, 5, size[0] // 2, size[1] // 2), fill=(250, 200, 20))
        draw.rectangle((size[0] // 3, size[1] // 2, size[0] - 4, size[1] - 4), fill=(20, 160, 60))
        out = io.BytesIO()
        image.save(out, fmt)
        files[name] = out.getvalue()
    return files


# The official scripts' pixel budget: 4 to 1,800 tokens of the published models' 32 x 32 pixels
SCRIPT_PIXELS = {"shortest_edge": 4 * 32 * 32, "longest_edge": 1800 * 32 * 32}


def official_features(images: list[bytes], size: dict = SCRIPT_PIXELS) -> tuple[dict, list[str]]:
    """The official scripts' images: Qwen2-VL's image processor within their pixel budget
    (`size`) -> the model's inputs, and each image's placeholders as the chat template
    writes them."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    if not images:
        return {}, []
    processor = Qwen2VLImageProcessorPil(
        patch_size=4,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        size=size,
    )
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    features = processor(images=pil, return_tensors="pt")
    inputs = {k: features[k] for k in ("pixel_values", "image_grid_thw")}
    pads = [
        "<|vision_start|>" + "<|image_pad|>" * (int(g.prod()) // 4) + "<|vision_end|>"
        for g in features["image_grid_thw"]
    ]
    return inputs, pads


def official_last_hidden(model, model_dir, prompt: str, inputs: dict) -> torch.Tensor:
    return last_hidden_of_ids(model, tokenizer_of(model_dir).encode(prompt).ids, inputs)


def last_hidden_of_ids(model, ids, inputs: dict) -> torch.Tensor:
    """The text model's last hidden state at the last token."""
    return last_hidden_states(model, ids, inputs)[-1]


def official_vector(model, model_dir, text: str, images: list[bytes]) -> np.ndarray:
    """Qwen3-VL-Embedding's recipe with transformers: the chat template with the default
    instruction, the images before the text, the last token's final hidden state,
    normalised."""
    inputs, pads = official_features(images)
    prompt = (
        "<|im_start|>system\nRepresent the user's input.<|im_end|>\n<|im_start|>user\n"
        f"{''.join(pads)}{text}<|im_end|>\n<|im_start|>assistant\n"
    )
    hidden = official_last_hidden(model, model_dir, prompt, inputs)
    return torch.nn.functional.normalize(hidden, dim=-1).numpy()


RERANK_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."


def official_score(model, model_dir, query, query_images, document, document_images) -> float:
    """Qwen3-VL-Reranker's script with transformers: the pair in one user turn (each side's
    images before its text), the last token's hidden state through the output head's "yes"
    row minus its "no" row, sigmoid."""
    inputs, pads = official_features(query_images + document_images)
    split = len(query_images)
    prompt = (
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
        'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
        "<|im_end|>\n<|im_start|>user\n"
        f"<Instruct>: {RERANK_INSTRUCTION}<Query>:{''.join(pads[:split])}{query}\n"
        f"<Document>:{''.join(pads[split:])}{document}<|im_end|>\n<|im_start|>assistant\n"
    )
    return yes_minus_no(model, model_dir, official_last_hidden(model, model_dir, prompt, inputs))


@pytest.fixture(scope="module")
def served_finetune(tmp_path_factory):
    """The served embedder's directory and a LoRA fine-tune of its text model (peft's files)."""
    where = tmp_path_factory.mktemp("qwen3-vl-served")
    model_dir = qwen3_vl(where / "model", files=True)
    return model_dir, lora_model(where / "finetune", model_dir, Qwen3VLForConditionalGeneration)


@pytest.fixture(scope="module")
def served(served_finetune, reranker_dir):
    """tritonserver with the embedder (the fine-tune kept beside it as adapter `ft`) and the
    reranker."""
    from qwen_embed_deploy.repository import render
    from qwen_embed_deploy.triton import TritonServer

    model_dir, finetune = served_finetune
    where = model_dir.parent
    overrides = {
        "encoder": {"dtype": "float32"},
        "embed.encoder": {"lora_modules": f"ft={finetune}"},
    }
    repo = render(
        where / "repo", {"embed": model_dir}, overrides, rerankers={"rerank": reranker_dir}
    )
    with TritonServer(repo, log_path=where / "server.log") as server:
        yield model_dir, server


@pytest.fixture(scope="module")
def served_model(served):
    """transformers' model of the served embedder, loaded once for the module's references."""
    model_dir, _ = served
    return Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.server
def test_images_through_triton_match_the_official_recipe(served, served_model):
    from qwen_embed_client import EmbeddingClient

    model_dir, server = served
    model = served_model
    files = image_files()
    cases = [
        ("a query about a yellow circle", []),
        ("", [files["png"]]),
        ("a chart with a legend", [files["jpeg"]]),
        ("two pictures", [files["png"], files["alpha"]]),
    ]
    want = np.stack([official_vector(model, model_dir, t, im) for t, im in cases])
    for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
        with EmbeddingClient(url, protocol=protocol) as client:
            got = client.embed([t for t, _ in cases], images=[im for _, im in cases])
        cosines = (got * want).sum(axis=1)
        assert cosines.min() >= FP32_COSINE, (protocol, cosines)
    assert float(want[1] @ want[2]) < 0.999  # the images tell the vectors apart


@pytest.mark.server
def test_an_adapter_a_request_names_with_images_through_triton(served, served_finetune):
    """Texts with images naming the adapter `ft` are the fine-tune's (peft's forward of it with
    the official recipe), those naming none the base's."""
    from qwen_embed_client import EmbeddingClient

    model_dir, server = served
    adapted = PeftModel.from_pretrained(
        Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32),
        served_finetune[1],
    ).eval()
    files = image_files()
    cases = [("a chart with a legend", [files["jpeg"]]), ("", [files["png"]])]
    want = np.stack(
        [official_vector(adapted.base_model.model, model_dir, t, im) for t, im in cases]
    )
    with EmbeddingClient(server.grpc_url, protocol="grpc") as client:
        texts, images = [t for t, _ in cases], [im for _, im in cases]
        got = client.embed(texts, images=images, adapter="ft")
        plain = client.embed(texts, images=images)
    assert (got * want).sum(axis=1).min() >= FP32_COSINE
    assert (plain * want).sum(axis=1).max() < 0.999  # the adapter matters: this can fail


@pytest.mark.server
def test_reranking_with_images_through_triton_matches_the_official_script(
    served, reranker_dir, reranker_model
):
    from qwen_embed_client import EmbeddingClient, EmbeddingError

    _, server = served
    files = image_files()
    documents = [
        ("a yellow circle over blue", []),
        ("", [files["png"]]),
        ("a chart with a legend", [files["jpeg"]]),
        ("two pictures", [files["png"], files["alpha"]]),
    ]
    queries = [("which picture has a yellow circle?", []), ("", [files["jpeg"]])]
    for query, query_images in queries:
        want = np.array(
            [
                official_score(reranker_model, reranker_dir, query, query_images, d, im)
                for d, im in documents
            ]
        )
        for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
            with EmbeddingClient(url, protocol=protocol) as client:
                got = client.rerank(
                    query,
                    [d for d, _ in documents],
                    query_images=query_images,
                    document_images=[im for _, im in documents],
                )
            assert np.abs(got.scores - want).max() <= 1e-4, (protocol, got.scores, want)
        assert np.ptp(want) > 0.05  # the images move the scores: a check that can fail
    with EmbeddingClient(server.grpc_url) as client:
        text_only = client.rerank("a query", ["a document"])  # no images: the text pair
        assert text_only.token_counts[0] > 0
        with pytest.raises(EmbeddingError, match=r"DOCUMENT_IMAGES\[0\]' image 0 is not a"):
            client.rerank("q", [""], document_images=[[b"not an image"]])
        with pytest.raises(EmbeddingError, match=r"DOCUMENTS\[1\]' is empty"):
            client.rerank("q", ["a", ""], document_images=[[files["png"]], []])


def data_url(data: bytes, kind: str = "png", media: str = "image") -> str:
    return f"data:{media}/{kind};base64," + base64.b64encode(data).decode()


@pytest.mark.server
def test_images_through_the_gateway_with_openai_and_cohere(served, served_model, tmp_path):
    import cohere
    import httpx
    import litellm
    import openai
    from llama_index.embeddings.jinaai import JinaEmbedding

    from triton_helpers import gateway_process

    model_dir, server = served
    model = served_model
    files = image_files()
    png, jpeg = data_url(files["png"]), data_url(files["jpeg"], "jpeg")
    want_png = official_vector(model, model_dir, "", [files["png"]])
    want_chart = official_vector(model, model_dir, "a chart with a legend", [files["jpeg"]])
    image_part = {"type": "image_url", "image_url": {"url": png}}
    chart = [
        {"type": "text", "text": "a chart with a legend"},
        {"type": "image_url", "image_url": {"url": jpeg}},
    ]
    with gateway_process(server) as base:
        api = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        answer = api.embeddings.create(model="embed", input=[[image_part], chart])
        got = np.array([d.embedding for d in answer.data], dtype=np.float32)
        assert float(got[0] @ want_png) >= FP32_COSINE
        assert float(got[1] @ want_chart) >= FP32_COSINE
        tokenize = httpx.post(f"{base}/tokenize", json={"inputs": "x"}, timeout=60)
        assert tokenize.status_code == 422 and "not available" in tokenize.json()["error"]
        # vLLM's form: one conversation, its user turn the input
        body = {"model": "embed", "messages": [{"role": "user", "content": chart}]}
        vllm = httpx.post(f"{base}/v1/embeddings", json=body, timeout=60).json()
        assert float(np.array(vllm["data"][0]["embedding"]) @ want_chart) >= FP32_COSINE
        # the official scripts' inputs (Jina's API writes its single-part ones the same way)
        qwen = [{"image": png}, {"text": "a chart with a legend", "image": [jpeg]}]
        answer = httpx.post(f"{base}/v1/embeddings", json={"input": qwen}, timeout=60).json()
        got = np.array([d["embedding"] for d in answer["data"]], dtype=np.float32)
        assert float(got[0] @ want_png) >= FP32_COSINE
        assert float(got[1] @ want_chart) >= FP32_COSINE
        # Jina's: an image as its file's bytes in base64, {"url"} and {"bytes"} objects (what
        # LlamaIndex's JinaEmbedding sends for a remote and a local file)
        raw = base64.b64encode(files["png"]).decode()
        jina = [{"image": raw}, {"url": png}, {"bytes": raw}]
        answer = httpx.post(f"{base}/v1/embeddings", json={"input": jina}, timeout=60).json()
        got = np.array([d["embedding"] for d in answer["data"]], dtype=np.float32)
        assert (got @ want_png).min() >= FP32_COSINE
        (tmp_path / "image.png").write_bytes(files["png"])
        embedder = JinaEmbedding(api_key="unused", model="embed")
        embedder._api.api_url = f"{base}/v1/embeddings"  # the library takes no base URL
        got = embedder.get_image_embedding(str(tmp_path / "image.png"))
        assert float(np.array(got) @ want_png) >= FP32_COSINE
        # Infinity's: images as URLs under `modality` "image", sent by LiteLLM's provider
        answer = litellm.embedding(
            model="infinity/embed", input=[png, png], modality="image", api_base=base
        )
        got = np.array([d["embedding"] for d in answer.data], dtype=np.float32)
        assert (got @ want_png).min() >= FP32_COSINE
        for bad, words in [
            ({"url": png, "bytes": raw}, "content parts"),
            ({"text": "x", "instruction": "Find charts"}, "send 'instruction' beside the inputs"),
            ({}, "holds no 'text', 'image' or 'video'"),
            ({"text": "x", "audio": "y"}, "content parts"),
        ]:
            refused = httpx.post(f"{base}/v1/embeddings", json={"input": [bad]}, timeout=60)
            assert refused.status_code == 400 and words in refused.text, refused.text
            assert refused.json()["error"]["param"] == "input"

        co = cohere.ClientV2(base_url=base, api_key="unused")
        inputs = [{"content": chart}, {"content": [image_part]}]
        by_inputs = co.embed(
            model="embed", inputs=inputs, input_type="search_document", embedding_types=["float"]
        )
        by_images = co.embed(
            model="embed", images=[png], input_type="image", embedding_types=["float"]
        )
        got = np.array(by_inputs.embeddings.float_, dtype=np.float32)
        assert float(got[0] @ want_chart) >= FP32_COSINE
        assert float(got[1] @ want_png) >= FP32_COSINE
        assert float(np.array(by_images.embeddings.float_[0]) @ want_png) >= FP32_COSINE

        # Bad input: a 400 naming the field, for that request only.
        too_many = [{"type": "image_url", "image_url": {"url": png}}] * 17
        for bad, words in [
            (
                [[{"type": "image_url", "image_url": {"url": data_url(b"not an image")}}]],
                "readable image",
            ),
            (
                [[{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]],
                "remote",
            ),
            ([too_many], "more than the limit of 16"),
            ([[{"type": "audio", "audio": "x"}]], "content parts"),
        ]:
            with pytest.raises(openai.BadRequestError, match=words) as e:
                api.embeddings.create(model="embed", input=bad)
            assert e.value.body["param"] == "input", e.value.body

        def one(i):
            if i % 3 == 2:  # a broken image among good requests
                bad = [[{"type": "image_url", "image_url": {"url": data_url(b"GIF89a broken")}}]]
                with pytest.raises(openai.BadRequestError):
                    api.embeddings.create(model="embed", input=bad)
                return None
            return api.embeddings.create(model="embed", input=[chart]).data[0].embedding

        with ThreadPoolExecutor(6) as pool:
            answers = [a for a in pool.map(one, range(6)) if a is not None]
        assert all(float(np.array(a) @ want_chart) >= FP32_COSINE for a in answers)


@pytest.mark.server
def test_remote_images_are_fetched_from_the_hosts_allowed_only(served, served_model):
    """An image URL of this host's own web server: fetched by a gateway that names the host
    (--allowed-media-domains), its vector the official recipe's; refused, naming the input,
    by one that fetches from public addresses only (--allow-remote-images)."""
    import openai

    from triton_helpers import file_server, gateway_process

    model_dir, server = served
    png = image_files()["png"]
    want = official_vector(served_model, model_dir, "", [png])
    with file_server(png) as (port, _):
        url = f"http://127.0.0.1:{port}/image.png"
        part = {"type": "image_url", "image_url": {"url": url}}
        with gateway_process(server, "--allowed-media-domains", "127.0.0.1") as base:
            api = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            got = api.embeddings.create(model="embed", input=[[part]]).data[0].embedding
            assert float(np.array(got) @ want) >= FP32_COSINE
        with gateway_process(server, "--allow-remote-images") as base:
            api = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError, match="not a public address") as e:
                api.embeddings.create(model="embed", input=[[part]])
            assert e.value.body["param"] == "input", e.value.body


@pytest.mark.server
def test_reranking_with_images_through_the_gateway(served, reranker_dir, reranker_model):
    import httpx

    from triton_helpers import gateway_process

    _, server = served
    files = image_files()
    png, jpeg = data_url(files["png"]), data_url(files["jpeg"], "jpeg")

    def image(url):
        return {"type": "image_url", "image_url": {"url": url}}

    query = "which picture has a yellow circle?"
    want = [
        official_score(reranker_model, reranker_dir, query, [], d, im)
        for d, im in [("a chart", [files["jpeg"]]), ("", [files["png"]]), ("plain text", [])]
    ]
    with gateway_process(server) as base:
        documents = [[{"type": "text", "text": "a chart"}, image(jpeg)], [image(png)], "plain text"]
        body = {"model": "rerank", "query": query, "documents": documents}
        answer = httpx.post(f"{base}/v1/rerank", json=body, timeout=120).json()
        got = {r["index"]: r["relevance_score"] for r in answer["results"]}
        assert max(abs(got[i] - w) for i, w in enumerate(want)) <= 1e-4, (got, want)
        first = next(r for r in answer["results"] if r["index"] == 0)
        assert first["document"] == {"text": "a chart", "multi_modal": [image(jpeg)]}
        # vLLM's form: {"content": [...]}, one document per part; an image as the query
        body = {"model": "rerank", "query": {"content": [image(png)]}}
        body["documents"] = {"content": [image(jpeg)]}
        answer = httpx.post(f"{base}/v1/rerank", json=body, timeout=120).json()
        score = official_score(
            reranker_model, reranker_dir, "", [files["png"]], "", [files["jpeg"]]
        )
        assert abs(answer["results"][0]["relevance_score"] - score) <= 1e-4
        # Qwen3-VL-Reranker's scripts' form: objects of text, image and video
        body = {"model": "rerank", "query": {"text": query}}
        body["documents"] = [{"text": "a chart", "image": jpeg}, {"image": [png]}, "plain text"]
        answer = httpx.post(f"{base}/v1/rerank", json=body, timeout=120).json()
        got = {r["index"]: r["relevance_score"] for r in answer["results"]}
        assert max(abs(got[i] - w) for i, w in enumerate(want)) <= 1e-4, (got, want)
        for documents, words in [
            ([[image(data_url(b"not an image"))]], "readable image"),
            ([[image("https://example.com/a.png")]], "remote"),
            ([[{"type": "audio", "audio": "x"}]], "content parts"),
            ([{"text": "x", "instruction": "y"}], "send 'instruction' beside the inputs"),
        ]:
            body = {"model": "rerank", "query": query, "documents": ["fine", *documents]}
            refused = httpx.post(f"{base}/v1/rerank", json=body, timeout=120)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "documents" and words in error["message"], error


@pytest.mark.server
def test_images_through_voyages_sdk(served, served_model):
    """Voyage AI's `multimodal_embed` (its PIL images sent as lossless WebP): an input's
    text and images as the official recipe reads them, the options of /v1/embeddings, usage
    with the images' pixels; videos and unreadable images refused as its InvalidRequestError."""
    import io

    import voyageai
    from PIL import Image

    from triton_helpers import gateway_process, post_json

    model_dir, server = served
    files = image_files()
    images = [Image.open(io.BytesIO(files[name])) for name in ("png", "jpeg")]
    text = "a chart with a legend"
    want = [
        official_vector(served_model, model_dir, "", [files["png"]]),
        official_vector(served_model, model_dir, text, [files["png"], files["jpeg"]]),
    ]
    parts = [
        [{"type": "image_url", "image_url": {"url": data_url(files["png"])}}],
        [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": data_url(files["png"])}},
            {"type": "image_url", "image_url": {"url": data_url(files["jpeg"], "jpeg")}},
        ],
    ]
    with gateway_process(server) as base:
        vo = voyageai.Client(api_key="unused", base_url=f"{base}/v1")
        answer = vo.multimodal_embed([[images[0]], [text, *images]], model="embed")
        got = np.array(answer.embeddings, dtype=np.float32)
        assert (got * np.stack(want)).sum(1).min() >= FP32_COSINE
        status, ours, _ = post_json(f"{base}/v1/embeddings", {"input": parts})
        assert status == 200 and answer.total_tokens == ours["usage"]["total_tokens"]
        assert answer.text_tokens == answer.total_tokens and answer.video_pixels == 0
        assert answer.image_pixels == 2 * 90 * 60 + 48 * 120
        codes = vo.multimodal_embed(
            [[text, *images]], model="embed", output_dtype="int8", output_dimension=32
        )
        body = {"input": parts[1:], "embedding_type": "int8", "dimensions": 32}
        status, ours, _ = post_json(f"{base}/v1/embeddings", body)
        assert codes.embeddings == [ours["data"][0]["embedding"]]
        unreadable = {"type": "image_base64", "image_base64": "data:image/png;base64,AAAA"}
        with pytest.raises(voyageai.error.InvalidRequestError, match="'inputs\\[0\\]' image"):
            vo.multimodal_embed([{"content": [unreadable]}], model="embed")
        video = {"type": "video_base64", "video_base64": "data:video/mp4;base64,AAAA"}
        body = {"model": "embed", "inputs": [{"content": [video]}]}
        status, refused, _ = post_json(f"{base}/v1/multimodalembeddings", body)
        assert status == 400 and "'inputs[0]' holds a video" in refused["detail"], refused
        assert refused["error"]["param"] == "inputs"


@pytest.mark.server
def test_images_through_geminis_sdk(served, served_model):
    """google-genai's `models.embed_content` with images as its inline-data parts (the file's
    bytes): a content's text and images as the official recipe reads them; a fileData URL is
    fetched only where the gateway allows it, refused naming the request otherwise."""
    from google import genai
    from google.genai import errors, types

    from triton_helpers import gateway_process

    model_dir, server = served
    files = image_files()
    text = "a chart with a legend"
    want = [
        official_vector(served_model, model_dir, "", [files["png"]]),
        official_vector(served_model, model_dir, text, [files["png"], files["jpeg"]]),
    ]
    png = types.Part.from_bytes(data=files["png"], mime_type="image/png")
    jpeg = types.Part.from_bytes(data=files["jpeg"], mime_type="image/jpeg")
    contents = [
        types.Content(parts=[png]),
        types.Content(parts=[types.Part.from_text(text=text), png, jpeg]),
    ]
    with gateway_process(server) as base:
        client = genai.Client(api_key="unused", http_options=types.HttpOptions(base_url=base))
        answer = client.models.embed_content(model="embed", contents=contents)
        got = np.array([e.values for e in answer.embeddings], dtype=np.float32)
        assert (got * np.stack(want)).sum(1).min() >= FP32_COSINE
        remote = types.Part.from_uri(file_uri="https://example.com/a.png", mime_type="image/png")
        with pytest.raises(errors.ClientError, match="'requests\\[0\\]' remote image URLs are not"):
            client.models.embed_content(model="embed", contents=[types.Content(parts=[remote])])


@pytest.mark.server
def test_odd_media_get_a_4xx_never_a_5xx(served):
    """Images and videos in every shape the gateway takes (content parts, Qwen's own input
    objects, Cohere's inputs, rerank documents), their URL, part or list replaced by odd values
    and broken media: answered below 500; a good image embeds as before."""
    from triton_helpers import ODD_VALUES, gateway_process, http_status, odd_bodies

    _, server = served
    png = data_url(image_files()["png"])
    broken = ["data:image/png;base64,!!", "data:image/png;base64,AAAA", png[:100], png]
    broken += ["data:video/mp4;base64,AAAA", "data:text/plain;base64,aGk=", "http://127.0.0.1:9/a"]
    urls = ODD_VALUES + broken

    def part(kind, url):
        return {"type": kind, kind: {"url": url}}

    good = {"model": "embed", "input": [[{"type": "text", "text": "a"}, part("image_url", png)]]}
    shapes = [
        *([part("image_url", u)] for u in urls),
        *([part("video_url", u)] for u in urls),
        *([{"type": "image_url", "image_url": u}] for u in urls),
        *([{"type": "video", "video": [u, u]}] for u in urls),
        *({"image": u} for u in urls),
        *({"text": "a", "video": u} for u in urls),
    ]
    routes = {
        "/v1/embeddings": (good, ["input"]),
        "/v2/embed": ({"model": "embed", "input_type": "image", "inputs": []}, ["inputs"]),
        "/v1/rerank": ({"model": "rerank", "query": "q", "documents": ["d"]}, ["documents"]),
        "/v1/multimodalembeddings": (
            {"model": "embed", "inputs": [{"content": [{"type": "text", "text": "a"}]}]},
            ["inputs"],
        ),
    }
    gemini = "/v1beta/models/embed:batchEmbedContents"
    bodies = [
        (path, {**body, field: [shape]})
        for path, (body, (field,)) in routes.items()
        for shape in shapes
    ]
    bodies += [
        ("/v2/embed", {"model": "embed", "input_type": "image", "inputs": [{"content": [s]}]})
        for s in shapes
        if isinstance(s, list)
    ]
    bodies += [  # Voyage's segments
        ("/v1/multimodalembeddings", {"inputs": [{"content": [{"type": kind, kind: u}]}]})
        for kind in ("image_url", "image_base64", "video_url")
        for u in urls
    ]
    bodies += [  # Gemini's parts: a file inline (base64) or by its URI
        (gemini, {"requests": [{"content": {"parts": [part]}}]})
        for u in urls
        for part in (
            {"inlineData": {"mimeType": "image/png", "data": u}},
            {"inlineData": {"mimeType": "video/mp4", "data": u}},
            {"inlineData": u},
            {"fileData": {"mimeType": "image/png", "fileUri": u}},
            {"text": u, "inlineData": {"mimeType": "image/png", "data": u}},
        )
    ]
    bodies += odd_bodies(routes, seed=2, nested=60)
    with gateway_process(server) as base:
        statuses = [http_status(base + path, body) for path, body in bodies]
        assert all(s < 500 for s in statuses), [
            (b, s) for b, s in zip(bodies, statuses, strict=True) if s >= 500
        ][:3]
        assert sum(s >= 400 for s in statuses) > len(bodies) // 2
        assert http_status(f"{base}/v1/embeddings", good) == 200


@pytest.mark.server
def test_the_cli_embeds_a_text_with_images(served, served_model, tmp_path):
    import json
    import subprocess
    import sys

    model_dir, server = served
    model = served_model
    files = image_files()
    (tmp_path / "a.png").write_bytes(files["png"])
    (tmp_path / "b.jpg").write_bytes(files["jpeg"])
    command = [sys.executable, "-m", "qwen_embed_client", "embed", "two pictures"]
    command += ["--image", str(tmp_path / "a.png"), "--image", str(tmp_path / "b.jpg")]
    run = subprocess.run(
        command + ["--url", server.grpc_url], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    (row,) = [json.loads(line) for line in run.stdout.splitlines()]
    want = official_vector(model, model_dir, "two pictures", [files["png"], files["jpeg"]])
    assert float(np.array(row["embedding"]) @ want) >= FP32_COSINE
    missing = subprocess.run(
        command[:5] + ["--image", str(tmp_path / "none.png"), "--url", server.grpc_url],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert missing.returncode != 0 and "none.png" in missing.stderr


@pytest.mark.server
def test_the_cli_reranks_documents_with_images(served, reranker_dir, reranker_model, tmp_path):
    import json

    _, server = served
    files = image_files()
    (tmp_path / "query.png").write_bytes(files["png"])
    (tmp_path / "pages").mkdir()
    (tmp_path / "pages" / "chart.jpg").write_bytes(files["jpeg"])
    lines = [{"text": "a yellow circle"}, {"images": ["pages/chart.jpg"]}]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = cli_rerank(
        server, "", tmp_path / "docs.jsonl", "--query-image", str(tmp_path / "query.png")
    )
    want = [
        official_score(reranker_model, reranker_dir, "", [files["png"]], "a yellow circle", []),
        official_score(reranker_model, reranker_dir, "", [files["png"]], "", [files["jpeg"]]),
    ]
    assert max(abs(got[i] - w) for i, w in enumerate(want)) <= 1e-4, (got, want)


def cli_rerank(server, query: str, documents: Path, *flags: str) -> dict[int, float]:
    """`qwen-embed rerank` against the server: each document's score by its index."""
    import json
    import subprocess
    import sys

    command = [sys.executable, "-m", "qwen_embed_client", "rerank", query, str(documents)]
    command += [*flags, "--url", server.grpc_url]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return {
        row["index"]: row["relevance_score"] for row in map(json.loads, run.stdout.splitlines())
    }


def write_video(path: Path, frames: int, fps: int, size: tuple[int, int]) -> Path:
    """A small real video file (MP4, MPEG-4 part 2): a yellow bar moving over a blue gradient."""
    import av

    height, width = size
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            rgb = np.zeros((height, width, 3), np.uint8)
            rgb[..., 2] = np.linspace(0, 255, width, dtype=np.uint8)
            x = (i * 5) % width
            rgb[:, x : x + 10] = (250, 200, 20)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        container.mux(stream.encode())
    return path


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict:
    """Two video files, and "frames": a video as 5 PNG files of its frames."""
    from PIL import Image

    where = tmp_path_factory.mktemp("clips")
    frames = []
    for i in range(5):
        rgb = np.zeros((52, 70, 3), np.uint8)
        rgb[..., 0] = np.linspace(0, 255, 70, dtype=np.uint8)
        rgb[i * 10 : i * 10 + 8] = (30, 220, 90)
        frames.append(where / f"frame-{i}.png")
        Image.fromarray(rgb).save(frames[-1])
    return {
        "bar": write_video(where / "bar.mp4", 10, 4, (48, 64)),  # 4 frames kept
        "wide": write_video(where / "wide.mp4", 23, 3, (60, 100)),  # 6 frames kept
        "frames": frames,
    }


@pytest.mark.parametrize(
    "total, rate, sampling, kept",
    [
        (10, 4, (), 4),
        (23, 3, (), 6),
        (300, 30, (), 10),
        (7200, 30, (), 64),
        (3, 30, (), 2),
        (5, 1, (), 4),
        (23, 3, (2.0, 10), 10),  # a request's video_fps and video_max_frames
        (23, 3, (2.0, 64), 14),
        (300, 30, (0.5, 64), 4),
        (300, 30, (1.0, 7), 6),
        (10, 4, (1.0, 2), 2),
    ],
)
def test_frames_kept_of_a_video_follow_qwen_vl_utils(total, rate, sampling, kept):
    """1 frame per second (or the request's video_fps), at least 4 and at most 64 (or its
    video_max_frames), whole temporal patches (smart_nframes)."""
    assert videos.frame_count(total, rate, 2, *sampling) == kept
    indices = videos.frame_indices(total, kept)
    assert len(indices) == kept and indices[0] == 0 and indices[-1] == total - 1


def test_a_video_is_read_resized_and_cut_like_two_frame_images(clips):
    from qwen_embed_client.contract import pack_media, unpack_media
    from qwen_embed_deploy.serving.images import ImageSettings, patchify

    settings = ImageSettings(patch_size=4)  # the replica's (replicas.qwen3_vl)
    video = videos.read(clips["wide"].read_bytes(), settings, 100, 10**6)
    # 6 of 23 frames at 3 fps; 60x100 grows to the 128-token floor per frame (8x8 pixels each)
    assert video.frames.shape == (6, 72, 120, 3) and video.frames.dtype == np.uint8
    assert video.times == tuple(i / 3 for i in (0, 4, 9, 13, 18, 22))
    assert np.allclose(videos.timestamps(video.times, 2), [2 / 3, 11 / 3, 20 / 3])
    text = videos.placeholders(video, settings)
    assert text.startswith("<0.7 seconds><|vision_start|>" + "<|video_pad|>" * 135)
    assert text.count("<|vision_start|>") == 3 and "<6.7 seconds>" in text
    # a video of one frame twice is an image: the same patches, one temporal patch
    still = np.repeat(video.frames[:1], 2, axis=0)
    pixels, grid = videos.patchify(still, settings)
    image_pixels, image_grid = patchify(video.frames[0], settings)
    assert grid == image_grid == (1, 18, 30) and np.array_equal(pixels, image_pixels)
    # MEDIA carries an image and a video's frames in their order
    back = unpack_media(pack_media([video.frames, video.frames[0]]), 0)
    assert np.array_equal(back[0], video.frames) and np.array_equal(back[1], video.frames[0])


def test_unreadable_and_oversized_videos_are_refused(clips):
    from qwen_embed_deploy.serving.images import ImageSettings

    settings = ImageSettings(patch_size=4)
    data = clips["bar"].read_bytes()
    for bad, limits, words in [
        (b"not a video", (100, 10**6), "not a readable video"),
        (data[: len(data) // 3], (100, 10**6), "readable video"),
        (data, (9, 10**6), "has 10 frames, more than the limit of 9"),
        (data, (100, 1000), "is 64x48, more than the limit of 1000 pixels per frame"),
        (image_files()["png"], (100, 10**6), "a video needs at least 2"),
    ]:
        with pytest.raises(ValueError, match=words):
            videos.read(bad, settings, *limits)


def test_a_video_given_as_frames_is_sampled_resized_and_refused_like_the_script(clips):
    """The script's list of frames: at most max_frames kept (numpy's linspace, truncated), an
    odd count made even, frames half a second apart; what cannot be read is named."""
    from qwen_embed_client.contract import (
        MAX_VIDEO_FRAMES,
        RequestError,
        pack_frames,
        unpack_frames,
    )
    from qwen_embed_deploy.serving.images import ImageSettings

    for count, keep in [(5, 64), (64, 64), (65, 64), (300, 7), (10, 2)]:
        want = np.linspace(0, count - 1, keep, dtype=int).tolist() if count > keep else None
        assert videos.sample_frames(count, keep) == (want or list(range(count)))
    settings = ImageSettings(patch_size=4)
    files = [f.read_bytes() for f in clips["frames"]]
    video = videos.read_frames(files, settings, 10**6)
    assert video.frames.shape[0] == 6 and video.times == (0.0, 0.5, 1.0, 1.5, 2.0, 2.5)
    assert np.array_equal(video.frames[5], video.frames[4])  # the last frame again
    assert videos.read_frames(files, settings, 10**6, keep=2).frames.shape[0] == 2
    assert unpack_frames(pack_frames(files), "v") == files
    assert unpack_frames(clips["bar"].read_bytes(), "v") is None  # a video file
    with pytest.raises(ValueError, match="frame 2 is not a readable image"):
        videos.read_frames(files[:2] + [b"not an image"] + files[3:], settings, 10**6)
    wider = image_files()["png"]
    with pytest.raises(ValueError, match=r"frame 5 is \(\d+, \d+\) once resized, frame 0"):
        videos.read_frames(files + [wider], settings, 10**6)
    with pytest.raises(RequestError, match=f"v must hold 1 to {MAX_VIDEO_FRAMES} frames"):
        unpack_frames(pack_frames([b"x"] * (MAX_VIDEO_FRAMES + 1)), "v")


def official_video_hidden(groups: list, work: Path) -> list[list[torch.Tensor]]:
    """Each group's (prompt, visuals) through the official recipe (tests/video_reference.py:
    the scripts' qwen-vl-utils and Qwen3-VL's processor, in one process of their own), then
    its model's last hidden state at the last token. `groups`: (model, its directory, its
    cases); `visuals`: ("video", path, optionally its "fps" and "max_frames") or ("image",
    file bytes) in the prompt's order; the prompt holds video_reference.VIDEO and IMAGE."""
    import video_reference

    spec, models = [], []
    for model, model_dir, cases in groups:
        for prompt, visuals in cases:
            listed = []
            for kind, item, *sampling in visuals:
                if kind == "image":  # a file beside the videos
                    path = work / f"image-{len(spec)}-{len(listed)}.png"
                    path.write_bytes(item)
                    item = path
                item = [str(f) for f in item] if isinstance(item, list) else str(item)
                listed.append({kind: item, **(sampling[0] if sampling else {})})
            spec.append({"model_dir": str(model_dir), "prompt": prompt, "visuals": listed})
            models.append(model)
    hidden = []
    for model, found in zip(models, video_reference.official_inputs(spec, work), strict=True):
        ids = found.pop("ids")
        inputs = {k: torch.from_numpy(v) for k, v in found.items()}
        hidden.append(last_hidden_of_ids(model, ids, inputs))
    each = iter(hidden)
    return [[next(each) for _ in cases] for *_, cases in groups]


def video_embedding_cases(clips) -> list[dict]:
    """The embedding test's inputs with videos: text, videos, images, and a case's "sampling"
    (its videos' fps and max_frames)."""
    png = image_files()["png"]
    return [
        {"text": "a yellow bar moving right", "videos": [clips["bar"]], "images": []},
        {"text": "", "videos": [clips["wide"]], "images": []},
        {"text": "a clip and a picture", "videos": [clips["bar"]], "images": [png]},
        {"text": "two clips", "videos": [clips["wide"], clips["bar"]], "images": []},
        # 10 frames of the 23 kept (6 by default): the request's video_fps and video_max_frames
        {
            "text": "denser",
            "videos": [clips["wide"]],
            "images": [],
            "sampling": {"fps": 2.0, "max_frames": 10},
        },
        # a video given as its frames' files: 5 frames (made 6, the last again), half a second
        # apart
        {"text": "frames", "videos": [clips["frames"]], "images": []},
    ]


def embedding_prompts(cases: list[dict]) -> list[tuple]:
    """Qwen3-VL-Embedding's recipe for inputs with videos: the user turn its videos, its
    images, then its text."""
    from video_reference import IMAGE, VIDEO

    prompts = []
    for c in cases:
        pads = VIDEO * len(c["videos"]) + IMAGE * len(c["images"])
        prompt = (
            "<|im_start|>system\nRepresent the user's input.<|im_end|>\n<|im_start|>user\n"
            f"{pads}{c['text']}<|im_end|>\n<|im_start|>assistant\n"
        )
        visuals = [("video", v, c.get("sampling", {})) for v in c["videos"]]
        visuals += [("image", b) for b in c["images"]]
        prompts.append((prompt, visuals))
    return prompts


def video_rerank_inputs(clips) -> tuple[list, list, list]:
    """The reranking test's (documents, queries, pairs): each side as (text, visuals), a pair
    as (query, its visuals, document, its visuals), visuals as official_video_hidden takes
    them. The first 6 pairs are every query with every document."""
    png = image_files()["png"]
    bar, wide, frames = clips["bar"], clips["wide"], clips["frames"]
    documents = [
        ("a yellow bar moves right", []),
        ("", [("video", bar)]),
        ("a wider clip", [("video", wide), ("image", png)]),
    ]
    queries = [("which clip shows a moving bar?", []), ("", [("video", bar)])]
    pairs = [(q, qv, d, dv) for q, qv in queries for d, dv in documents]
    # and a video document sampled as the request asks (10 frames of 23; 6 by default)
    pairs.append((queries[0][0], [], "", [("video", wide, {"fps": 2.0, "max_frames": 10})]))
    # a video given as its frames' files, as a document and as the query
    pairs.append((queries[0][0], [], "", [("video", frames)]))
    pairs.append(("", [("video", frames)], documents[0][0], []))
    return documents, queries, pairs


def rerank_prompts(pairs: list) -> list[tuple]:
    """Qwen3-VL-Reranker's script for pairs with videos: each side's videos, images, then its
    text in the pair template."""
    from video_reference import IMAGE, VIDEO

    def pads(visuals):
        return "".join(VIDEO if kind == "video" else IMAGE for kind, *_ in visuals)

    cases = []
    for query, query_visuals, document, document_visuals in pairs:
        prompt = (
            "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
            'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
            "<|im_end|>\n<|im_start|>user\n"
            f"<Instruct>: {RERANK_INSTRUCTION}<Query>:{pads(query_visuals)}{query}\n"
            f"<Document>:{pads(document_visuals)}{document}<|im_end|>\n<|im_start|>assistant\n"
        )
        cases.append((prompt, query_visuals + document_visuals))
    return cases


@pytest.fixture(scope="module")
def official_videos(served, served_model, reranker_dir, reranker_model, clips, tmp_path_factory):
    """The video tests' references from one run of the recipe's process: the embedding cases'
    vectors (the last token's final hidden state, normalised) and the rerank pairs' scores
    (sigmoid(yes - no) at the last token)."""
    model_dir, _ = served
    vectors, scores = official_video_hidden(
        [
            (served_model, model_dir, embedding_prompts(video_embedding_cases(clips))),
            (reranker_model, reranker_dir, rerank_prompts(video_rerank_inputs(clips)[2])),
        ],
        tmp_path_factory.mktemp("official-videos"),
    )
    return (
        np.stack([torch.nn.functional.normalize(h, dim=-1).numpy() for h in vectors]),
        np.array([yes_minus_no(reranker_model, reranker_dir, h) for h in scores]),
    )


@pytest.mark.server
@pytest.mark.skipif(
    not __import__("video_reference").available(),
    reason="the video recipe's stack (make setup: .venv/video-reference) is not installed",
)
def test_videos_through_triton_the_gateway_and_the_cli_match_the_official_recipe(
    served, clips, official_videos
):
    import json
    import subprocess
    import sys

    import httpx
    import openai

    from qwen_embed_client import EmbeddingClient

    from triton_helpers import gateway_process

    _, server = served
    png = image_files()["png"]
    cases = video_embedding_cases(clips)[:4]  # then the sampled video's and the frame list's
    frames = clips["frames"]
    want, want_sampled, want_listed = official_videos[0][:4], *official_videos[0][4:]
    assert float(want[0] @ want[2]) < 0.999  # the image tells the vectors apart
    texts = [c["text"] for c in cases]
    files = [[v.read_bytes() for v in c["videos"]] for c in cases]
    wide = clips["wide"].read_bytes()
    for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
        with EmbeddingClient(url, protocol=protocol) as client:
            got = client.embed(texts, videos=files, images=[c["images"] for c in cases])
            denser = client.embed(["denser"], videos=[[wide]], video_fps=2.0, video_max_frames=10)
            default = client.embed(["denser"], videos=[[wide]])
            listed = client.embed(["frames"], videos=[[[f.read_bytes() for f in frames]]])
        cosines = (got * want).sum(axis=1)
        assert cosines.min() >= FP32_COSINE, (protocol, cosines)
        assert float(denser[0] @ want_sampled) >= FP32_COSINE
        assert float(default[0] @ want_sampled) < 0.999  # the frames kept matter
        assert float(listed[0] @ want_listed) >= FP32_COSINE

    # vLLM's video_url content part, as a base64 data URL
    clip = {"type": "video_url", "video_url": {"url": data_url(files[0][0], "mp4", "video")}}
    with gateway_process(server) as base:
        api = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        parts = [{"type": "text", "text": texts[0]}, clip]
        answer = api.embeddings.create(model="embed", input=[parts, [clip]])
        got = np.array([d.embedding for d in answer.data], dtype=np.float32)
        assert float(got[0] @ want[0]) >= FP32_COSINE
        unreadable = {"type": "video_url", "video_url": {"url": data_url(png, "mp4", "video")}}
        with pytest.raises(openai.BadRequestError, match=r"'input\[0\]' video 0 has 1 frames") as e:
            api.embeddings.create(model="embed", input=[[unreadable]])
        assert e.value.body["param"] == "input", e.value.body
        # the same request's answer is unchanged after a refused one
        again = api.embeddings.create(model="embed", input=[parts]).data[0].embedding
        assert float(np.array(again) @ want[0]) >= FP32_COSINE
        clip = {"type": "video_url", "video_url": {"url": data_url(wide, "mp4", "video")}}
        parts = [{"type": "text", "text": "denser"}, clip]
        sampling = {"video_fps": 2, "video_max_frames": 10}
        answer = api.embeddings.create(model="embed", input=[parts], extra_body=sampling)
        assert float(np.array(answer.data[0].embedding) @ want_sampled) >= FP32_COSINE
        with pytest.raises(openai.BadRequestError, match="must be in 2..256, got 1") as e:
            api.embeddings.create(model="embed", input=[parts], extra_body={"video_max_frames": 1})
        assert e.value.body["param"] == "video_max_frames", e.value.body
        # the frames' files as Qwen's API writes a list of frames
        listed = {"type": "video", "video": [data_url(f.read_bytes()) for f in frames]}
        answer = api.embeddings.create(
            model="embed", input=[[{"type": "text", "text": "frames"}, listed]]
        )
        assert float(np.array(answer.data[0].embedding) @ want_listed) >= FP32_COSINE
        # the same as the official scripts write it: a list of frames is one video
        qwen = {"text": "frames", "video": listed["video"]}
        answer = httpx.post(f"{base}/v1/embeddings", json={"input": [qwen]}, timeout=120).json()
        assert float(np.array(answer["data"][0]["embedding"]) @ want_listed) >= FP32_COSINE
        listed["video"][2] = data_url(b"not an image")
        with pytest.raises(openai.BadRequestError, match="video 0 frame 2 is not a readable") as e:
            api.embeddings.create(model="embed", input=[[listed]])
        assert e.value.body["param"] == "input", e.value.body

    command = [sys.executable, "-m", "qwen_embed_client", "embed", "denser"]
    command += ["--video", str(clips["wide"]), "--video-fps", "2", "--video-max-frames", "10"]
    run = subprocess.run(command + ["--url", server.grpc_url], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    (row,) = [json.loads(line) for line in run.stdout.splitlines()]
    assert float(np.array(row["embedding"]) @ want_sampled) >= FP32_COSINE
    command = [sys.executable, "-m", "qwen_embed_client", "embed", "frames", "--video-frames"]
    command += [*map(str, frames), "--url", server.grpc_url]
    run = subprocess.run(command, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    (row,) = [json.loads(line) for line in run.stdout.splitlines()]
    assert float(np.array(row["embedding"]) @ want_listed) >= FP32_COSINE


@pytest.mark.server
@pytest.mark.skipif(
    not __import__("video_reference").available(),
    reason="the video recipe's stack (make setup: .venv/video-reference) is not installed",
)
def test_reranking_with_videos_matches_the_official_script(served, clips, official_videos):
    import httpx

    from qwen_embed_client import EmbeddingClient

    from triton_helpers import gateway_process

    _, server = served
    png = image_files()["png"]
    bar, frames = clips["bar"], clips["frames"]
    documents, queries, _ = video_rerank_inputs(clips)
    found = official_videos[1]
    want, want_sampled, want_frames = found[:6].reshape(2, 3), found[6], found[7:]
    assert np.ptp(want) > 0.05  # the pairs score apart: a check that can fail

    def files(visuals, kind):
        return [item.read_bytes() if kind == "video" else item for k, item in visuals if k == kind]

    with EmbeddingClient(server.grpc_url, protocol="grpc") as client:
        for (query, query_visuals), row in zip(queries, want, strict=True):
            got = client.rerank(
                query,
                [d for d, _ in documents],
                query_videos=files(query_visuals, "video"),
                document_videos=[files(v, "video") for _, v in documents],
                document_images=[files(v, "image") for _, v in documents],
            )
            scores = dict(got.ranking)
            assert max(abs(scores[i] - w) for i, w in enumerate(row)) <= 1e-4, (scores, row)
        wide = [[clips["wide"].read_bytes()]]
        got = client.rerank(
            queries[0][0], [""], document_videos=wide, video_fps=2.0, video_max_frames=10
        )
        assert abs(got.ranking[0][1] - want_sampled) <= 1e-4, (got.ranking, want_sampled)
        listed = [f.read_bytes() for f in frames]
        got = client.rerank(queries[0][0], [""], document_videos=[[listed]])
        assert abs(got.ranking[0][1] - want_frames[0]) <= 1e-4, (got.ranking, want_frames)

    clip = {"type": "video_url", "video_url": {"url": data_url(bar.read_bytes(), "mp4", "video")}}
    with gateway_process(server) as base:
        body = {"model": "rerank", "query": queries[0][0], "return_documents": True}
        body["documents"] = [documents[0][0], [clip]]
        answer = httpx.post(f"{base}/v1/rerank", json=body, timeout=120).json()
        scores = {r["index"]: r["relevance_score"] for r in answer["results"]}
        assert abs(scores[1] - want[0, 1]) <= 1e-4, (scores, want)
        returned = {r["index"]: r["document"] for r in answer["results"]}
        assert returned[1]["multi_modal"] == [clip]
        listed = {"type": "video", "video": [data_url(f.read_bytes()) for f in frames]}
        answer = httpx.post(
            f"{base}/v1/rerank", json={**body, "documents": [[listed]]}, timeout=120
        )
        result = answer.json()["results"][0]
        assert abs(result["relevance_score"] - want_frames[0]) <= 1e-4, (result, want_frames)
        assert result["document"]["multi_modal"] == [listed]
        body["documents"] = [[{"type": "video_url", "video_url": {"url": data_url(png)}}]]
        refused = httpx.post(f"{base}/v1/rerank", json=body, timeout=120)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "documents" and "'documents[0]' video" in error["message"], error
        body["video_max_frames"] = 1
        refused = httpx.post(f"{base}/v1/rerank", json=body, timeout=120)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "video_max_frames"

    # the CLI: a JSONL of documents, each record's videos beside it
    import json

    # (a video as a list of its frames' files)
    lines = [
        {"text": documents[0][0]},
        {"videos": [bar.name]},
        {"videos": [[f.name for f in frames]]},
    ]
    (bar.parent / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = cli_rerank(server, queries[0][0], bar.parent / "docs.jsonl")
    assert max(abs(got[i] - want[0, i]) for i in range(2)) <= 1e-4, (got, want)
    assert abs(got[2] - want_frames[0]) <= 1e-4, (got, want_frames)
    # the query's video as its frames' files
    (bar.parent / "text.txt").write_text(documents[0][0] + "\n")
    got = cli_rerank(server, "", bar.parent / "text.txt", "--query-video-frames", *map(str, frames))
    assert abs(got[0] - want_frames[1]) <= 1e-4, (got, want_frames)
