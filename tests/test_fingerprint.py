"""The model fingerprint: it moves with what fixes the vectors and with nothing else."""

import hashlib
import json
import os
import shutil
from dataclasses import replace

import pytest

from qwen_embed.engine import plan
from qwen_embed.fingerprint import (
    KnownHashes,
    checkpoint_digest,
    encoder_fingerprint,
    tokenizer_fingerprint,
)
from qwen_embed.route import Linear
from qwen_embed.settings import EncoderSettings
from qwen_embed_client.contract import model_fingerprint


def _copy(demo_dir, where):
    shutil.copytree(demo_dir, where)
    checkpoint_digest.cache_clear()
    return where


@pytest.mark.server  # whole-model runs: seconds each
def test_fingerprint_follows_weights_tokenizer_and_route_only(demo_dir, tmp_path):
    model = _copy(demo_dir, tmp_path / "model")
    _, _, route = plan(model, EncoderSettings(device="cpu", dtype="float32"))
    base = encoder_fingerprint(model, route), tokenizer_fingerprint(model, 512, "right")
    # another route over the same files: another encoder fingerprint
    bf16 = replace(route, dtype="bfloat16")
    assert encoder_fingerprint(model, bf16) != base[0]
    other = replace(route, linear=Linear.INT8)
    assert encoder_fingerprint(model, other) != base[0]
    assert tokenizer_fingerprint(model, 256, "right") != base[1]
    assert tokenizer_fingerprint(model, 512, "left") != base[1]
    # tuning that leaves the vectors alone: the same
    tuned = replace(route, prefix_reuse=not route.prefix_reuse)
    assert encoder_fingerprint(model, tuned) == base[0]
    (model / "README.md").write_text("# notes")
    checkpoint_digest.cache_clear()
    assert encoder_fingerprint(model, route) == base[0]
    # one byte of the weights: every fingerprint moves
    weights = next(model.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    checkpoint_digest.cache_clear()
    assert encoder_fingerprint(model, route) != base[0]
    assert tokenizer_fingerprint(model, 512, "right") != base[1]
    assert model_fingerprint({"fingerprint": "a"}, {"fingerprint": "b"}) != model_fingerprint(
        {"fingerprint": "a"}, {"fingerprint": "c"}
    )
    assert model_fingerprint({}, {"fingerprint": "b"}) is None
    # a request's adapter (lora.py): its own fingerprint with the model's
    encoder = {"fingerprint": "b", "adapter_fingerprints": {"x": "c", "y": "d"}}
    tokenizer = {"fingerprint": "a"}
    by_adapter = {model_fingerprint(tokenizer, encoder, name) for name in (None, "x", "y")}
    assert len(by_adapter) == 3 and model_fingerprint(tokenizer, encoder, "z") is None


@pytest.mark.parametrize("prefix", ["", "sha256-"])  # Hugging Face's cache, Ollama's store
def test_a_cache_blob_is_hashed_by_its_name(demo_dir, tmp_path, prefix):
    """A snapshot's files are links to blobs named by their SHA-256: taken without reading."""
    model = _copy(demo_dir, tmp_path / "model")
    expected = checkpoint_digest(model)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for path in model.iterdir():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copy(path, blobs / f"{prefix}{digest}")
        os.symlink(blobs / f"{prefix}{digest}", snapshot / path.name)
    checkpoint_digest.cache_clear()
    assert checkpoint_digest(snapshot) == expected
    # a blob whose name is its hash is not read: a blob edited in place keeps the name's hash
    big = max(blobs.iterdir(), key=lambda p: p.stat().st_size)
    big.write_bytes(b"changed")
    checkpoint_digest.cache_clear()
    assert checkpoint_digest(snapshot) == expected


def test_a_large_files_hash_is_kept_until_the_file_changes(tmp_path):
    """KnownHashes: a restart takes a weight file's hash from the kept entry while its size,
    times and inode are the same; any change and the file is read again."""
    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(os.urandom(KnownHashes.MIN_BYTES + 7))
    (model / "config.json").write_text("{}")
    kept = tmp_path / "cache" / "hashes.json"
    plain = checkpoint_digest(model)
    assert checkpoint_digest(model, KnownHashes(kept)) == plain
    entries = json.loads(kept.read_text())
    assert list(entries) == [str(weights.resolve())]  # small files are not kept
    assert entries[str(weights.resolve())][4] == hashlib.sha256(weights.read_bytes()).hexdigest()

    # a kept entry is taken without reading the file: one planted for it is what the digest uses
    entries[str(weights.resolve())][4] = "0" * 64
    kept.write_text(json.dumps(entries))
    checkpoint_digest.cache_clear()
    assert checkpoint_digest(model, KnownHashes(kept)) != plain

    # the same size and modification time, other bytes: the status-change time moved, read again
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[0] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    checkpoint_digest.cache_clear()
    changed = checkpoint_digest(model)
    assert changed != plain
    assert checkpoint_digest(model, KnownHashes(kept)) == changed

    # a file that is gone leaves the kept file at its next write
    other = tmp_path / "other"
    shutil.copytree(model, other)
    checkpoint_digest.cache_clear()
    checkpoint_digest(other, KnownHashes(kept))
    assert len(json.loads(kept.read_text())) == 2
    shutil.rmtree(model)
    (other / "model.safetensors").write_bytes(os.urandom(KnownHashes.MIN_BYTES))
    checkpoint_digest.cache_clear()
    checkpoint_digest(other, KnownHashes(kept))
    assert list(json.loads(kept.read_text())) == [str((other / "model.safetensors").resolve())]

    # nowhere to keep them: the digest all the same
    checkpoint_digest.cache_clear()
    nowhere = KnownHashes(tmp_path / "cache" / "hashes.json" / "below-a-file.json")
    assert checkpoint_digest(other, nowhere) == checkpoint_digest(other)
