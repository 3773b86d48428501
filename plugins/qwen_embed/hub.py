"""A checkpoint named as users name it: a directory, a Hugging Face model id, a cache snapshot,
a GGUF file, or a model Ollama pulled.

An id (`Qwen/Qwen3-Embedding-0.6B`) is looked up in the local Hugging Face cache (`HF_HUB_CACHE`,
else `HF_HOME/hub`, else ~/.cache/huggingface/hub) and, when that has no copy and the network is
allowed (`HF_HUB_OFFLINE` unset), downloaded there: only the files the server reads.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from . import finetunes, gguf_files, gguf_vision, ollama_store
from .config import GME_SCRIPT

# configs, tokenizer files, chat templates (a CrossEncoder's pairs) and weights: never
# pickles, never the remote code (GME's script is fetched, never run: its presence names
# the checkpoint, config.gme_architectures)
CHECKPOINT_FILES = [
    "*.json",
    "*.jinja",
    "*.safetensors",
    "*/config.json",
    "tokenizer.model",
    "*.txt",
    GME_SCRIPT,
]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# one file of a GGUF repository, named as llama.cpp's `-hf` names it: owner/name:TYPE (Q8_0, f16)
_GGUF_ID = re.compile(r"^([A-Za-z0-9][\w.-]*/[\w.-]+):([\w.-]+)$")
# A GGUF repository's vision tower files are named so (llama.cpp's -hf takes none as a model)
_TOWER_NAME = "mmproj"
_FILE_TYPE = re.compile(r"[-.]([A-Za-z0-9_]+)$")  # a file name's type: Q8_0, f16, Q4_K_M


class CheckpointNotFoundError(FileNotFoundError):
    pass


def hub_cache() -> Path:
    """Where huggingface_hub keeps models, read from the environment at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def resolve_checkpoint(name: str | Path) -> Path:
    """A directory holding config.json: `name` itself, or the cached (else downloaded)
    snapshot of the Hugging Face model id `name`; a LoRA fine-tune (either) over its base
    (finetunes.py); a GGUF file, a folder holding one, or a GGUF repository's file by type
    (`Qwen/Qwen3-Embedding-0.6B-GGUF:Q8_0`) or a model Ollama pulled
    (`ollama:qwen3-embedding:0.6b`, ollama_store.py), as a checkpoint directory of its own
    (gguf_files.py). Raises CheckpointNotFoundError naming the id and the cache when neither
    works."""
    if (gguf := _gguf_file(name)) is not None:
        return gguf_files.checkpoint(*gguf)
    path = locate(name)
    if not finetunes.is_finetune(path):
        return path
    base = finetunes.base_name(path)
    try:
        return finetunes.checkpoint(path, resolve_checkpoint(base))
    except CheckpointNotFoundError as e:
        raise CheckpointNotFoundError(f"{name} is a fine-tune of {base}: {e}") from e


def _gguf_file(name: str | Path) -> tuple[Path, Path | None] | None:
    """The GGUF file `name` names, if it names one, and its vision tower's file where the name
    says which (else a Qwen3-VL model's is the one beside it): a model Ollama pulled, a file
    (or a folder of one), or a GGUF repository's file by type."""
    if str(name).startswith(ollama_store.PREFIX):
        try:
            return ollama_store.model_files(str(name).removeprefix(ollama_store.PREFIX))
        except ollama_store.OllamaModelNotFoundError as e:
            raise CheckpointNotFoundError(str(e)) from None
    path = Path(name).expanduser()
    if gguf_files.is_gguf(path):
        return path, None
    if not path.exists() and (match := _GGUF_ID.match(str(name))):
        return _hub_gguf(match[1], match[2])
    return None


