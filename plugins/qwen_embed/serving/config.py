"""Reading a Triton model's config parameters, with the deployment's environment overrides."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..hub import resolve_checkpoint

REPO = Path(__file__).resolve().parents[3]
DEMO_MODEL_DIR = REPO / ".cache" / "demo-model"
DEMO_RERANKER_DIR = REPO / ".cache" / "demo-reranker"
MODEL_DIR_ENV = "QWEN_EMBED_MODEL_DIR"
RERANK_MODEL_DIR_ENV = "QWEN_EMBED_RERANK_MODEL_DIR"
# task -> (environment variable, demo checkpoint `make setup` builds)
_DEFAULT_DIRS = {
    "embed": (MODEL_DIR_ENV, DEMO_MODEL_DIR),
    "rerank": (RERANK_MODEL_DIR_ENV, DEMO_RERANKER_DIR),
}


def model_parameters(args: dict) -> dict[str, str]:
    """The `parameters { key ... string_value ... }` of config.pbtxt as a plain dict."""
    params = json.loads(args["model_config"]).get("parameters", {})
    return {k: v.get("string_value", "") for k, v in params.items()}


def switch(params: dict[str, str], key: str) -> bool | None:
    """An "auto" / "on" / "off" parameter as None / True / False (empty: auto)."""
    value = params.get(key) or "auto"
    if value not in ("auto", "on", "off"):
        raise ValueError(f"parameter {key!r} must be 'auto', 'on' or 'off', not {value!r}")
    return None if value == "auto" else value == "on"


def resolve_model_dir(params: dict[str, str], task: str = "embed") -> Path:
    """config parameter `model_dir`, else $QWEN_EMBED_MODEL_DIR (rerank:
    $QWEN_EMBED_RERANK_MODEL_DIR), else the demo checkpoint `make setup` built. Each may be a
    directory or a Hugging Face model id (qwen_embed.hub: the local cache, else a download)."""
    env, demo = _DEFAULT_DIRS[task]
    chosen = params.get("model_dir") or os.environ.get(env)
    if not chosen and not (demo / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint named: set the model_dir parameter or ${env}, "
                                "or run `make setup` to build the demo one")  # fmt: skip
    return resolve_checkpoint(chosen or demo)


def encoder_device(kind: str, device_id: str, device: str, tp_size: int, has_cuda: bool) -> str:
    """The encoder instance's device from its Triton instance kind and `device` parameter.

    KIND_GPU: the GPU Triton placed the instance on (tensor parallelism would spill onto the
    next instance's GPUs: use KIND_MODEL with `device` for a TP group); KIND_CPU: the CPU,
    whatever the machine has; KIND_MODEL: the `device` parameter, "auto" = cuda:0 if present.
    """
    if kind == "GPU":
        if tp_size > 1:
            raise ValueError(
                f"KIND_GPU with tp_size={tp_size}: each KIND_GPU instance owns one GPU; use "
                'KIND_MODEL with device "cuda:N" for a tensor-parallel group'
            )
        return f"cuda:{device_id}"
    if kind == "CPU":
        return "cpu"
    if device in ("", "auto"):
        return "cuda:0" if has_cuda else "cpu"
    return device
