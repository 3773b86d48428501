"""Bulk embedding jobs that survive interruption: output in shards, resumed where it stopped.

    qwen-embed embed --input big.jsonl -o out/ [--shard-size 4096] [--id-field id]

`out/` holds `manifest.json` (the input's text count and digest, the options, the shard size)
and, for shard k (texts k*S .. k*S+S-1 of the input, in input order), `shard-0000k.ids.npy`
(each text's id: the JSONL field --id-field where present, else its index among the texts)
and `shard-0000k.npy` (its vectors). Each file is written under a temporary name and renamed,
the vectors last: a shard whose vectors file exists is complete. Run the same command again
after Ctrl-C or a crash and it skips the complete shards; a shard that was in flight is
embedded again, so the output never holds a text twice or misses one. Another input or other
options in an existing directory are refused rather than mixed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .client import EmbeddingError

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Shards:
    """`count` items in shards of `size`, in order: the unit a job writes, and redoes after an
    interruption. Shared by the CLI's bulk jobs and the gateway's Batch API."""

    count: int
    size: int

    def __len__(self) -> int:
        return -(-self.count // self.size)

    def span(self, k: int) -> range:
        return range(k * self.size, min(self.count, (k + 1) * self.size))


def write_atomic(path: Path, save) -> None:
    """`save(tmp)` then rename: a file that exists under its name is complete."""
    tmp = path.with_name(path.name + ".partial")
    save(tmp)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Job:
    out: Path
    texts: list[str]
    ids: list
    options: dict
    shard_size: int

    @property
    def shards(self) -> int:
        return len(Shards(len(self.texts), self.shard_size))

    def vectors_path(self, k: int) -> Path:
        return self.out / f"shard-{k:05d}.npy"

    def ids_path(self, k: int) -> Path:
        return self.out / f"shard-{k:05d}.ids.npy"

    def manifest(self) -> dict:
        digest = hashlib.sha256()
        for text in self.texts:
            digest.update(text.encode("utf-8") + b"\0")
        return {
            "texts": len(self.texts),
            "sha256": digest.hexdigest(),
            "shard_size": self.shard_size,
            "options": self.options,
        }

    def done(self) -> list[int]:
        return [k for k in range(self.shards) if self.vectors_path(k).exists()]


def prepare(job: Job) -> None:
    """Create the directory and its manifest, or check that an existing one is this job's."""
    if job.shard_size < 1:
        raise ValueError(f"--shard-size must be >= 1, got {job.shard_size}")
    job.out.mkdir(parents=True, exist_ok=True)
    path = job.out / MANIFEST
    wanted = job.manifest()
    if path.exists():
        found = json.loads(path.read_text())
        if found != wanted:
            changed = sorted(k for k in wanted if found.get(k) != wanted[k])
            raise ValueError(
                f"{job.out} holds another job (its {', '.join(changed)} differ); "
                "use another output directory"
            )
        return
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(wanted, indent=1)))


def _save_npy(path: Path, array: np.ndarray) -> None:
    def save(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, array)

    write_atomic(path, save)


def id_array(ids: list) -> np.ndarray:
    if all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return np.array(ids, dtype=np.int64)
    return np.array([str(i) for i in ids])


class Progress:
    """texts done / total, tokens/s and the time left, on one terminal line."""

    def __init__(self, total: int, already: int, stream=sys.stderr):
        self.total, self.done, self.stream = total, already, stream
        self.start, self.tokens, self.texts = time.monotonic(), 0, 0
        self.tty = stream.isatty()

    def update(self, texts: int, tokens: int) -> None:
        self.done += texts
        self.texts += texts
        self.tokens += tokens
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.texts / elapsed
        eta = (self.total - self.done) / rate if rate else 0
        line = (
            f"{self.done}/{self.total} texts, {self.tokens / elapsed:.0f} tokens/s, "
            f"{_duration(eta)} left"
        )
        end = "" if self.done < self.total else "\n"
        self.stream.write(f"\r{line}{end}" if self.tty else line + "\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def run(job: Job, embed, show: bool) -> int:
    """Embed the shards not yet written; `embed(texts)` -> EmbeddingResult. Returns how many
    shards this run wrote."""
    prepare(job)
    done = set(job.done())
    progress = Progress(len(job.texts), sum(len(_span(job, k)) for k in done)) if show else None
    written = 0
    for k in range(job.shards):
        if k in done:
            continue
        span = _span(job, k)
        try:
            result = embed([job.texts[i] for i in span])
        except EmbeddingError as e:
            raise e.counted_from(span.start) from None
        _save_npy(job.ids_path(k), id_array([job.ids[i] for i in span]))
        _save_npy(job.vectors_path(k), result.embeddings)
        written += 1
        if progress:
            progress.update(len(span), result.total_tokens)
    return written


def _span(job: Job, k: int) -> range:
    return Shards(len(job.texts), job.shard_size).span(k)


def load(out: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(ids, vectors) of a finished job directory, in input order."""
    out = Path(out)
    manifest = json.loads((out / MANIFEST).read_text())
    shards = -(-manifest["texts"] // manifest["shard_size"])
    ids = [np.load(out / f"shard-{k:05d}.ids.npy") for k in range(shards)]
    vectors = [np.load(out / f"shard-{k:05d}.npy") for k in range(shards)]
    return np.concatenate(ids), np.concatenate(vectors)
