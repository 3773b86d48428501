"""A LoRA fine-tune as peft and sentence-transformers save it, served as a checkpoint.

Such a directory holds the adapter (`adapter_config.json`, `adapter_model.safetensors`), the
tokenizer and sentence-transformers files, and no weights (often no config.json) of its own: its
base model is `base_model_name_or_path` (a directory or a Hugging Face id). `checkpoint` lays out a
directory of links that the rest of the server reads as any other checkpoint: the base's files,
the fine-tune's own files over them, and the adapter under `adapters/` (adapters.py), which the
encoder merges into the base weights at load.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from .adapters import ADAPTERS, AdapterError
from .derived_dirs import made_once
from .loader import read_json

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# the name the fine-tune's adapter takes under adapters/ (the encoder's parameter `adapter`)
NAME = "lora"
# weights and training state a fine-tune folder may keep beside the adapter: never the model's
_NOT_TAKEN = (".safetensors", ".bin", ".pt", ".pth", ".pkl", ".ckpt", ".gguf")


def is_finetune(directory: Path) -> bool:
    """An adapter without weights of its own (a copy of the base's config.json, which some
    trainers save beside it, does not make it a checkpoint)."""
    weights = [p for p in directory.glob("*.safetensors") if p.name != ADAPTER_WEIGHTS]
    return (directory / ADAPTER_CONFIG).is_file() and not weights


def base_name(directory: Path) -> str:
    """The base model a fine-tune names (the adapter's kind is checked where it is merged:
    adapters.lora_deltas)."""
    config = read_json(directory / ADAPTER_CONFIG)
    if not config.get("base_model_name_or_path"):
        raise AdapterError(f"{directory / ADAPTER_CONFIG} names no base_model_name_or_path")
    if not (directory / ADAPTER_WEIGHTS).is_file():
        raise AdapterError(f"{directory} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}")
    return config["base_model_name_or_path"]


def checkpoint(directory: Path, base: Path) -> Path:
    """The fine-tune in `directory` over its resolved `base` as one checkpoint directory of
    links, made once per version of their files (processes that start together share it)."""
    if (base / ADAPTERS).is_dir():
        raise AdapterError(
            f"{directory}'s base {base} already has adapters ({ADAPTERS}/): an adapter over "
            "adapters is not served; merge the base's first"
        )
    files = {root: _files(root) for root in (base, directory)}

    def write(building: Path) -> None:
        for relative, source in files[base].items():
            _link(building / relative, source)
        for relative, source in files[directory].items():
            if relative.name not in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) and (
                relative.suffix not in _NOT_TAKEN
            ):
                _link(building / relative, source)
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            _link(building / ADAPTERS / NAME / name, directory / name)

    return made_once("qwen-embed-finetunes", _version(files), write)


def _files(root: Path) -> dict[Path, Path]:
    """Relative path -> file, for the files under `root` outside hidden folders."""
    return {
        path.relative_to(root): path.absolute()
        for path in sorted(root.rglob("*"))
        if path.is_file() and not any(p.startswith(".") for p in path.relative_to(root).parts)
    }


def _link(link: Path, source: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(source)


def _version(files: dict[Path, dict[Path, Path]]) -> str:
    """A name for the directories' files (`_files` of each) as they are now: paths, sizes,
    times."""
    h = hashlib.sha256()
    for root, listed in files.items():
        h.update(f"{root.resolve()}\n".encode())
        for relative, path in listed.items():
            stat = path.stat()
            h.update(f"{relative}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]
