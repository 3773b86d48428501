"""Engine tokens/s against transformers' padded forward, same texts, same dtype, one run.

    python perf/bench_engine.py --model-dir .cache/demo-model [--dtype float32]

Workloads (seeded, `--workloads`): "mixed" = 80% texts of 16-64 tokens and 20% of 256-1024, in
random order; "uniform" = every text the same length; "short" = queries of 8-40 tokens; "long" =
texts of 2,048-4,096 tokens. `--images N` (`--videos N`): inputs with an image (a video of 8
kept frames) each, Qwen3-VL, through `Encoder.embed_media` and transformers' Qwen3VLModel
(images or videos/s and tokens/s). `--pages N --vlm qwen2_vl|qwen2_5_vl`: document pages
through a ColQwen2 retriever (`Encoder.embed_tokens`, a vector per token) against its training
recipe with transformers (pages/s and tokens/s). Token ids are
drawn uniformly from the BPE vocabulary and end with <|endoftext|>, like the tokenizer's output
(compute does not depend on which ids). transformers runs Qwen3Model/Qwen2Model with SDPA
attention on left-padded batches of 32 in input order and takes the last position
(Qwen3-Embedding's recipe); beside it, as sentence-transformers batches, texts sorted by length
(longest first) in batches of each `--sorted-batch-sizes`. The engine gets the whole list at
once. All must agree (cosine) so the comparison is of equal work. On a GPU the run also times
the model's linear layers alone (F.linear: cuBLAS) at the engine's batch rows, the bound the
engine's tokens/s is a fraction of (`--quantization fp8`: the fp8 route's layers on
torch._scaled_mm, v and o on F.linear).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from harness import RESULTS, markdown_table, new_record, write_report

from qwen_embed import Encoder, ModelConfig
from qwen_embed.settings import QUANTIZATIONS
from qwen_embed_deploy.demo import ENDOFTEXT_ID, write_tokenizer

WORKLOADS = ("mixed", "uniform", "short", "long")


def workload(kind: str, n: int, seed: int, uniform_len: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    if kind == "mixed":
        long = rng.random(n) < 0.2
        lengths = np.where(long, rng.integers(256, 1025, n), rng.integers(16, 65, n))
    elif kind == "short":
        lengths = rng.integers(8, 41, n)
    elif kind == "long":
        lengths = rng.integers(2048, 4097, n)
    else:
        lengths = np.full(n, uniform_len)
    return [
        rng.integers(0, ENDOFTEXT_ID, size=int(k) - 1).tolist() + [ENDOFTEXT_ID] for k in lengths
    ]


def transformers_model(model_dir: str, dtype: torch.dtype):
    import transformers

    family = ModelConfig.from_dir(model_dir).family
    name = {"qwen3": "Qwen3Model", "qwen3_5": "Qwen3_5TextModel"}.get(family, "Qwen2Model")
    cls = getattr(transformers, name)  # Qwen3.5's only where asked for: it needs 5.2+
    return cls.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").eval()


# --qwen3-5: Qwen3.5-0.8B's widths (its model card: hidden 1024, Gated DeltaNet of 16 query/key
# and 16 value heads of 128, gated attention of 8 query and 2 key/value heads of 256, MLP
# 3584), two of its blocks of three linear-attention layers and one full-attention layer, the
# Qwen2/3 vocabulary (random weights, bf16)
QWEN3_5_SHAPE = dict(
    hidden_size=1024,
    intermediate_size=3584,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    vocab_size=151936,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
    num_hidden_layers=8,
    tie_word_embeddings=True,
)


def qwen3_5_replica(path: Path) -> Path:
    """The Qwen3.5 replica (QWEN3_5_SHAPE) at `path`, built unless present, with the demo's
    Qwen tokenizer (so that it serves too: bench_prefix.py)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    if not (path / "tokenizer.json").is_file():
        path.mkdir(parents=True, exist_ok=True)
        write_tokenizer(path)
    if (path / "config.json").is_file():
        return path
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    config = Qwen3_5TextConfig(**QWEN3_5_SHAPE, rope_parameters=rope)
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def left_padded(seqs) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) [n, longest] of id sequences, padded on the left: the last
    position of every row is its own last token."""
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, width - len(s) :] = torch.as_tensor(s)
        mask[row, width - len(s) :] = 1
    return ids, mask


def transformers_embed(model, seqs: list[list[int]], batch_size: int) -> np.ndarray:
    device = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for i in range(0, len(seqs), batch_size):
            ids, mask = left_padded(seqs[i : i + batch_size])
            hidden = model(input_ids=ids.to(device), attention_mask=mask.to(device))
            last = hidden.last_hidden_state[:, -1].float()
            out.append(torch.nn.functional.normalize(last, dim=-1).cpu().numpy())
    return np.concatenate(out)


def sorted_embed(model, seqs: list[list[int]], batch_size: int) -> np.ndarray:
    """sentence-transformers' batching: longest first, padded per batch; in input order."""
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    vectors = transformers_embed(model, [seqs[i] for i in order], batch_size)
    out = np.empty_like(vectors)
    out[order] = vectors
    return out


