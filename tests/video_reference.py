"""Qwen3-VL-Embedding's recipe for inputs with videos, as its script runs it: qwen-vl-utils reads
and resizes (decord for files, torchvision's resize), then Qwen3-VL's processor (transformers)
cuts patches and writes the timestamps, without resizing again.

Run in a process of its own (`official_inputs`): that stack lives in .venv/video-reference (the
Makefile), and PyPI's torchvision is a CUDA build whose C++ operators do not load beside the
CPU torch, so its operator registrations are left out; the Python code the recipe uses (the
tensor resize, the v2 functional transforms) runs as published.

    python video_reference.py CASES.json OUT.npz
CASES.json: [{"model_dir", "prompt", "visuals": [{"video": path or a list of frames' paths,
optional "fps", "max_frames"} or {"image": path}, ...]}, ...]: the checkpoint whose processor
reads the case, the prompt as the chat template writes it (`VIDEO` and `IMAGE` stand for a
video's and an image's placeholders), the visuals in their order; OUT.npz: per case i, `ids_i`
and the processor's tensors as `<name>_i`. One process takes every case: most of its time is
its imports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np

STACK = Path(__file__).resolve().parents[1] / ".venv" / "video-reference"
# The chat template writes a video as <|vision_start|><|video_pad|><|vision_end|>, and the
# recipe's processor (transformers 4.57, as vLLM's and SGLang's) replaced all three with the
# timestamped frames; transformers 5's expands the video token alone and keeps the two around
# them. The bare token gives 4.57's text from either.
VIDEO = "<|video_pad|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# The embedding script's per-image pixel budget (its IMAGE_FACTOR is 32 whatever the patch).
IMAGE_PIXELS = {"min_pixels": 4 * 32 * 32, "max_pixels": 1800 * 32 * 32}
TOTAL_PIXELS = 10 * 768 * 32 * 32  # the embedding script's total_pixels (a list of frames)


def available() -> bool:
    return (STACK / ".installed").is_file()


def official_inputs(cases: list[dict], work: Path) -> list[dict]:
    """Each case's input ids and processor tensors (numpy), from the recipe in its process."""
    spec, out = work / "cases.json", work / "official.npz"
    spec.write_text(json.dumps(cases))
    env = {**os.environ, "FORCE_QWENVL_VIDEO_READER": "decord"}
    subprocess.run([sys.executable, __file__, str(spec), str(out)], check=True, env=env)
    with np.load(out) as found:
        return [
            {k.rsplit("_", 1)[0]: found[k] for k in found.files if k.endswith(f"_{i}")}
            for i in range(len(cases))
        ]


def video(visual: dict) -> dict:
    """A video as the embedding script hands it to qwen-vl-utils: a file at 1 frame per second,
    at most 64 frames, unless the input says otherwise; a list of frames' files cut to its
    max_frames (the script's sample_frames), with the script's total_pixels."""
    if isinstance(visual["video"], str):
        return {
            "type": "video",
            "video": "file://" + visual["video"],
            "fps": visual.get("fps", 1.0),
            "max_frames": visual.get("max_frames", 64),
        }
    frames, keep = visual["video"], visual.get("max_frames", 64)
    if len(frames) > keep:
        frames = [frames[i] for i in np.linspace(0, len(frames) - 1, keep, dtype=int)]
    return {"type": "video", "video": ["file://" + f for f in frames], "total_pixels": TOTAL_PIXELS}


def _processor(model_dir: Path):
    """Qwen3-VL's processor as the recipe builds it from a checkpoint's files."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    config = json.loads((model_dir / "preprocessor_config.json").read_text())
    sizes = {k: config[k] for k in ("patch_size", "temporal_patch_size", "merge_size")}
    norm = {"image_mean": config["image_mean"], "image_std": config["image_std"]}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    )
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(**sizes, **norm),
        video_processor=Qwen3VLVideoProcessor(**sizes, **norm),
        tokenizer=tokenizer,
    )
    return processor, sizes["patch_size"]


def _run(cases: list[dict], out: Path) -> None:
    sys.path.insert(0, str(STACK))
    sys.modules["torchvision._meta_registrations"] = types.ModuleType("absent")
    from qwen_vl_utils import process_vision_info

    processors = {}
    arrays = {}
    for i, case in enumerate(cases):
        model_dir = case["model_dir"]
        if model_dir not in processors:
            processors[model_dir] = _processor(Path(model_dir))
        processor, patch_size = processors[model_dir]
        content = [
            video(v)
            if "video" in v
            else {"type": "image", "image": "file://" + v["image"], **IMAGE_PIXELS}
            for v in case["visuals"]
        ]
        prompt = case["prompt"]
        images, videos, video_kwargs = process_vision_info(
            [{"role": "user", "content": content}],
            image_patch_size=patch_size,
            return_video_metadata=True,
            return_video_kwargs=True,
        )
        videos, metadata = zip(*videos, strict=True) if videos else (None, None)
        inputs = processor(
            text=[prompt],
            images=images,
            videos=list(videos) if videos else None,
            video_metadata=list(metadata) if metadata else None,
            do_resize=False,
            return_tensors="np",
            **video_kwargs,
        )
        arrays[f"ids_{i}"] = np.asarray(inputs["input_ids"][0])
        for name in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            if name in inputs:
                arrays[f"{name}_{i}"] = np.asarray(inputs[name])
    np.savez(out, **arrays)


if __name__ == "__main__":
    spec, out = sys.argv[1:]
    _run(json.loads(Path(spec).read_text()), Path(out))
