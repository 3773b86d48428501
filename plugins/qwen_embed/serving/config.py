"""Where the serving files live, and reading a Triton model's config parameters.

In a source checkout the model repository template is the checkout's `model_repository/` and
demo checkpoints and the unpacked Triton server go to its `.cache/`. Installed as a wheel, the
template is the copy shipped inside the package (setup.py) and the data directory is
`$XDG_CACHE_HOME/qwen-embed` (default `~/.cache/qwen-embed`), whatever the working directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..hub import resolve_checkpoint
from ..settings import EncoderSettings

PACKAGE_DIR = Path(__file__).resolve().parents[1]
REPO = PACKAGE_DIR.parents[1]  # the checkout root, when this is one


def in_checkout(root: Path = REPO) -> bool:
    return (root / "model_repository").is_dir() and (root / "plugins" / "qwen_embed").is_dir()


if in_checkout():
    MODEL_REPOSITORY = REPO / "model_repository"
    DATA_DIR = REPO / ".cache"
else:
    MODEL_REPOSITORY = PACKAGE_DIR / "model_repository"
    DATA_DIR = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "qwen-embed"
DEMO_MODEL_DIR = DATA_DIR / "demo-model"
DEMO_RERANKER_DIR = DATA_DIR / "demo-reranker"
MODEL_DIR_ENV = "QWEN_EMBED_MODEL_DIR"
RERANK_MODEL_DIR_ENV = "QWEN_EMBED_RERANK_MODEL_DIR"
# task -> (environment variable, demo checkpoint `make setup` builds)
_DEFAULT_DIRS = {
    "embed": (MODEL_DIR_ENV, DEMO_MODEL_DIR),
    "rerank": (RERANK_MODEL_DIR_ENV, DEMO_RERANKER_DIR),
    "auto": (MODEL_DIR_ENV, DEMO_MODEL_DIR),
}
# Encoder parameters that are about serving, not about the engine (EncoderSettings has the rest).
# `watchdog_generation` is what the launcher's watchdog bumps to make Triton reload a model.
SERVING_DEFAULTS = {"model_dir": "", "cpu_pinning": "auto", "watchdog_generation": ""}


def model_parameters(args: dict) -> dict[str, str]:
    """The `parameters { key ... string_value ... }` of config.pbtxt as a plain dict."""
    params = json.loads(args["model_config"]).get("parameters", {})
    return {k: v.get("string_value", "") for k, v in params.items()}


def encoder_parameters(args: dict) -> tuple[dict[str, str], EncoderSettings]:
    """An encoder model's parameters: the serving ones (SERVING_DEFAULTS filled in) and the
    engine's settings, built whole from the rest."""
    params = model_parameters(args)
    serving = {k: params.pop(k, "") or default for k, default in SERVING_DEFAULTS.items()}
    return serving, EncoderSettings.from_parameters(params)


def resolve_model_dir(chosen: str, task: str = "embed") -> Path:
    """config parameter `model_dir`, else $QWEN_EMBED_MODEL_DIR (rerank:
    $QWEN_EMBED_RERANK_MODEL_DIR), else the demo checkpoint `make setup` built. Each may be a
    directory or a Hugging Face model id (qwen_embed.hub: the local cache, else a download)."""
    env, demo = _DEFAULT_DIRS[task]
    chosen = chosen or os.environ.get(env, "")
    if not chosen and not (demo / "config.json").is_file():
        raise FileNotFoundError(
            f"no checkpoint named: set the model_dir parameter or ${env}, "
            "or run `make setup` to build the demo one"
        )
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