def linear_bound(
    config: ModelConfig, rows: int, dtype: torch.dtype, device, reps: int, fp8: bool = False
) -> float:
    """Tokens/s of the model's linear layers alone at `rows` rows: every layer's q|k|v, o,
    gate|up and down, random weights, F.linear (cuBLAS on a GPU); `fp8`: the fp8 route's, q|k,
    gate|up and down on torch._scaled_mm, v and o on F.linear."""
    h, d = config.hidden_size, config.head_dim
    q, kv, inter = config.num_heads * d, config.num_kv_heads * d, config.intermediate_size
    if not fp8:
        shapes = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]
        return rows / linear_seconds(shapes, config.num_layers, rows, dtype, device, reps)
    seconds = linear_seconds([(kv, h), (h, q)], config.num_layers, rows, dtype, device, reps)
    fp8_shapes = [(q + kv, h), (2 * inter, h), (h, inter)]
    seconds += linear_seconds(fp8_shapes, config.num_layers, rows, dtype, device, reps, fp8=True)
    return rows / seconds


def vision_linear_bound(vision, rows: int, dtype: torch.dtype, device, reps: int) -> float:
    """Patches/s of the vision tower's blocks' linear layers alone (q|k|v, proj, fc1, fc2)."""
    h, inter = vision.hidden_size, vision.intermediate_size
    shapes = [(3 * h, h), (h, h), (inter, h), (h, inter)]
    return rows / linear_seconds(shapes, vision.depth, rows, dtype, device, reps)


def linear_seconds(
    shapes, layers: int, rows: int, dtype: torch.dtype, device, reps: int, fp8: bool = False
) -> float:
    """Seconds of `layers` rounds of F.linear over `rows` rows with weights of `shapes` (out,
    in), random, on a GPU: best of `reps`; `fp8`: e4m3 codes on torch._scaled_mm, a scale per
    row and per channel, out in `dtype`."""
    weights = [torch.randn(n, k, dtype=dtype, device=device) / k**0.5 for n, k in shapes]
    inputs = {k: torch.randn(rows, k, dtype=dtype, device=device) for _, k in shapes}
    product = F.linear
    if fp8:
        weights = [w.to(torch.float8_e4m3fn) for w in weights]
        inputs = {k: x.to(torch.float8_e4m3fn) for k, x in inputs.items()}
        row_scale = torch.ones(rows, 1, device=device)
        channel_scales = {n: torch.ones(1, n, device=device) for n, _ in shapes}

        def product(x, w):
            scale_b = channel_scales[w.shape[0]]
            return torch._scaled_mm(x, w.t(), scale_a=row_scale, scale_b=scale_b, out_dtype=dtype)

    def run() -> None:
        for _ in range(layers):
            for w in weights:
                product(inputs[w.shape[1]], w)
        torch.cuda.synchronize(device)

    run()
    return timed(run, reps)[0]


