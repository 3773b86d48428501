"""sentence-transformers on a multimodal checkpoint (Qwen3-VL), run in a process of its own:
its processor needs torchvision, which lives in .venv/video-reference (video_reference.py says
why), and loading a Qwen3-VL directory builds that processor.

    python sentence_reference.py SPEC.json OUT.npz
SPEC.json: {"build": [{"kind": "SentenceTransformer" | "MultiVectorEncoder" | "CrossEncoder",
"base", "out", "prompts", "default_prompt_name", "seed", "pixels", "skiplist"}, ...], "encode":
[{"model_dir", "task": "query" | "document" | null, "text": str | null, "image": path | null},
...], "predict": [{"model_dir", "query": SIDE, "document": SIDE}, ...]}, a SIDE {"text",
"image"} as an encode case's.

`build` writes each model as sentence-transformers 6.3 saves it: a SentenceTransformer of a
Qwen3-VL checkpoint (its Transformer with the chat template's generation prompt, last-token
pooling, Normalize, the prompts as its system turns), or the MultiVectorEncoder its own
conversion makes of one (a Dense of every token to 128 dimensions, seeded, a MultiVectorMask,
Normalize; `pixels` its processor's size, as a processor_kwargs of the conversion saves it;
`skiplist` its MultiVectorMask's arguments), or
a CrossEncoder of a Qwen3-VL reranker (its Transformer `any-to-any` with the generation prompt
and `pixels`, a LogitScore of "yes" against "no", the prompts).
`encode` runs encode_query, encode_document or encode (task null) on each case, reloaded from
its directory: an image is the PIL image of the file, an image with text {"image", "text"} (the
image first, as Qwen3-VL-Embedding's script writes them); `predict` runs CrossEncoder.predict
on each pair. OUT.npz: `vector_i` per encode case, `score_i` per pair.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
from video_reference import STACK, available  # noqa: F401  (re-exported for the tests)


def run(spec: dict, work: Path) -> tuple[list[np.ndarray], list[float]]:
    """Builds the spec's models; each encode case's vector (a multi-vector model's: one row
    per token) and each pair's score."""
    path, out = work / "sentence-spec.json", work / "sentence.npz"
    path.write_text(json.dumps(spec))
    subprocess.run([sys.executable, __file__, str(path), str(out)], check=True)
    with np.load(out) as found:
        vectors = [found[f"vector_{i}"] for i in range(len(spec.get("encode", [])))]
        return vectors, [float(found[f"score_{i}"]) for i in range(len(spec.get("predict", [])))]


def _build(spec: dict) -> None:
    import torch
    from sentence_transformers import CrossEncoder, MultiVectorEncoder, SentenceTransformer
    from sentence_transformers.cross_encoder.modules import LogitScore
    from sentence_transformers.cross_encoder.modules import Transformer as CETransformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    size = {"size": spec["pixels"]} if spec.get("pixels") else None
    if spec["kind"] == "CrossEncoder":
        transformer = CETransformer(
            spec["base"],
            transformer_task="any-to-any",
            processing_kwargs={"chat_template": {"add_generation_prompt": True}},
            processor_kwargs=size,
        )
        yes, no = transformer.tokenizer.convert_tokens_to_ids(["yes", "no"])
        CrossEncoder(
            modules=[transformer, LogitScore(true_token_id=yes, false_token_id=no)],
            prompts=spec.get("prompts") or {},
            default_prompt_name=spec.get("default_prompt_name"),
            device="cpu",
        ).save_pretrained(spec["out"])
        return
    if spec["kind"] == "MultiVectorEncoder":
        torch.manual_seed(spec.get("seed", 0))  # its Dense starts random
        model = MultiVectorEncoder(spec["base"], device="cpu", processor_kwargs=size)
        if spec.get("skiplist"):  # its MultiVectorMask with a skiplist in place of the default
            modules = list(model)
            modules[2] = MultiVectorMask(**spec["skiplist"])
            model = MultiVectorEncoder(
                modules=modules,
                prompts=model.prompts,
                default_prompt_name=model.default_prompt_name,
                device="cpu",
            )
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


def _model(models: dict, model_dir: str):
    import sentence_transformers

    if model_dir not in models:
        kind = json.loads((Path(model_dir) / "config_sentence_transformers.json").read_text())
        cls = getattr(sentence_transformers, kind["model_type"])
        models[model_dir] = cls(model_dir, device="cpu")
    return models[model_dir]


def _item(side: dict):
    """An input as a user hands it to sentence-transformers: text, an image, or both."""
    from PIL import Image

    image = Image.open(side["image"]) if side.get("image") else None
    text = side.get("text")
    return {"image": image, "text": text} if image is not None and text else image or text


def _encode(models: dict, case: dict) -> np.ndarray:
    model = _model(models, case["model_dir"])
    item = _item(case)
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
    found = {f"vector_{i}": _encode(models, c) for i, c in enumerate(spec.get("encode", []))}
    for i, pair in enumerate(spec.get("predict", [])):
        model = _model(models, pair["model_dir"])
        (score,) = model.predict([(_item(pair["query"]), _item(pair["document"]))])
        found[f"score_{i}"] = np.float64(score)
    np.savez(out, **found)


if __name__ == "__main__":
    _main(*sys.argv[1:])
