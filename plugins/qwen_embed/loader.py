"""Load a local Hugging Face checkpoint (safetensors, or a GGUF file as gguf_files.py lays it
out: nothing is ever unpickled)."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from . import gguf_files, gguf_vision

if TYPE_CHECKING:  # checkpoint_files serves processes without torch (sentence_modules.py)
    from torch import nn

# Present in causal-LM / classifier checkpoints, top-level projections (voyage-4-nano's
# `linear`, ColQwen3's `embedding_proj_layer`, colpali-engine's `custom_text_proj`,
# jina-embeddings-v4's `multi_vector_projector`, which heads.py reads itself),
# jina-reranker-v3's `projector` and the attention pooling of CodeFuse's embedders
# (`mha_pma`); skipped unless a task head or the pooler asks for them (rank 0's only).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_IGNORED_PREFIXES = (
    "lm_head.",
    "score.",
    "linear.",
    "projector.",
    "embedding_proj_layer.",
    "custom_text_proj.",
    "multi_vector_projector.",
    "mha_pma.",
    "mtp.",  # Qwen3.5's multi-token prediction layers (generation only)
)


class CheckpointError(ValueError):
    pass


# What a clone without git-lfs leaves in place of each large file.
LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def unreadable(path: Path, problem: str) -> str:
    """An error's words for a checkpoint file that cannot be read: `problem`, or for a Git LFS
    pointer, lfs_pointer's."""
    return lfs_pointer(path) or f"{path} {problem}"


def lfs_pointer(path: Path) -> str | None:
    """Where `path` is a Git LFS pointer, what it is and how to fetch the file; else None."""
    try:
        with open(path, "rb") as f:
            pointer = f.read(len(LFS_POINTER)) == LFS_POINTER
    except OSError:
        pointer = False
    if not pointer:
        return None
    return (
        f"{path} is a Git LFS pointer, not the file: fetch the files (git lfs pull) or "
        "download the checkpoint with huggingface-cli"
    )


def safetensors_file(path: Path, framework: str = "pt"):
    """safetensors' safe_open on a checkpoint file (for its `with`); one it cannot read:
    CheckpointError naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework=framework)
    except SafetensorError as e:
        raise CheckpointError(unreadable(Path(path), f"is not a safetensors file: {e}")) from None


def read_json(path: Path, default=None):
    """A checkpoint's JSON file; where it is absent, `default` if given. One that does not
    parse: CheckpointError naming it."""
    if default is not None and not path.is_file():
        return default
    try:
        return json.loads(path.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise CheckpointError(unreadable(path, f"is not valid JSON: {e}")) from None


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index)["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files and (model_dir / gguf_files.FILE).is_file():
        tower = model_dir / gguf_vision.PROJECTOR  # a Qwen3-VL model's
        return [model_dir / gguf_files.FILE] + ([tower] if tower.is_file() else [])
    if not files:
        raise CheckpointError(
            f"no *.safetensors in {model_dir}; only safetensors checkpoints and GGUF files "
            "(named as the model) are loaded (pickled .bin/.pt files are refused because "
            "unpickling can run code)"
        )
    return files


def checkpoint_names(model: nn.Module) -> dict[str, list[tuple[nn.Parameter, str | None]]]:
    """Checkpoint tensor name (without "model.") -> [(our parameter, packed shard id)].

    A parameter with a `checkpoint_name` (a task head) reads that tensor, which may also feed
    another parameter (tied embeddings)."""
    packed = getattr(model, "packed_modules", {})
    names: dict[str, list[tuple[nn.Parameter, str | None]]] = {}
    for name, param in model.named_parameters():
        shards = [
            (name.replace(f".{ours}.", f".{ckpt_module}."), shard_id)
            for ckpt_module, (ours, shard_id) in packed.items()
            if f".{ours}." in name
        ]
        if hasattr(param, "checkpoint_name"):
            shards = [(param.checkpoint_name, None)]
        for ckpt_name, shard_id in shards or [(name, None)]:
            names.setdefault(ckpt_name, []).append((param, shard_id))
    return names


def _dtypes() -> dict:
    import torch

    return {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
    }


def _header(path: Path) -> tuple[int, dict]:
    """A safetensors file's header size and its entries: key -> (dtype name, shape, begin,
    end); a file shorter than its header says (a download cut short): CheckpointError."""
    try:
        with open(path, "rb") as f:
            size, file_size = int.from_bytes(f.read(8), "little"), path.stat().st_size
            if size > file_size - 8:
                raise ValueError(f"a header of {size} bytes in a file of {file_size}")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        entries = {k: (e["dtype"], e["shape"], *e["data_offsets"]) for k, e in header.items()}
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(unreadable(path, f"is not a safetensors file: {e!r}")) from e
    data = max((entry[3] for entry in entries.values()), default=0)
    if 8 + size + data > file_size:
        raise CheckpointError(
            f"{path} is cut short: its header describes {8 + size + data} bytes, the file holds "
            f"{file_size} (a download that did not finish?)"
        )
    return size, entries


def check_files(model_dir: str | Path) -> None:
    """The checkpoint's weight files are there, whole as far as their headers tell
    (CheckpointError naming the file otherwise): what a loader meets only after loading
    everything before it is said before anything loads."""
    for path in checkpoint_files(model_dir):
        if path.suffix != gguf_files.SUFFIX:  # a GGUF file's reader checks its own
            _header(path)


def layer_tensors(model_dir: str | Path, num_layers: int) -> list[tuple[int, int]] | None:
    """(elements, bytes as stored) of each tensor of the decoder's first `num_layers` layers,
    from the files' headers alone; None for a GGUF checkpoint (not read here)."""
    found = []
    for path in checkpoint_files(model_dir):
        if path.suffix == gguf_files.SUFFIX:
            return None
        for key, (_, shape, begin, end) in _header(path)[1].items():
            parts = _normalise(key).split(".")
            if parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) < num_layers:
                found.append((math.prod(shape), end - begin))
    return found


