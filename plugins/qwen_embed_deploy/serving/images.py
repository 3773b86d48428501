"""Image bytes -> the vision tower's patches, as Qwen3-VL-Embedding's own scripts prepare them
(numpy and Pillow only: this runs in the tokenizer's processes, beside the GPU worker).

An image is decoded (PNG, JPEG, WebP, GIF's first frame, ...), converted to RGB, resized to
whole merge blocks within a pixel budget keeping its aspect ratio (`fit`: each side rounded to
a multiple of patch x merge, the area scaled into [min_pixels, max_pixels]; bicubic), scaled to
[0, 1], normalised with the checkpoint's mean and std, and cut into patches in the order the
tower reads them: merge blocks row by row, each block's patches row by row, each patch its
channels x temporal_patch (the frame repeated) x patch x patch values.
"""

from __future__ import annotations

import io
import json
import math
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image

from qwen_embed.config import GME
from qwen_embed.sentence_modules import MULTI_VECTOR_MASK, module_kinds

from .retrievers import architectures, own_processor, pixel_budget

# Qwen3-VL-Embedding's script: 4 to 1,800 tokens of the text model per image (each token a
# 32 x 32 block of pixels), whatever the processor's own defaults say.
MIN_PIXELS = 4 * 32 * 32
MAX_PIXELS = 1800 * 32 * 32
MAX_ASPECT = 200  # longest side / shortest side, as the processor allows
# Pixel budgets a checkpoint's own scoring script sets over its processor's: jina-reranker-m0's
# compute_score loads its processor with min_pixels 3,136 and max_pixels 602,112.
SCRIPT_BUDGETS = {"JinaVLForRanking": (3136, 602112)}
# GME's script loads its processor with 256 to 1,280 text-model tokens per image (its config's
# min_image_tokens and max_image_tokens where it names them), after resizing every image to
# whole 28-pixel blocks within 4 to 16,384 of them itself (`first_budget`).
GME_TOKENS = (256, 1280)
GME_FIRST_TOKENS = (4, 16384)


@dataclass(frozen=True)
class ImageSettings:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    # (least, most) pixels of a resize before the one within the budget (GME's script's)
    first_budget: tuple[int, int] | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path, **changes) -> ImageSettings:
        """The checkpoint's image processor settings (patch, merge and temporal sizes, mean
        and std): preprocessor_config.json, or where transformers 5 saved the processor
        without it, processor_config.json's `image_processor`; the pixel budget `_budget`'s
        unless `changes` give one."""
        hf = image_processor_config(model_dir)
        known = {
            "patch_size": hf.get("patch_size"),
            "temporal_patch_size": hf.get("temporal_patch_size"),
            "merge_size": hf.get("merge_size"),
            "mean": tuple(hf["image_mean"]) if "image_mean" in hf else None,
            "std": tuple(hf["image_std"]) if "image_std" in hf else None,
        }
        settings = cls(**{k: v for k, v in known.items() if v is not None})
        if GME in architectures(model_dir):
            area = settings.factor**2
            first = tuple(n * area for n in GME_FIRST_TOKENS)
            settings = replace(settings, first_budget=first)
        least, most = _budget(model_dir, hf, settings)
        return replace(replace(settings, min_pixels=least, max_pixels=most), **changes)

    @property
    def factor(self) -> int:
        """Pixels per side of one text-model token."""
        return self.patch_size * self.merge_size


def image_processor_config(model_dir: str | Path) -> dict:
    """The image processor's saved settings, from either file transformers writes them to."""
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            hf = json.loads(path.read_text())
            return hf.get("image_processor", hf) if name == "processor_config.json" else hf
    return {}


def _processor_sized(model_dir: str | Path) -> bool:
    """Whether the checkpoint's images are sized by its processor's budget: a multi-vector
    retriever's, jina-embeddings-v4's, or a model sentence-transformers saved that reads its
    images through its processor (a MultiVectorEncoder; a CrossEncoder's LogitScore over a
    multimodal backbone), as sentence-transformers sizes them."""
    return own_processor(model_dir) or bool(
        {MULTI_VECTOR_MASK, "LogitScore"} & module_kinds(model_dir)
    )


