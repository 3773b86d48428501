"""Reading a Triton model's config parameters, with the deployment's environment overrides."""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DEMO_MODEL_DIR = REPO / ".cache" / "demo-model"
MODEL_DIR_ENV = "QWEN_EMBED_MODEL_DIR"


def model_parameters(args: dict) -> dict[str, str]:
    """The `parameters { key ... string_value ... }` of config.pbtxt as a plain dict."""
    params = json.loads(args["model_config"]).get("parameters", {})
    return {k: v.get("string_value", "") for k, v in params.items()}


def resolve_model_dir(params: dict[str, str]) -> Path:
    """config parameter `model_dir`, else $QWEN_EMBED_MODEL_DIR, else the built demo model."""
    chosen = params.get("model_dir") or os.environ.get(MODEL_DIR_ENV) or str(DEMO_MODEL_DIR)
    path = Path(chosen).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model directory {path} has no config.json: set the model_dir parameter or "
            f"${MODEL_DIR_ENV}, or run `make demo-model`"
        )
    return path
