"""The CPU heap policy: freed memory kept for reuse, bounded (cpu.keep_freed_memory, HeapTrimmer).

Varlen forwards allocate new sizes every time; with freed memory kept (no mmap, no trimming)
the heap fragments and creeps up. HeapTrimmer gives the free pages back once more than one
full-budget forward's worth is held. Memory here is measured, not timed.
"""

import numpy as np
import pytest

from qwen_embed import Encoder
from qwen_embed.cpu import HeapTrimmer, anonymous_bytes, keep_freed_memory
from qwen_embed.engine import forward_bytes

MB = 2**20


@pytest.fixture(scope="module")
def glibc():
    if not keep_freed_memory():
        pytest.skip("not glibc: freed memory goes back as the allocator decides")
    if not HeapTrimmer(0).active:
        pytest.skip("glibc without mallinfo2 (< 2.33): no trimming")


def churn(total_mb: int) -> None:
    """Allocate and free blocks of many sizes, as forwards of new token counts do."""
    rng = np.random.default_rng(0)
    blocks = [np.ones(int(rng.integers(1, 8)) * MB // 8) for _ in range(total_mb // 4)]
    del blocks


def test_trims_only_beyond_what_it_keeps(glibc):
    trimmer = HeapTrimmer(64 * MB)
    churn(32)  # kept: under the bound
    trimmer()
    assert trimmer.trims == 0
    churn(400)  # kept by glibc (no mmap, no trim), beyond the bound
    held = trimmer.free_resident_bytes()
    assert held > 64 * MB
    before = anonymous_bytes()
    trimmer()
    assert trimmer.trims == 1
    assert trimmer.free_resident_bytes() < 64 * MB
    assert anonymous_bytes() < before - (held - 64 * MB) // 2


def test_cpu_encoders_trim_after_forwards(glibc, checkpoint):
    with Encoder.from_pretrained(checkpoint("qwen3"), dtype="float32", max_batch_tokens=512) as enc:
        (hook,) = enc.model._forward_hooks.values()
        assert isinstance(hook, HeapTrimmer)
        assert hook.keep_bytes == forward_bytes(enc.config, 512, "float32", 1) < 8 * MB
        enc.embed([list(range(1, 40))])
        churn(200)  # what fragmentation would leave: more than one forward's worth
        trims = hook.trims
        enc.embed([list(range(1, 40)), list(range(3, 300))])
        assert hook.trims == trims + 1


def test_asks_malloc_only_when_resident_memory_grew(glibc, monkeypatch):
    # mallinfo2 walks malloc's free lists (milliseconds): not on every forward of a steady heap.
    trimmer = HeapTrimmer(64 * MB)
    asked = []
    in_use = trimmer._in_use
    monkeypatch.setattr(trimmer, "_in_use", lambda: asked.append(1) or in_use())
    for _ in range(5):
        trimmer()
    assert asked == []
    grown = np.ones(64 * MB // 8)  # resident memory grows past the last look (held, in use)
    trimmer()
    assert len(asked) == 1 and trimmer.trims == 0
    trimmer()
    assert len(asked) == 1
    del grown


def test_pages_of_mapped_files_are_not_freed_heap(glibc, tmp_path):
    """A mapped file's pages (a checkpoint's embedding table, layers.VocabParallelEmbedding)
    grow resident memory as they are read, but trimming the heap cannot give them back."""
    path = tmp_path / "table.bin"
    np.ones(192 * MB // 8).tofile(path)
    trimmer = HeapTrimmer(64 * MB)
    held = trimmer.free_resident_bytes()
    mapped = np.memmap(path, dtype=np.float64, mode="r")
    assert mapped.sum() == len(mapped)  # every page read
    assert trimmer.free_resident_bytes() < held + 16 * MB
    trimmer()
    assert trimmer.trims == 0