def _budget(model_dir: str | Path, hf: dict, settings: ImageSettings) -> tuple[int, int]:
    """(least, most) pixels of an image: a scoring script's own (SCRIPT_BUDGETS, GME's), else
    the processor's (`hf`: `size`, or Qwen2-VL's older min_pixels and max_pixels) where it
    sizes them (`_processor_sized`; retrievers.pixel_budget), else Qwen3-VL-Embedding's
    script's (`settings`' defaults)."""
    for architecture in architectures(model_dir):
        if architecture in SCRIPT_BUDGETS:
            return SCRIPT_BUDGETS[architecture]
        if architecture == GME:
            config = json.loads((Path(model_dir) / "config.json").read_text())
            tokens = (config.get("min_image_tokens"), config.get("max_image_tokens"))
            least, most = (t or d for t, d in zip(tokens, GME_TOKENS, strict=True))
            return least * settings.factor**2, most * settings.factor**2
    if not _processor_sized(model_dir):
        return settings.min_pixels, settings.max_pixels
    size = hf.get("size") or {}
    least = size.get("shortest_edge", hf.get("min_pixels", settings.min_pixels))
    most = size.get("longest_edge", hf.get("max_pixels", settings.max_pixels))
    return pixel_budget(model_dir, least, most, settings.factor)


def fit(height: int, width: int, settings: ImageSettings) -> tuple[int, int]:
    """The size an image is resized to: whole merge blocks, within the pixel budget."""
    factor = settings.factor
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"is {width}x{height}: the aspect ratio must be at most {MAX_ASPECT}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > settings.max_pixels:
        beta = math.sqrt(height * width / settings.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < settings.min_pixels:
        beta = math.sqrt(settings.min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def decode(data: bytes, max_decoded_pixels: int) -> Image.Image:
    """Image bytes -> an RGB image; ValueError for what cannot be read or is too large to
    decode (checked from the header, before the pixels are decoded)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > max_decoded_pixels:
                raise ValueError(
                    f"is {image.width}x{image.height}, more than the limit of "
                    f"{max_decoded_pixels} pixels"
                )
            image.load()
    except ValueError:
        raise
    except (OSError, Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        raise ValueError(f"is not a readable image ({type(e).__name__}: {e})") from None
    return image.convert("RGB")


def resized(image: Image.Image, settings: ImageSettings) -> np.ndarray:
    """An RGB image at the size `fit` gives it (after a first resize within `first_budget`
    where the settings have one): uint8 [height, width, 3] (the tokenizer's part, what
    travels to the encoder)."""
    if settings.first_budget is not None:
        least, most = settings.first_budget
        first = replace(settings, min_pixels=least, max_pixels=most)
        height, width = fit(image.height, image.width, first)
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    height, width = fit(image.height, image.width, settings)
    return np.asarray(image.resize((width, height), Image.Resampling.BICUBIC), dtype=np.uint8)


def patchify(rgb: np.ndarray, settings: ImageSettings) -> tuple[np.ndarray, tuple[int, int, int]]:
    """A resized image uint8 [height, width, 3] -> (pixels [patches, 3 x temporal_patch x
    patch x patch] float32, grid (1, rows, columns) of patches): the encoder's part."""
    x = rgb.astype(np.float32) / 255.0
    x = (x - np.asarray(settings.mean, np.float32)) / np.asarray(settings.std, np.float32)
    p, m, t = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    rows, cols = rgb.shape[0] // p, rgb.shape[1] // p
    if rows * p != rgb.shape[0] or cols * p != rgb.shape[1] or rows % m or cols % m:
        raise ValueError(f"an image of {rgb.shape[:2]} pixels is not whole merge blocks")
    # [H, W, C] -> (block row, block column, row in block, column in block, C, py, px)
    x = x.reshape(rows // m, m, p, cols // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    return np.ascontiguousarray(x).reshape(rows * cols, 3 * t * p * p), (1, rows, cols)


def tokens_of(rgb: np.ndarray, settings: ImageSettings) -> int:
    """The text model's tokens of a resized image (its placeholders)."""
    return rgb.shape[0] * rgb.shape[1] // settings.factor**2