# --images: a Qwen3-VL replica of the real patch and merge sizes (random weights): small (4
# text layers, 4 vision blocks) for CPUs, or Qwen3-VL-Embedding-2B's shape (--vl-shape 2b).
VL_TEXT = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=5e6,
    rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20]},
    tie_word_embeddings=True,
)
VL_VISION = dict(
    depth=4,
    hidden_size=1024,
    num_heads=16,
    intermediate_size=4096,
    out_hidden_size=1024,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[1, 2, 3],
)
VL_SHAPES = {
    "small": (VL_TEXT, VL_VISION),
    "2b": (
        {
            **VL_TEXT,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
        },
        {
            **VL_VISION,
            "depth": 24,
            "out_hidden_size": 2048,
            "deepstack_visual_indexes": [5, 11, 17],
        },
    ),
}
IMAGE_SIZES = [(224, 224), (320, 240), (448, 336), (512, 384)]
VIDEO_FRAMES = 8  # kept frames per video (4 temporal patches)


def vl_replica(path: Path, shape: str = "small", device: str = "cpu") -> Path:
    """The replica of `shape` (VL_SHAPES) at `path`, built there (its random weights drawn on
    `device`) unless present."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    if not (path / "config.json").is_file():
        text, vision = VL_SHAPES[shape]
        config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True)
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3VLForConditionalGeneration(config).to(torch.bfloat16)
        model.save_pretrained(path)
    return path


def image_workload(n: int, seed: int, media) -> list:
    """n inputs: Qwen3-VL-Embedding's template around 16-64 text tokens and one image of a
    size from IMAGE_SIZES (random pixels, resized and patched as the server does)."""
    from PIL import Image

    from qwen_embed.media import MediaText, Visual
    from qwen_embed_deploy.serving.images import ImageSettings, patchify, resized

    rng = np.random.default_rng(seed)
    settings = ImageSettings()
    texts = []
    for i in range(n):
        w, h = IMAGE_SIZES[i % len(IMAGE_SIZES)]
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        pixels, grid = patchify(resized(image, settings), settings)
        pads = grid[1] * grid[2] // 4
        words = rng.integers(0, 151000, int(rng.integers(16, 65))).tolist()
        ids = [151644] + words[:4] + [151645, 151644, 151652] + [media.image_token_id] * pads
        ids += [151653] + words[4:] + [151645, 151644, ENDOFTEXT_ID]
        texts.append(MediaText(np.array(ids), (Visual(pixels, grid),)))
    return texts


def video_workload(n: int, seed: int, media) -> list:
    """n inputs: the template around 16-64 text tokens and one video of VIDEO_FRAMES random
    frames of a size from IMAGE_SIZES, resized and patched as the server does; 4 random ids
    stand for each temporal patch's timestamp."""
    from qwen_embed.media import MediaText, Visual
    from qwen_embed_deploy.serving import videos
    from qwen_embed_deploy.serving.images import ImageSettings

    rng = np.random.default_rng(seed)
    settings = ImageSettings()
    texts = []
    for i in range(n):
        w, h = IMAGE_SIZES[i % len(IMAGE_SIZES)]
        frames = rng.integers(0, 256, (VIDEO_FRAMES, h, w, 3), dtype=np.uint8)
        size = videos.frame_size(h, w, VIDEO_FRAMES, settings)
        pixels, grid = videos.patchify(videos.resized(frames, size), settings)
        words = rng.integers(0, 151000, int(rng.integers(16, 65))).tolist()
        ids = [151644] + words[:4] + [151645, 151644]
        for _ in range(grid[0]):
            ids += rng.integers(0, 151000, 4).tolist() + [151652]
            ids += [media.video_token_id] * (grid[1] * grid[2] // 4) + [151653]
        ids += words[4:] + [151645, 151644, ENDOFTEXT_ID]
        texts.append(MediaText(np.array(ids), (Visual(pixels, grid, video=True),)))
    return texts


def transformers_media(model, texts: list, batch_size: int, media) -> np.ndarray:
    """Qwen3VLModel on left-padded batches, the last position pooled (the official script)."""
    out = []
    device = model.device
    with torch.inference_mode():
        for i in range(0, len(texts), batch_size):
            chunk = texts[i : i + batch_size]
            ids, mask = (t.to(device) for t in left_padded([t.ids for t in chunk]))
            visuals = [v for t in chunk for v in t.visuals]
            kind = "_videos" if visuals[0].video else ""
            pixels = torch.from_numpy(np.concatenate([v.pixels for v in visuals])).to(device)
            hidden = model.model(
                input_ids=ids,
                attention_mask=mask,
                mm_token_type_ids=(ids == media.image_token_id).int()
                + 2 * (ids == media.video_token_id).int(),
                **{
                    f"pixel_values{kind}": pixels,
                    f"{'video' if kind else 'image'}_grid_thw": torch.tensor(
                        [v.grid for v in visuals], device=device
                    ),
                },
            ).last_hidden_state[:, -1]
            out.append(F.normalize(hidden.float(), dim=-1).cpu().numpy())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return np.concatenate(out)


def images_main(args) -> None:
    """--images (--videos): inputs with one image (video) each through Encoder.embed_media and
    transformers."""
    from transformers import Qwen3VLForConditionalGeneration

    model_dir = vl_replica(Path(args.model_dir), args.vl_shape, args.device)
    dtype = getattr(torch, args.dtype)
    encoder = Encoder.from_pretrained(
        model_dir, dtype=args.dtype, device=args.device, attn_backend=args.attn_backend
    )
    reference = (
        Qwen3VLForConditionalGeneration.from_pretrained(
            model_dir, dtype=dtype, attn_implementation="sdpa"
        )
        .to(args.device)
        .eval()
    )
    media = encoder.config.media
    kind = "videos" if args.videos else "images"
    if args.videos:
        texts = video_workload(args.videos, args.seed, media)
    else:
        texts = image_workload(args.images, args.seed, media)
    tokens = sum(len(t.ids) for t in texts)
    encoder.embed_media(texts[:2])  # warm-up
    engine_s, ours = timed(lambda: encoder.embed_media(texts), args.reps)
    hf_s, theirs = timed(lambda: transformers_media(reference, texts, args.batch_size, media), 1)
    row = {
        "inputs": len(texts),
        "tokens": tokens,
        "patches": sum(len(t.visuals[0].pixels) for t in texts),
        f"engine_{kind}_per_s": len(texts) / engine_s,
        "engine_tokens_per_s": tokens / engine_s,
        f"transformers_{kind}_per_s": len(texts) / hf_s,
        "ratio": hf_s / engine_s,
        "min_cosine": float((ours * theirs).sum(1).min()),
    }
    if encoder.device.type == "cuda":  # the linear layers alone over the same tokens and patches
        rows = min(tokens, encoder.max_batch_tokens)
        text_s = tokens / linear_bound(encoder.config, rows, dtype, encoder.device, args.reps)
        rows = min(row["patches"], encoder.max_batch_tokens)
        vision = encoder.config.media.vision
        bound = vision_linear_bound(vision, rows, dtype, encoder.device, args.reps)
        row[f"linear_bound_{kind}_per_s"] = len(texts) / (text_s + row["patches"] / bound)
        row["fraction_of_bound"] = row[f"engine_{kind}_per_s"] / row[f"linear_bound_{kind}_per_s"]
    print(json.dumps(row), flush=True)
    record = new_record(dtype=args.dtype, device=args.device, model=str(model_dir), results=[row])
    each = (
        f"a video of {VIDEO_FRAMES} kept frames (4 temporal patches) each, the frames of"
        if args.videos
        else "one image each of"
    )
    text, vision = VL_SHAPES[args.vl_shape]
    notes = [
        f"model: a Qwen3-VL replica ({args.vl_shape}, random weights): text "
        f"{text['num_hidden_layers']} layers hidden {text['hidden_size']}, vision "
        f"{vision['depth']} blocks hidden {vision['hidden_size']}, patch 16, merge 2; dtype "
        f"{args.dtype}, device {args.device}",
        f"inputs: {each} {IMAGE_SIZES} pixels in turn (random) and 16-64 text tokens in "
        "Qwen3-VL-Embedding's template; transformers: Qwen3VLModel, SDPA, left-padded "
        f"batches of {args.batch_size}, one run; engine: embed_media on the whole list, best "
        f"of {args.reps}",
        f"route: {encoder.route.describe()}",
    ]
    if "fraction_of_bound" in row:
        notes.append(
            "bound: the text model's and the vision tower's linear layers alone (F.linear, "
            "cuBLAS) over the inputs' tokens and patches, at most max_batch_tokens rows a call"
        )
    header = ["inputs", "tokens", "patches", f"engine {kind}/s", "engine tok/s"]
    header += [f"transformers {kind}/s", "engine / transformers", "min cosine"]
    cells = [
        row["inputs"],
        row["tokens"],
        row["patches"],
        f"{row[f'engine_{kind}_per_s']:.2f}",
        f"{row['engine_tokens_per_s']:.0f}",
        f"{row[f'transformers_{kind}_per_s']:.2f}",
        f"{row['ratio']:.2f}x",
        f"{row['min_cosine']:.6f}",
    ]
    if "fraction_of_bound" in row:
        header += [f"linear bound {kind}/s", "engine / bound"]
        cells += [f"{row[f'linear_bound_{kind}_per_s']:.2f}", f"{row['fraction_of_bound']:.0%}"]
    table = markdown_table(header, [cells])
    title = f"Engine vs transformers: inputs with {kind}"
    write_report(args.out, record, title, notes, table)
    encoder.close()


# --pages: ColQwen2ForRetrieval replicas at the published widths of colqwen2-v1.0 (Qwen2-VL-2B)
# and colqwen2.5 (Qwen2.5-VL-3B): (text model, vision tower), 4 layers and 4 blocks
PAGE_VLMS = {
    "qwen2_vl": (
        dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12),
        dict(embed_dim=1280, mlp_ratio=4, num_heads=16, hidden_size=1536),
    ),
    "qwen2_5_vl": (
        dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16),
        dict(
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=2048,
            window_size=112,
            fullatt_block_indexes=[3],
        ),
    ),
}
PAGE_SIZES = [(612, 792), (595, 842), (800, 600), (1024, 1024)]  # letter, A4, slide, square
PAGE_TOKENS = 768  # colpali-engine's max_num_visual_tokens for ColQwen2
PAGE_PROMPT = "<|im_start|>user\n<|vision_start|>{}<|vision_end|>Describe the image.<|im_end|>"


