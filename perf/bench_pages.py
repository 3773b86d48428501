"""Document pages through a ColQwen2 retriever: the engine's token vectors against the training
recipe with transformers, same pages, same dtype.

    python perf/bench_pages.py --vlm qwen2_5_vl [--pages 24] [--dtype bfloat16]

A replica of `ColQwen2ForRetrieval` (transformers' format; random weights) at the real widths
of colqwen2-v1.0 (Qwen2-VL-2B) or colqwen2.5 (Qwen2.5-VL-3B) with 4 text layers and 4 vision
blocks, built at --model-dir on first use. Pages: random pixels of a few page sizes, resized
within 768 text tokens of 28 x 28 pixels (colpali-engine's budget) and patched as the server
does, each in the processor's page prompt. The engine embeds the whole list
(`Encoder.embed_tokens`); transformers runs the VLM on left-padded batches of --batch-size,
the ids and image grids given (three-axis positions), SDPA, then the projection and the
normalisation. Pages/s and tokens/s of each, and the lowest cosine of any token's vectors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from harness import RESULTS, cpu_tag, markdown_table, new_record, write_report

from qwen_embed import Encoder

from bench_engine import left_padded, timed

# (text model, vision tower) at the published widths; 4 layers and 4 blocks
SHAPES = {
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
MAX_TOKENS = 768  # colpali-engine's max_num_visual_tokens for ColQwen2
PROMPT = "<|im_start|>user\n<|vision_start|>{}<|vision_end|>Describe the image.<|im_end|>"


def replica(path: Path, vlm: str) -> Path:
    """The replica of `vlm`'s shape at `path`, built (bf16) unless present."""
    from transformers import ColQwen2Config, ColQwen2ForRetrieval, Qwen2_5_VLConfig, Qwen2VLConfig

    if (path / "config.json").is_file():
        return path
    text, vision = SHAPES[vlm]
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    text = dict(text, num_hidden_layers=4, num_key_value_heads=2, rope_parameters=rope)
    vision = dict(vision, depth=4, patch_size=14, temporal_patch_size=2, spatial_merge_size=2)
    vlm_class = Qwen2VLConfig if vlm == "qwen2_vl" else Qwen2_5_VLConfig
    tokens = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652)
    config = vlm_class(text_config=dict(text, vocab_size=151936), vision_config=vision, **tokens)
    torch.manual_seed(0)
    model = ColQwen2ForRetrieval(ColQwen2Config(vlm_config=config.to_dict()))
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def pages(n: int, seed: int, tokenizer, media) -> list:
    """n pages: random pixels of PAGE_SIZES in turn, as the server resizes and patches them."""
    from PIL import Image

    from qwen_embed.media import MediaText, Visual
    from qwen_embed_deploy.serving.images import ImageSettings, patchify, resized

    settings = ImageSettings(
        patch_size=14,
        min_pixels=4 * 28 * 28,
        max_pixels=MAX_TOKENS * 28 * 28,
        mean=(0.48145466, 0.4578275, 0.40821073),
        std=(0.26862954, 0.26130258, 0.27577711),
    )
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        w, h = PAGE_SIZES[i % len(PAGE_SIZES)]
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        pixels, grid = patchify(resized(image, settings), settings)
        pads = "<|image_pad|>" * (grid[1] * grid[2] // 4)
        ids = tokenizer.encode(PROMPT.format(pads) + "<|endoftext|>").ids
        out.append(MediaText(np.array(ids), (Visual(pixels, grid),)))
    return out


def transformers_pages(model, texts: list, batch_size: int) -> list[np.ndarray]:
    """The recipe on left-padded batches: each page's token vectors, padding dropped."""
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
            vectors = torch.nn.functional.normalize(model.embedding_proj_layer(hidden), dim=-1)
            out += [v[m.bool()].float().numpy() for v, m in zip(vectors, mask, strict=True)]
    return out


def main() -> None:
    from tokenizers import Tokenizer
    from transformers import ColQwen2ForRetrieval

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vlm", default="qwen2_5_vl", choices=sorted(SHAPES))
    p.add_argument("--model-dir", help="default: .cache/bench-colqwen2-<vlm>")
    p.add_argument("--tokenizer", default=".cache/demo-model/tokenizer.json")
    p.add_argument("--pages", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="default: results/pages-<vlm>-<cpu tag>")
    args = p.parse_args()
    model_dir = replica(Path(args.model_dir or f".cache/bench-colqwen2-{args.vlm}"), args.vlm)
    encoder = Encoder.from_pretrained(model_dir, dtype=args.dtype)
    dtype = getattr(torch, args.dtype)
    reference = ColQwen2ForRetrieval.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="sdpa"
    ).eval()
    texts = pages(args.pages, args.seed, Tokenizer.from_file(args.tokenizer), encoder.config.media)
    tokens = sum(len(t.ids) for t in texts)
    encoder.embed_tokens(texts[:2])  # warm-up
    engine_s, ours = timed(lambda: encoder.embed_tokens(texts), args.reps)
    hf_s, theirs = timed(lambda: transformers_pages(reference, texts, args.batch_size), 1)
    cosines = [(a * b).sum(1).min() for a, b in zip(ours, theirs, strict=True)]
    row = {
        "pages": len(texts),
        "tokens": tokens,
        "engine_pages_per_s": len(texts) / engine_s,
        "engine_tokens_per_s": tokens / engine_s,
        "transformers_pages_per_s": len(texts) / hf_s,
        "ratio": hf_s / engine_s,
        "min_cosine": float(min(cosines)),
    }
    print(json.dumps(row), flush=True)
    record = new_record(dtype=args.dtype, model=str(model_dir), vlm=args.vlm, results=[row])
    text, vision = SHAPES[args.vlm]
    notes = [
        f"model: ColQwen2ForRetrieval over {args.vlm} (random weights): text 4 layers hidden "
        f"{text['hidden_size']}, vision 4 blocks of {vision.get('embed_dim', 1280)}"
        + (", attention windows of 112 pixels, block 3 whole" if args.vlm == "qwen2_5_vl" else "")
        + f"; dtype {args.dtype}",
        f"pages: {PAGE_SIZES} pixels in turn (random), within {MAX_TOKENS} tokens, in the "
        f"processor's page prompt; transformers: the VLM with ids and image grids, SDPA, "
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
    out = args.out or str(RESULTS / f"pages-{args.vlm}-{cpu_tag()}")
    table = markdown_table(header, [cells])
    write_report(out, record, "ColQwen2 pages: engine vs transformers", notes, table)
    encoder.close()


if __name__ == "__main__":
    main()
