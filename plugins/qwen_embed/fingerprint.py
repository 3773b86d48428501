"""A model's fingerprint: a stable hash of what fixes its vectors, so an index can tell when
vectors came from another model or another route.

It covers every file of the checkpoint that the model reads (weights, config, tokenizer files,
prompts, pooling: everything but documentation), hashed by content, and the serving choices
that change the numbers (tokens per text and truncation side; dtype, linear route, attention
backend, pooling, device kind). Tuning that leaves the vectors alone (batch sizes, instance
counts, prefix reuse, pruning) is left out. A weight file in the Hugging Face cache is a link to
a blob named by its SHA-256, which is taken as its hash without reading it.
"""

from __future__ import annotations

import hashlib
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tokenizer models read fingerprints without importing torch
    from .route import Route

_NOT_READ = re.compile(r"(\.md|\.png|\.jpg|\.jpeg|\.gif|\.svg|\.gitattributes|LICENSE.*)$", re.I)
_BLOB = re.compile(r"[0-9a-f]{64}")


def fingerprint(parts: dict) -> str:
    """32 hex digits of SHA-256 over `parts` (JSON, keys sorted)."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@lru_cache(maxsize=8)
def checkpoint_digest(model_dir: Path) -> str:
    """SHA-256 over the checkpoint's files that fix the vectors: each name and content hash."""
    h = hashlib.sha256()
    for path in sorted(Path(model_dir).rglob("*")):
        relative = path.relative_to(model_dir)
        hidden = any(part.startswith(".") for part in relative.parts)
        if hidden or not path.is_file() or _NOT_READ.search(path.name):
            continue
        h.update(f"{relative.as_posix()}\0{_file_hash(path)}\n".encode())
    return h.hexdigest()


def _file_hash(path: Path) -> str:
    real = path.resolve()
    if real.parent.name == "blobs" and _BLOB.fullmatch(real.name):
        return real.name
    with open(real, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tokenizer_fingerprint(model_dir: Path, tokens_per_text: int, truncation_direction: str) -> str:
    return fingerprint(
        {
            "checkpoint": checkpoint_digest(Path(model_dir)),
            "tokens_per_text": tokens_per_text,
            "truncation_direction": truncation_direction,
        }
    )


def adapter_fingerprint(folder: Path) -> str:
    """A LoRA adapter a request names (lora.py), by its files' content: its vectors' whole
    fingerprint is its model's and this together (contract.model_fingerprint)."""
    return fingerprint({"adapter": checkpoint_digest(Path(folder))})


def encoder_fingerprint(model_dir: Path, route: Route) -> str:
    parts = {
        "checkpoint": checkpoint_digest(Path(model_dir)),
        "device": route.device.split(":")[0],
        "dtype": route.dtype,
        "linear": route.linear.value,
        "attention": route.attn_backend,
        "pooling": route.pooling,
        "task": route.task,
    }
    if route.adapter is not None:  # absent otherwise: earlier fingerprints stay what they were
        parts["adapter"] = route.adapter
    return fingerprint(parts)