def tensor_shapes(path: Path) -> dict[str, list[int]]:
    """A safetensors file's tensors' shapes by key, from its header alone (a file that is not
    one: CheckpointError naming it)."""
    return {key: entry[1] for key, entry in _header(path)[1].items()}


def checkpoint_dtypes(model_dir: str | Path) -> dict:
    """Each tensor's dtype (torch's; None where not read here) by our name, from the files'
    headers alone."""
    dtypes, found = _dtypes(), {}
    for path in checkpoint_files(model_dir):
        if path.suffix == gguf_files.SUFFIX:
            stored = gguf_files.tensor_dtypes(path)
        else:
            stored = {key: dtypes.get(entry[0]) for key, entry in _header(path)[1].items()}
        found.update((_normalise(key), dtype) for key, dtype in stored.items())
    return found


def _mapped_tensors(path: Path):
    """(key, tensor) for each tensor of a safetensors file, each its own copy-on-write mapping
    of its bytes, read from disk as they are touched. A tensor a model keeps as it is (the
    embedding table on CPU, layers.VocabParallelEmbedding) holds the mapping of its own bytes
    only: the pages of the others, read while copying them, go when their tensors do."""
    import numpy as np
    import torch

    dtypes = _dtypes()
    size, entries = _header(path)
    for key, (name, shape, begin, end) in sorted(entries.items()):
        if (dtype := dtypes.get(name)) is None:
            raise CheckpointError(f"tensor {key!r} in {path.name} has dtype {name}, not read here")
        if end == begin:
            yield key, torch.empty(shape, dtype=dtype)
            continue
        raw = np.memmap(path, np.uint8, mode="c", offset=8 + size + begin, shape=end - begin)
        yield key, torch.from_numpy(raw).view(dtype).reshape(shape)


def _normalise(key: str) -> str:
    """A checkpoint key as our modules name it: without "model." (and a multimodal
    checkpoint's "language_model." before its text model; its tower is `visual.`; a
    retriever's "vlm." around them all, ColQwen3's; the causal LM CodeFuse's embedders wrap,
    "plm_model.")."""
    for outer in ("vlm.", "plm_model."):
        key = key[len(outer) :] if key.startswith(outer) else key
    key = key[len("model.") :] if key.startswith("model.") else key
    return key[len("language_model.") :] if key.startswith("language_model.") else key


def load_weights(
    model: nn.Module,
    model_dir: str | Path,
    deltas: Mapping | None = None,
    skip: tuple[str, ...] = (),
    loaded: Callable[[nn.Parameter], None] | None = None,
) -> None:
    """Every parameter from the checkpoint's tensors; `deltas` (adapters.lora_deltas: name ->
    fp32 tensor) are added to theirs as they are read. Tensors under the prefixes in `skip`
    are not read (a part of the checkpoint this process does not hold). `loaded` is called
    with each parameter as soon as the last tensor it reads has been read."""
    deltas = deltas or {}
    ignored = _IGNORED_PREFIXES + skip
    expected = checkpoint_names(model)
    unread = Counter(id(param) for targets in expected.values() for param, _ in targets)
    seen: set[str] = set()
    passed: set[str] = set()  # read elsewhere (a head's) or by another rank (the tower)
    for path in checkpoint_files(model_dir):
        read = gguf_files.tensors if path.suffix == gguf_files.SUFFIX else _mapped_tensors
        for key, full in read(path):
            name = _normalise(key)
            if name in seen:
                raise CheckpointError(f"tensor {key!r} appears more than once")
            if name not in expected and (
                name.startswith(ignored) or name.endswith(_IGNORED_SUFFIXES)
            ):
                passed.add(name)
                continue
            if name not in expected:
                raise CheckpointError(f"unexpected tensor {key!r} in {path.name}")
            if name in deltas:  # fp32: rounded once, to the parameter's dtype
                full = full.float() + deltas[name]
            # popped, and each parameter's loader dropped once it is read (it refers to the
            # module: that cycle would keep a float weight the module let go of), so that
            # nothing here keeps a layer `loaded` converted
            for param, shard_id in expected.pop(name):
                try:
                    param.weight_loader(param, full, shard_id)
                except ValueError as e:
                    raise CheckpointError(f"tensor {key!r}: {e}") from e
                unread[id(param)] -= 1
                if not unread[id(param)]:
                    del param.weight_loader
                    if loaded is not None:
                        loaded(param)
            seen.add(name)
    unused = sorted(set(deltas) - seen - passed)
    if unused:
        raise CheckpointError(f"an adapter changes tensors the checkpoint lacks: {unused[:5]}")
    missing = sorted(expected)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise CheckpointError(f"checkpoint {model_dir} is missing tensors: {shown}")
