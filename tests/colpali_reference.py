"""colpali-engine on a ColQwen2, ColQwen2.5 or ColQwen3.5 checkpoint, run in a process of its
own: its processors need torchvision, which lives in .venv/video-reference (video_reference.py
says why), beside colpali-engine itself.

    python colpali_reference.py SPEC.json OUT.npz
SPEC.json: {"model_dir", "model": "ColQwen2" | "ColQwen2_5" | "ColQwen3_5", "queries": [str],
"images": [path], "save": path or null}. The model is colpali-engine's class of that name from
`model_dir` (a base checkpoint, or a LoRA fine-tune over one, which transformers loads through
peft), its processor from the same directory; the queries are run through `process_queries`
with the prefix the checkpoints were trained with (QUERY_PREFIXES), the images through
`process_images`, each as one batch, as a user runs them; `save`: where to write the model as
colpali-engine's save_pretrained does (transformers 5's config.json). OUT.npz: `query_i`,
`page_i`, each a vector per token (padding's rows dropped).

colpali-engine (0.3.14 and 0.3.18 seen) maps only `model.layers` of a checkpoint saved by
transformers 4.x (every published ColQwen2's) to its module names: the token embeddings and the
final norm would be left at their random initialisation. The model is loaded with the explicit
mapping (as MTEB's evaluation does), and the load is checked: no tensor missing or unused,
every adapter pair in the model as saved.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
from video_reference import STACK

# colpali-engine's up to 0.3.10, which trained the published ColQwen2(.5); none since (ColQwen3.5)
QUERY_PREFIXES = {"ColQwen2": "Query: ", "ColQwen2_5": "Query: ", "ColQwen3_5": ""}
KEY_MAPPING = {r"^model\.": "language_model."}


def available() -> bool:
    return (STACK / "colpali_engine").is_dir()


def run(spec: dict, work: Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(each query's token vectors, each image's)."""
    path, out = work / "colpali-spec.json", work / "colpali.npz"
    path.write_text(json.dumps(spec))
    subprocess.run([sys.executable, __file__, str(path), str(out)], check=True)
    with np.load(out) as found:
        queries = [found[f"query_{i}"] for i in range(len(spec["queries"]))]
        return queries, [found[f"page_{i}"] for i in range(len(spec["images"]))]


def _load(model_cls, model_dir: Path):
    import torch
    from safetensors.torch import load_file

    model, info = model_cls.from_pretrained(
        model_dir, dtype=torch.float32, key_mapping=KEY_MAPPING, output_loading_info=True
    )
    wrong = {kind: keys for kind, keys in info.items() if keys}
    if wrong:
        raise RuntimeError(f"{model_dir} loaded with {wrong}")
    adapter = model_dir / "adapter_model.safetensors"
    if adapter.is_file():  # each pair as the model holds it (peft's `default` adapter)
        params = dict(model.named_parameters())
        for key, tensor in load_file(adapter).items():
            name = key.removeprefix("base_model.model.").replace(".weight", ".default.weight")
            name = name.replace("model.", "language_model.", 1) if name[:6] == "model." else name
            if not torch.equal(params[name], tensor.float()):
                raise RuntimeError(f"{model_dir}: adapter tensor {key} is not the model's")
    return model.eval()


def _vectors(model, batch) -> list[np.ndarray]:
    import torch

    with torch.no_grad():
        found = model(**batch)
    mask = batch["attention_mask"].bool()
    return [rows[keep].numpy() for rows, keep in zip(found, mask, strict=True)]


def _main(spec_path: str, out: str) -> None:
    sys.path.insert(0, str(STACK))
    # torchvision's operator registrations are for CUDA's torch (video_reference.py)
    sys.modules["torchvision._meta_registrations"] = types.ModuleType("absent")
    from colpali_engine import models
    from PIL import Image

    spec = json.loads(Path(spec_path).read_text())
    model_dir, name = Path(spec["model_dir"]), spec["model"]
    processor_name = "ColQwen2_5_Processor" if name == "ColQwen2_5" else f"{name}Processor"
    model = _load(getattr(models, name), model_dir)
    if spec.get("save"):
        model.save_pretrained(spec["save"])
    processor = getattr(models, processor_name).from_pretrained(model_dir)
    found = {}
    if spec["queries"]:
        batch = processor.process_queries([QUERY_PREFIXES[name] + q for q in spec["queries"]])
        found |= {f"query_{i}": v for i, v in enumerate(_vectors(model, batch))}
    if spec["images"]:
        images = [Image.open(path) for path in spec["images"]]
        batch = processor.process_images(images)
        found |= {f"page_{i}": v for i, v in enumerate(_vectors(model, batch))}
    np.savez(out, **found)


if __name__ == "__main__":
    _main(*sys.argv[1:])
