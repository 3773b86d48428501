"""sentence-transformers on a multimodal checkpoint (Qwen3-VL), run in a process of its own:
its processor needs torchvision, which lives in .venv/video-reference (video_reference.py says
why), and loading a Qwen3-VL directory builds that processor.

    python sentence_reference.py SPEC.json OUT.npz
SPEC.json: {"build": [{"kind": "SentenceTransformer" | "MultiVectorEncoder", "base", "out",
"prompts", "default_prompt_name", "seed", "pixels"}, ...], "encode": [{"model_dir", "task":
"query" | "document" | null, "text": str | null, "image": path | null}, ...]}.

`build` writes each model as sentence-transformers 6.2 saves it: a SentenceTransformer of a
Qwen3-VL checkpoint (its Transformer with the chat template's generation prompt, last-token
pooling, Normalize, the prompts as its system turns), or the MultiVectorEncoder its own
conversion makes of one (a Dense of every token to 128 dimensions, seeded, a MultiVectorMask,
Normalize; `pixels` its processor's size, as a processor_kwargs of the conversion saves it).
`encode` runs encode_query, encode_document or encode (task null) on each case, reloaded from
its directory: an image is the PIL image of the file, an image with text {"image", "text"} (the
image first, as Qwen3-VL-Embedding's script writes them). OUT.npz: `vector_i` per case.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
from video_reference import STACK, available  # noqa: F401  (re-exported for the tests)


def run(spec: dict, work: Path) -> list[np.ndarray]:
    """Builds the spec's models and returns each encode case's vector (a multi-vector
    model's: one row per token)."""
    path, out = work / "sentence-spec.json", work / "sentence.npz"
    path.write_text(json.dumps(spec))
    subprocess.run([sys.executable, __file__, str(path), str(out)], check=True)
    with np.load(out) as found:
        return [found[f"vector_{i}"] for i in range(len(spec.get("encode", [])))]


def _build(spec: dict) -> None:
    import torch
    from sentence_transformers import MultiVectorEncoder, SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    if spec["kind"] == "MultiVectorEncoder":
        torch.manual_seed(spec.get("seed", 0))  # its Dense starts random
        size = {"size": spec["pixels"]} if spec.get("pixels") else None
        model = MultiVectorEncoder(spec["base"], device="cpu", processor_kwargs=size)
        model.save_pretrained(spec["out"])
        return
    transformer = Transformer(
        spec["base"], processing_kwargs={"chat_template": {"add_generation_prompt": True}}
    )
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    SentenceTransformer(
        modules=[transformer, pooling, Normalize()],
        prompts=spec.get("prompts") or {},
        default_prompt_name=spec.get("default_prompt_name"),
        device="cpu",
    ).save_pretrained(spec["out"])


def _encode(models: dict, case: dict) -> np.ndarray:
    from PIL import Image
    from sentence_transformers import MultiVectorEncoder, SentenceTransformer

    model_dir = case["model_dir"]
    if model_dir not in models:
        kind = json.loads((Path(model_dir) / "config_sentence_transformers.json").read_text())
        cls = (
            MultiVectorEncoder
            if kind["model_type"] == "MultiVectorEncoder"
            else SentenceTransformer
        )
        models[model_dir] = cls(model_dir, device="cpu")
    model = models[model_dir]
    image = Image.open(case["image"]) if case.get("image") else None
    text = case.get("text")
    item = {"image": image, "text": text} if image is not None and text else image or text
    encode = {"query": model.encode_query, "document": model.encode_document}.get(
        case["task"], model.encode
    )
    found = encode([item], convert_to_numpy=False)[0]
    return found.float().numpy()


def _main(spec_path: str, out: str) -> None:
    sys.path.insert(0, str(STACK))
    # torchvision's operator registrations are for CUDA's torch (video_reference.py)
    sys.modules["torchvision._meta_registrations"] = types.ModuleType("absent")
    spec = json.loads(Path(spec_path).read_text())
    for build in spec.get("build", []):
        _build(build)
    models: dict = {}
    vectors = {f"vector_{i}": _encode(models, c) for i, c in enumerate(spec.get("encode", []))}
    np.savez(out, **vectors)


if __name__ == "__main__":
    _main(*sys.argv[1:])
