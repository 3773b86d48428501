"""Load a local Hugging Face checkpoint (safetensors only: nothing is ever unpickled)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

if TYPE_CHECKING:  # checkpoint_files serves processes without torch (sentence_modules.py)
    from torch import nn

# Present in causal-LM / classifier checkpoints and top-level projections (voyage-4-nano's
# `linear`, which heads.ProjectionHead reads itself); skipped unless a task head asks for them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_IGNORED_PREFIXES = ("lm_head.", "score.", "linear.")


class CheckpointError(ValueError):
    pass


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"no *.safetensors in {model_dir}; only safetensors checkpoints are loaded "
            "(pickled .bin/.pt files are refused because unpickling can run code)"
        )
    return files


def _checkpoint_names(model: nn.Module) -> dict[str, list[tuple[nn.Parameter, str | None]]]:
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


def _normalise(key: str) -> str:
    """A checkpoint key as our modules name it: without "model." (and a multimodal
    checkpoint's "language_model." before its text model; its tower is `visual.`)."""
    key = key[len("model.") :] if key.startswith("model.") else key
    return key[len("language_model.") :] if key.startswith("language_model.") else key


def load_weights(
    model: nn.Module, model_dir: str | Path, deltas: dict | None = None, skip: tuple[str, ...] = ()
) -> None:
    """Every parameter from the checkpoint's tensors; `deltas` (adapters.lora_deltas: name ->
    fp32 tensor) are added to theirs as they are read. Tensors under the prefixes in `skip`
    are not read (a part of the checkpoint this process does not hold)."""
    deltas = deltas or {}
    ignored = _IGNORED_PREFIXES + skip
    expected = _checkpoint_names(model)
    seen: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = _normalise(key)
                if name not in expected and (
                    name.startswith(ignored) or name.endswith(_IGNORED_SUFFIXES)
                ):
                    continue
                if name not in expected:
                    raise CheckpointError(f"unexpected tensor {key!r} in {path.name}")
                if name in seen:
                    raise CheckpointError(f"tensor {key!r} appears more than once")
                full = f.get_tensor(key)
                if name in deltas:
                    full = (full.float() + deltas[name]).to(full.dtype)
                for param, shard_id in expected[name]:
                    try:
                        param.weight_loader(param, full, shard_id)
                    except ValueError as e:
                        raise CheckpointError(f"tensor {key!r}: {e}") from e
                seen.add(name)
    unused = sorted(set(deltas) - seen)
    if unused:
        raise CheckpointError(f"an adapter changes tensors the checkpoint lacks: {unused[:5]}")
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise CheckpointError(f"checkpoint {model_dir} is missing tensors: {shown}")
