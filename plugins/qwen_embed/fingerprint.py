"""A model's fingerprint: a stable hash of what fixes its vectors, so an index can tell when
vectors came from another model or another route.

It covers every file of the checkpoint that the model reads (weights, config, tokenizer files,
prompts, pooling: everything but documentation), hashed by content, and the serving choices
that change the numbers (tokens per text and truncation side; dtype, linear route, attention
backend, pooling, device kind). Tuning that leaves the vectors alone (batch sizes, instance
counts, prefix reuse, pruning) is left out. A weight file in the Hugging Face cache is a link to
a blob named by its SHA-256 (as is a model file in Ollama's store), which is taken as its hash
without reading it; other large files' hashes are kept across processes (KnownHashes), so a
server that starts again on the same checkpoint does not read its weights through once more.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tokenizer models read fingerprints without importing torch
    from .route import Route

_NOT_READ = re.compile(r"(\.md|\.png|\.jpg|\.jpeg|\.gif|\.svg|\.gitattributes|LICENSE.*)$", re.I)
_BLOB = re.compile(r"(?:sha256-)?([0-9a-f]{64})")  # Hugging Face's cache, Ollama's store


def fingerprint(parts: dict) -> str:
    """32 hex digits of SHA-256 over `parts` (JSON, keys sorted)."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class KnownHashes:
    """Large files' SHA-256 kept in one JSON file (`path`), each under its resolved path with
    what moves when its content may have changed (size, modification and status-change times,
    inode: git's test of a changed file). The times are read before the content, so a file
    written during its hash is hashed again next time. A file not known here is looked up in
    the kept file first (another process may have hashed it meanwhile). Where the file cannot
    be written, the hashes are only this process's."""

    MIN_BYTES = 1 << 20  # smaller files (configs, prompts) are hashed anew: less to keep

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, list] = {}
        self._lock = threading.Lock()  # checkpoint_digest hashes files in threads

    def _read(self) -> dict[str, list]:
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return entries if isinstance(entries, dict) else {}

    def sha256(self, real: Path) -> str:
        st = real.stat()
        if st.st_size < self.MIN_BYTES:
            return _sha256(real)
        stamp, key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino], str(real)

        def current(entry) -> bool:
            return isinstance(entry, list) and entry[:4] == stamp

        entry = self.entries.get(key)
        if not current(entry):  # the kept file is read only for what this process misses
            entry = self._read().get(key)
        if current(entry):
            self.entries[key] = entry
            return entry[4]
        digest = _sha256(real)
        with self._lock:
            self.entries[key] = [*stamp, digest]
            self._write()
        return digest

    def _write(self) -> None:
        """The entries merged over the file's (other servers write it too), those of files
        that are gone left out, written whole or not at all."""
        merged = {**self._read(), **self.entries}
        self.entries = {p: e for p, e in merged.items() if os.path.exists(p)}
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(self.entries))
            os.replace(partial, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                partial.unlink()


@lru_cache(maxsize=8)
def checkpoint_digest(model_dir: Path, known: KnownHashes | None = None) -> str:
    """SHA-256 over the checkpoint's files that fix the vectors: each name and content hash.
    The files are hashed in threads (hashlib lets go of the GIL): a sharded checkpoint's
    shards at once."""
    files = []
    for path in sorted(Path(model_dir).rglob("*")):
        relative = path.relative_to(model_dir)
        hidden = any(part.startswith(".") for part in relative.parts)
        if hidden or not path.is_file() or _NOT_READ.search(path.name):
            continue
        files.append((relative.as_posix(), path))
    workers = max(1, min(len(files), len(os.sched_getaffinity(0)), 8))
    with ThreadPoolExecutor(workers) as pool:
        hashes = pool.map(lambda file: _file_hash(file[1], known), files)
        h = hashlib.sha256()
        for (relative, _), digest in zip(files, hashes, strict=True):
            h.update(f"{relative}\0{digest}\n".encode())
    return h.hexdigest()


def _file_hash(path: Path, known: KnownHashes | None) -> str:
    real = path.resolve()
    if real.parent.name == "blobs" and (blob := _BLOB.fullmatch(real.name)):
        return blob[1]
    return known.sha256(real) if known else _sha256(real)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tokenizer_fingerprint(
    model_dir: Path,
    tokens_per_text: int,
    truncation_direction: str,
    known: KnownHashes | None = None,
) -> str:
    return fingerprint(
        {
            "checkpoint": checkpoint_digest(Path(model_dir), known),
            "tokens_per_text": tokens_per_text,
            "truncation_direction": truncation_direction,
        }
    )


def adapter_fingerprint(
    folder: Path, known: KnownHashes | None = None, task: str | None = None
) -> str:
    """A LoRA adapter a request names (lora.py), by its files' content (and the task it reads
    of an adapter of several): its vectors' whole fingerprint is its model's and this together
    (contract.model_fingerprint)."""
    parts = {"adapter": checkpoint_digest(Path(folder), known)}
    if task is not None:  # absent otherwise: earlier fingerprints stay what they were
        parts["task"] = task
    return fingerprint(parts)


def encoder_fingerprint(model_dir: Path, route: Route, known: KnownHashes | None = None) -> str:
    parts = {
        "checkpoint": checkpoint_digest(Path(model_dir), known),
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
