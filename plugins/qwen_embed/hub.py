"""A checkpoint named as users name it: a directory, a Hugging Face model id, or a cache snapshot.

An id (`Qwen/Qwen3-Embedding-0.6B`) is looked up in the local Hugging Face cache (`HF_HUB_CACHE`,
else `HF_HOME/hub`, else ~/.cache/huggingface/hub) and, when that has no copy and the network is
allowed (`HF_HUB_OFFLINE` unset), downloaded there: only the files the server reads.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from . import finetunes, gguf_files
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
    (finetunes.py); a GGUF file, or a folder holding one, as a checkpoint directory of its own
    (gguf_files.py). Raises CheckpointNotFoundError naming the id and the cache when neither
    works."""
    if gguf_files.is_gguf(Path(name).expanduser()):
        return gguf_files.checkpoint(Path(name).expanduser())
    path = locate(name)
    if not finetunes.is_finetune(path):
        return path
    base = finetunes.base_name(path)
    try:
        return finetunes.checkpoint(path, resolve_checkpoint(base))
    except CheckpointNotFoundError as e:
        raise CheckpointNotFoundError(f"{name} is a fine-tune of {base}: {e}") from e


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
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache()
    try:
        return Path(snapshot_download(str(name), cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if _offline():
        raise CheckpointNotFoundError(
            f"model {name} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set: "
            f"download it where there is network (huggingface-cli download {name}) into that "
            "cache, or point at a checkpoint directory"
        )
    try:
        snapshot = snapshot_download(str(name), cache_dir=cache, allow_patterns=CHECKPOINT_FILES)
    except Exception as e:  # network, auth, unknown repo: one clear message
        raise CheckpointNotFoundError(
            f"model {name} is not in the Hugging Face cache {cache} and downloading it failed: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    return Path(snapshot)