def locate(name: str | Path) -> Path:
    """`name` as a directory (a checkpoint's or a fine-tune's), or the Hub snapshot of the
    model id `name`."""
    path = Path(name).expanduser()
    if (path / "config.json").is_file() or finetunes.is_finetune(path):
        return path
    if path.exists() or not _REPO_ID.match(str(name)):
        raise CheckpointNotFoundError(
            f"{name} is neither a checkpoint directory (no config.json or "
            f"{finetunes.ADAPTER_CONFIG} there), a GGUF file, nor a Hugging Face model id "
            "like Qwen/Qwen3-Embedding-0.6B"
        )
    return _snapshot(str(name), CHECKPOINT_FILES)


def _hub_gguf(repo: str, kind: str) -> tuple[Path, Path | None]:
    """The GGUF model file of type `kind` (its name holds it, in any case) in the Hugging Face
    repository `repo`, from the local cache, else downloaded alone; for a Qwen3-VL text model
    also its tower's file, as llama.cpp's `-hf` picks it (`_tower_of`)."""

    def files(snapshot: Path) -> list[Path]:
        return [
            p
            for p in sorted(snapshot.glob("*.gguf"))
            if kind.lower() in p.name.lower() and _TOWER_NAME not in p.name.lower()
        ]

    patterns = [f"*{k}*.gguf" for k in sorted({kind, kind.upper(), kind.lower()})]
    found = files(_snapshot(repo, patterns, lambda snapshot: bool(files(snapshot))))
    if len(found) != 1:
        raise CheckpointNotFoundError(
            f"{repo} holds {len(found)} GGUF files of type {kind} "
            f"({', '.join(p.name for p in found)}): name one type"
        )
    text = found[0]
    if gguf_files.architecture(text) != gguf_vision.TEXT_ARCHITECTURE:
        return text, None
    return text, _tower_of(repo, text)


def _tower_of(repo: str, text: Path) -> Path | None:
    """A Qwen3-VL text model's tower file in its repository, as llama.cpp's `-hf` picks it:
    of the files named with "mmproj", the one whose type's bits are nearest the model file's
    (the first by name of equals); from the cache, else listed and downloaded alone. None
    where there is none (gguf_files.checkpoint then says what is missing)."""
    names = [p.name for p in sorted(text.parent.glob("*.gguf")) if _TOWER_NAME in p.name.lower()]
    if not names and not _offline():
        from huggingface_hub import list_repo_files

        listed = list_repo_files(repo)
        names = sorted(f for f in listed if _TOWER_NAME in f.lower() and f.endswith(".gguf"))
        names = [f for f in names if "/" not in f]  # beside the model file, at the top
    if not names:
        return None
    bits = _type_bits(text.name)
    name = min(names, key=lambda f: abs(_type_bits(f) - bits))
    if (text.parent / name).is_file():
        return text.parent / name
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo, name, cache_dir=hub_cache()))


def _type_bits(name: str) -> int:
    """The bits a GGUF file's name gives its type (Q8_0: 8, f16: 16, Q4_K_M: 4; none: 0)."""
    match = _FILE_TYPE.search(name.removesuffix(".gguf"))
    digits = re.search(r"\d+", match[1]) if match else None
    return int(digits[0]) if digits else 0


def _snapshot(name: str, patterns: list[str], holds=lambda snapshot: True) -> Path:
    """The Hub snapshot of the model id `name`: the cached one where it `holds` what is
    wanted, else its files matching `patterns` downloaded into the cache (never with
    HF_HUB_OFFLINE set)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache()
    try:
        cached = Path(snapshot_download(name, cache_dir=cache, local_files_only=True))
        if holds(cached):
            return cached
    except LocalEntryNotFoundError:
        pass
    if _offline():
        raise CheckpointNotFoundError(
            f"model {name} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set: "
            f"download it where there is network (huggingface-cli download {name}) into that "
            "cache, or point at a checkpoint directory"
        )
    try:
        snapshot = snapshot_download(name, cache_dir=cache, allow_patterns=patterns)
    except Exception as e:  # network, auth, unknown repo: one clear message
        raise CheckpointNotFoundError(
            f"model {name} is not in the Hugging Face cache {cache} and downloading it failed: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    return Path(snapshot)
