"""Load a local Hugging Face checkpoint (safetensors only: nothing is ever unpickled)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from torch import nn

# Present in causal-LM checkpoints but not needed to embed.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_IGNORED_PREFIXES = ("lm_head.",)


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


def _checkpoint_names(model: nn.Module) -> dict[str, tuple[nn.Parameter, str | None]]:
    """Checkpoint tensor name (without "model.") -> (our parameter, packed shard id)."""
    packed = getattr(model, "packed_modules", {})
    names: dict[str, tuple[nn.Parameter, str | None]] = {}
    for name, param in model.named_parameters():
        shards = [
            (name.replace(f".{ours}.", f".{ckpt_module}."), shard_id)
            for ckpt_module, (ours, shard_id) in packed.items()
            if f".{ours}." in name
        ]
        for ckpt_name, shard_id in shards or [(name, None)]:
            names[ckpt_name] = (param, shard_id)
    return names


def _normalise(key: str) -> str:
    return key[len("model.") :] if key.startswith("model.") else key


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    expected = _checkpoint_names(model)
    seen: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = _normalise(key)
                if name.startswith(_IGNORED_PREFIXES) or name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name not in expected:
                    raise CheckpointError(f"unexpected tensor {key!r} in {path.name}")
                if name in seen:
                    raise CheckpointError(f"tensor {key!r} appears more than once")
                param, shard_id = expected[name]
                try:
                    param.weight_loader(param, f.get_tensor(key), shard_id)
                except ValueError as e:
                    raise CheckpointError(f"tensor {key!r}: {e}") from e
                seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise CheckpointError(f"checkpoint {model_dir} is missing tensors: {shown}")