def colqwen2_replica(path: Path, vlm: str) -> Path:
    """The ColQwen2 replica over `vlm` (PAGE_VLMS) at `path` with Qwen's tokenizer, built
    (bf16) unless present."""
    from transformers import ColQwen2Config, ColQwen2ForRetrieval, Qwen2_5_VLConfig, Qwen2VLConfig

    from qwen_embed_deploy.demo import write_tokenizer

    if (path / "config.json").is_file():
        return path
    text, vision = PAGE_VLMS[vlm]
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    text = dict(text, num_hidden_layers=4, num_key_value_heads=2, rope_parameters=rope)
    vision = dict(vision, depth=4, patch_size=14, temporal_patch_size=2, spatial_merge_size=2)
    vlm_class = Qwen2VLConfig if vlm == "qwen2_vl" else Qwen2_5_VLConfig
    tokens = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652)
    config = vlm_class(text_config=dict(text, vocab_size=151936), vision_config=vision, **tokens)
    torch.manual_seed(0)
    model = ColQwen2ForRetrieval(ColQwen2Config(vlm_config=config.to_dict()))
    model.to(torch.bfloat16).save_pretrained(path)
    write_tokenizer(path, append_eos=False)
    return path


def page_workload(n: int, seed: int, model_dir: Path) -> list:
    """n pages: random pixels of PAGE_SIZES in turn, resized and patched as the server does
    for ColQwen2 (within PAGE_TOKENS tokens), each in the processor's page prompt."""
    from PIL import Image
    from tokenizers import Tokenizer

    from qwen_embed.media import MediaText, Visual
    from qwen_embed_deploy.serving.images import ImageSettings, patchify, resized

    settings = ImageSettings(
        patch_size=14,
        min_pixels=4 * 28 * 28,
        max_pixels=PAGE_TOKENS * 28 * 28,
        mean=(0.48145466, 0.4578275, 0.40821073),
        std=(0.26862954, 0.26130258, 0.27577711),
    )
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = np.random.default_rng(seed)
    texts = []
    for i in range(n):
        w, h = PAGE_SIZES[i % len(PAGE_SIZES)]
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        pixels, grid = patchify(resized(image, settings), settings)
        pads = "<|image_pad|>" * (grid[1] * grid[2] // 4)
        ids = tokenizer.encode(PAGE_PROMPT.format(pads) + "<|endoftext|>").ids
        texts.append(MediaText(np.array(ids), (Visual(pixels, grid),)))
    return texts


def transformers_pages(model, texts: list, batch_size: int) -> list[np.ndarray]:
    """ColQwen2's training recipe on left-padded batches (the VLM given the ids and image
    grids, then the projection, normalised): each page's token vectors, padding dropped."""
    config, out = model.config.vlm_config, []
    with torch.inference_mode():
        for i in range(0, len(texts), batch_size):
            chunk = texts[i : i + batch_size]
            ids, mask = left_padded([t.ids for t in chunk])
            hidden = model.vlm(
                input_ids=ids,
                attention_mask=mask,
                mm_token_type_ids=(ids == config.image_token_id).int(),
                pixel_values=torch.from_numpy(np.concatenate([t.visuals[0].pixels for t in chunk])),
                image_grid_thw=torch.tensor([t.visuals[0].grid for t in chunk]),
            ).last_hidden_state
            vectors = F.normalize(model.embedding_proj_layer(hidden), dim=-1)
            out += [v[m.bool()].float().numpy() for v, m in zip(vectors, mask, strict=True)]
    return out


def pages_main(args) -> None:
    """--pages: document pages through a ColQwen2 replica, Encoder.embed_tokens vs the recipe."""
    from transformers import ColQwen2ForRetrieval

    model_dir = colqwen2_replica(Path(args.model_dir), args.vlm)
    encoder = Encoder.from_pretrained(model_dir, dtype=args.dtype)
    reference = ColQwen2ForRetrieval.from_pretrained(
        model_dir, dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
    ).eval()
    texts = page_workload(args.pages, args.seed, model_dir)
    tokens = sum(len(t.ids) for t in texts)
    encoder.embed_tokens(texts[:2])  # warm-up
    engine_s, ours = timed(lambda: encoder.embed_tokens(texts), args.reps)
    hf_s, theirs = timed(lambda: transformers_pages(reference, texts, args.batch_size), 1)
    row = {
        "pages": len(texts),
        "tokens": tokens,
        "engine_pages_per_s": len(texts) / engine_s,
        "engine_tokens_per_s": tokens / engine_s,
        "transformers_pages_per_s": len(texts) / hf_s,
        "ratio": hf_s / engine_s,
        "min_cosine": float(min((a * b).sum(1).min() for a, b in zip(ours, theirs, strict=True))),
    }
    print(json.dumps(row), flush=True)
    record = new_record(dtype=args.dtype, model=str(model_dir), vlm=args.vlm, results=[row])
    text, vision = PAGE_VLMS[args.vlm]
    windows = ", attention windows of 112 pixels, block 3 whole" if args.vlm == "qwen2_5_vl" else ""
    notes = [
        f"model: ColQwen2ForRetrieval over {args.vlm} (random weights): text 4 layers hidden "
        f"{text['hidden_size']}, vision 4 blocks of {vision.get('embed_dim', 1280)}{windows}; "
        f"dtype {args.dtype}",
        f"pages: {PAGE_SIZES} pixels in turn (random), within {PAGE_TOKENS} tokens, in the "
        "processor's page prompt; transformers: the VLM with ids and image grids, SDPA, "
        f"left-padded batches of {args.batch_size}, one run; engine: embed_tokens on the whole "
        f"list, best of {args.reps}",
        f"route: {encoder.route.describe()}",
    ]
    header = ["pages", "tokens", "engine pages/s", "engine tok/s", "transformers pages/s"]
    header += ["engine / transformers", "min cosine"]
    cells = [
        row["pages"],
        row["tokens"],
        f"{row['engine_pages_per_s']:.2f}",
        f"{row['engine_tokens_per_s']:.0f}",
        f"{row['transformers_pages_per_s']:.2f}",
        f"{row['ratio']:.2f}x",
        f"{row['min_cosine']:.5f}",
    ]
    table = markdown_table(header, [cells])
    write_report(args.out, record, "ColQwen2 pages: engine vs transformers", notes, table)
    encoder.close()


def timed(fn, reps: int) -> tuple[float, np.ndarray]:
    best, result = float("inf"), None
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=".cache/demo-model")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--attn-backend", default="torch", help="torch, flash_attn or flashinfer")
    p.add_argument("--cuda-graph-tokens", type=int, help="default: the setting's default")
    p.add_argument("--workloads", nargs="+", default=["mixed", "uniform"], choices=WORKLOADS)
    p.add_argument("--mixed-texts", type=int, default=96)
    p.add_argument("--uniform-texts", type=int, default=96)
    p.add_argument("--short-texts", type=int, default=2048)
    p.add_argument("--long-texts", type=int, default=64)
    p.add_argument("--uniform-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--sorted-batch-sizes", type=int, nargs="*", default=[32, 256])
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--transformers-reps", type=int, help="default: --reps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "engine_vs_transformers"))
    p.add_argument(
        "--images",
        type=int,
        help="N inputs with an image each on a small Qwen3-VL replica (built at --model-dir "
        "if missing) instead of the text workloads",
    )
    p.add_argument(
        "--videos",
        type=int,
        help="N inputs with a video each on the same replica instead of the text workloads",
    )
    p.add_argument(
        "--vl-shape",
        default="small",
        choices=sorted(VL_SHAPES),
        help="the replica --images and --videos build: small, or Qwen3-VL-Embedding-2B's",
    )
    p.add_argument(
        "--pages",
        type=int,
        help="N document pages through a ColQwen2 replica over --vlm (built at --model-dir if "
        "missing) instead of the text workloads",
    )
    p.add_argument("--vlm", default="qwen2_5_vl", choices=sorted(PAGE_VLMS))
    p.add_argument(
        "--qwen3-5",
        action="store_true",
        help="the text workloads on a Qwen3.5 replica (built at --model-dir if missing)",
    )
    args = p.parse_args()
    if args.qwen3_5:
        qwen3_5_replica(Path(args.model_dir))
    if args.images or args.videos:
        images_main(args)
        return
    if args.pages:
        pages_main(args)
        return

    dtype = getattr(torch, args.dtype)
    graphs = {} if args.cuda_graph_tokens is None else {"cuda_graph_tokens": args.cuda_graph_tokens}
    encoder = Encoder.from_pretrained(
        args.model_dir,
        dtype=args.dtype,
        device=args.device,
        attn_backend=args.attn_backend,
        quantization=args.quantization,
        **graphs,
    )
    reference = transformers_model(args.model_dir, dtype).to(args.device)
    config = ModelConfig.from_dir(args.model_dir)
    gpu = encoder.device.type == "cuda"
    fp8 = args.quantization == "fp8"
    rows = []
    for kind in args.workloads:
        n = getattr(args, f"{kind}_texts")
        seqs = workload(kind, n, args.seed, args.uniform_len)
        tokens = sum(map(len, seqs))
        chunks = [seqs[i : i + args.batch_size] for i in range(0, n, args.batch_size)]
        padded = sum(max(map(len, c)) * len(c) for c in chunks)
        encoder.embed(seqs[:4])  # warm-up
        transformers_embed(reference, seqs[:4], args.batch_size)
        engine_s, ours = timed(lambda s=seqs: encoder.embed(s), args.reps)
        hf_s, theirs = timed(
            lambda s=seqs: transformers_embed(reference, s, args.batch_size),
            args.transformers_reps or args.reps,
        )
        cos = float((ours * theirs).sum(1).min())
        row = {
            "workload": kind,
            "texts": n,
            "tokens": tokens,
            "padded_tokens": padded,
            "engine_tokens_per_s": tokens / engine_s,
            "transformers_tokens_per_s": tokens / hf_s,
            "ratio": hf_s / engine_s,
            "min_cosine": cos,
            "sorted_tokens_per_s": {},
        }
        for size in args.sorted_batch_sizes:
            sorted_s, vectors = timed(lambda s=seqs, b=size: sorted_embed(reference, s, b), 1)
            row["sorted_tokens_per_s"][size] = tokens / sorted_s
            row["min_cosine"] = min(row["min_cosine"], float((ours * vectors).sum(1).min()))
        if gpu:
            bound_rows = min(tokens, encoder.max_batch_tokens)
            bound = linear_bound(config, bound_rows, dtype, encoder.device, args.reps, fp8)
            row["linear_bound_tokens_per_s"] = bound
            row["fraction_of_bound"] = row["engine_tokens_per_s"] / bound
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)

    record = new_record(
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        attn_backend=args.attn_backend,
        route=encoder.route.describe(),
        model_dir=args.model_dir,
        model=config.__dict__,
        results=rows,
    )
    notes = [
        f"model: {args.model_dir} ({config.num_layers} layers, hidden {config.hidden_size}), "
        f"dtype {args.dtype}, quantization {args.quantization}, device {args.device}, "
        f"attention {args.attn_backend}, transformers batches of {args.batch_size} in input "
        f"order (best of {args.transformers_reps or args.reps}); length-sorted batches of "
        f"{args.sorted_batch_sizes} (sentence-transformers' order, one run each); engine best "
        f"of {args.reps}",
        f"route: {encoder.route.describe()}",
    ]
    if gpu:
        notes.append(
            "bound: the model's linear layers alone (F.linear, cuBLAS"
            + ("; q|k, gate|up and down as fp8 on torch._scaled_mm" if fp8 else "")
            + f") at min(tokens, max_batch_tokens = {encoder.max_batch_tokens}) rows, best of "
            f"{args.reps}"
        )
    header = [
        "workload",
        "texts",
        "tokens",
        "padded tokens (transformers)",
        "engine tok/s",
        "transformers tok/s",
        "engine / transformers",
        *(f"sorted {b} tok/s" for b in args.sorted_batch_sizes),
        *(["linear bound tok/s", "engine / bound"] if gpu else []),
        "min cosine",
    ]
    rows_md = [
        [
            r["workload"],
            r["texts"],
            r["tokens"],
            r["padded_tokens"],
            f"{r['engine_tokens_per_s']:.0f}",
            f"{r['transformers_tokens_per_s']:.0f}",
            f"{r['ratio']:.2f}x",
            *(f"{r['sorted_tokens_per_s'][b]:.0f}" for b in args.sorted_batch_sizes),
            *(
                [f"{r['linear_bound_tokens_per_s']:.0f}", f"{r['fraction_of_bound']:.0%}"]
                if gpu
                else []
            ),
            f"{r['min_cosine']:.6f}",
        ]
        for r in rows
    ]
    title = "Engine vs transformers padded forward"
    write_report(args.out, record, title, notes, markdown_table(header, rows_md))
    encoder.close()


if __name__ == "__main__":
    main()
