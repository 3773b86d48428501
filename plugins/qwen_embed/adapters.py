"""Task adapters a checkpoint ships beside its weights, merged into them at load.

jina-embeddings-v5 keeps one LoRA adapter per task under `adapters/{task}/` (peft's
`adapter_config.json` and `adapter_model.safetensors`) and selects one at run time;
jina-embeddings-v4 keeps every task's pairs in one adapter, `adapters/` itself, each module's
named by task (`lora_A.{task}.weight`, its MultiAdapterLinear's). Merged,
an adapted linear weight is W + (lora_alpha / r) B A (alpha / sqrt(r) with rsLoRA): the forward
then costs what the base model's does, on every route (int8, packed, TP shards) unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from .loader import read_json, safetensors_file

if TYPE_CHECKING:  # adapter_names serves processes without torch (config.py)
    import torch

ADAPTERS = "adapters"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # peft's
# peft's key prefixes before the base model's own tensor names (a multimodal base's text
# model is its `language_model.`, as loader._normalise reads the checkpoint)
_PREFIXES = ("base_model.model.", "model.", "language_model.")


class AdapterError(ValueError):
    pass


def adapter_names(model_dir: str | Path) -> list[str]:
    root = Path(model_dir) / ADAPTERS
    if not root.is_dir():
        return []
    if (root / ADAPTER_FILES[0]).is_file():  # one adapter of several tasks
        with safetensors_file(root / ADAPTER_FILES[1], framework="numpy") as f:
            return sorted({task for key in f.keys() if (task := _pair_part(key)[1])})
    return sorted(p.parent.name for p in root.glob(f"*/{ADAPTER_FILES[0]}"))


def adapter_folder(model_dir: str | Path, name: str) -> tuple[Path, str | None]:
    """The folder of the checkpoint's adapter `name` and the task to read in it: its own
    folder (None: its pairs are all the adapter's), or the one adapter of several tasks."""
    root = Path(model_dir) / ADAPTERS
    if (root / ADAPTER_FILES[0]).is_file():
        return root, name
    return root / name, None


def _pair_part(key: str) -> tuple[str, str | None]:
    """(what of a LoRA pair a tensor name holds: "A" or "B", else "", and its task where the
    name gives one): `...lora_A.weight`, or a task adapter's `...lora_A.{task}.weight`."""
    _, _, part = key.rpartition(".lora_")
    side, _, rest = part.partition(".")
    if side not in ("A", "B") or not rest.endswith("weight"):
        return "", None
    task = rest.removesuffix("weight").removesuffix(".")
    return side, task or None


def resolve_adapter(
    setting: str, names: tuple[str, ...], per_request: tuple[str, ...] = ()
) -> str | None:
    """settings.adapter as one of the checkpoint's adapter `names`, or None for the base
    weights: "auto" takes the only one (a fine-tune's, finetunes.py), else `retrieval`
    (jina-embeddings-v5's default) where there are adapters; with adapters `per_request`
    (lora.py) none: theirs are deltas of the base weights."""
    if setting == "none" or (setting == "auto" and (not names or per_request)):
        return None
    if per_request:
        raise AdapterError(
            f"adapter {setting!r} merged and lora_modules {list(per_request)} do not mix (a "
            "request's adapter is trained on the base weights): set adapter to 'none'"
        )
    chosen = setting
    if setting == "auto":
        chosen = names[0] if len(names) == 1 else "retrieval"
    if chosen not in names:
        raise AdapterError(
            f"adapter {chosen!r} is not among the checkpoint's ({list(names) or 'none'}); "
            "set adapter to one of them or 'none'"
        )
    return chosen


class LoraDeltas(Mapping):
    """Checkpoint tensor name -> the fp32 delta its adapter adds, scale * B @ A, made when the
    loader reads that tensor and dropped after: all of them at once would be an fp32 copy of
    every adapted weight, where the adapter itself is its small low-rank pairs."""

    def __init__(self, pairs: dict[str, dict[str, torch.Tensor]], scale: float):
        self._pairs, self._scale = pairs, scale

    def __getitem__(self, name: str) -> torch.Tensor:
        pair = self._pairs[name]
        return self._scale * (pair["B"] @ pair["A"])

    def __contains__(self, name: object) -> bool:  # Mapping's would make the delta to see
        return name in self._pairs

    def __iter__(self):
        return iter(self._pairs)

    def __len__(self) -> int:
        return len(self._pairs)


def lora_deltas(model_dir: str | Path, name: str | None) -> Mapping[str, torch.Tensor]:
    """Checkpoint tensor name (without `model.`) -> the fp32 delta its adapter adds."""
    if name is None:
        return {}
    return LoraDeltas(*read_lora(*adapter_folder(model_dir, name)))


def read_lora(
    folder: Path, task: str | None = None
) -> tuple[dict[str, dict[str, torch.Tensor]], float]:
    """A peft LoRA adapter folder's pairs (checkpoint tensor name without `model.` ->
    {"A": [r, in], "B": [out, r]}, fp32) and its scale (lora_alpha / r, or / sqrt(r) with
    rsLoRA); of an adapter of several tasks, `task`'s pairs."""
    config = read_json(folder / "adapter_config.json")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(
            f"{folder}: peft_type {config['peft_type']!r}; only LoRA adapters are served "
            "(peft's merge_and_unload() and save_pretrained() make a checkpoint of others)"
        )
    if config.get("use_dora") or config.get("fan_in_fan_out"):
        raise AdapterError(f"{folder}: DoRA and fan_in_fan_out adapters are not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{folder}: adapters that train biases are not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError(f"{folder}: per-module ranks (rank_pattern) are not supported")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safetensors_file(folder / "adapter_model.safetensors") as f:
        for key in f.keys():
            name = key
            for prefix in _PREFIXES:
                name = name.removeprefix(prefix)
            side, of_task = _pair_part(name)
            if not side:
                raise AdapterError(
                    f"{folder}: adapter tensor {key!r} is no LoRA pair's (whole modules peft "
                    "saves, modules_to_save or trainable tokens, are not served)"
                )
            if of_task != task:
                if task is None or of_task is None:
                    raise AdapterError(
                        f"{folder}: adapter tensor {key!r} is of task {of_task!r}, read for "
                        f"{task!r} (an adapter of several tasks is read one task at a time)"
                    )
                continue
            module = name.rpartition(".lora_")[0]
            pairs.setdefault(f"{module}.weight", {})[side] = f.get_tensor(key).float()
    if not pairs:
        raise AdapterError(f"{folder}: no LoRA pairs of task {task!r}")
    for name, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{folder}: {name} has lora_{''.join(pair)} without its pair")
    return pairs, scale
