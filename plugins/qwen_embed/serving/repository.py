"""Render a model repository that serves several checkpoints side by side.

    python -m qwen_embed.serving.repository OUT_DIR NAME=MODEL_DIR [NAME=MODEL_DIR ...]
        [--rerank NAME=MODEL_DIR ...] [--set encoder.tp_size=2 ...]

Each NAME gets its own tokenizer, encoder and ensemble (`NAME_tokenizer`, `NAME_encoder`,
`NAME`), copied from the checked-in model_repository with `model_dir` pinned; a NAME of `embed`
keeps the original names. A `--rerank` NAME gets the same trio from the rerank templates
(`rerank_tokenizer`, `rerank_encoder`, `rerank`; a NAME of `rerank` keeps those names).
`--set MODEL.KEY=VALUE` overrides a config parameter of every copy;
`--encoder-instances 'count: 1, kind: KIND_GPU'` replaces the encoder's instance_group (GPUs);
`--max-queue-size N` bounds the encoder's queue (requests beyond it get UNAVAILABLE at once).
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

from .config import MODEL_REPOSITORY

TEMPLATE = MODEL_REPOSITORY
STEPS = ("tokenizer", "encoder")
# kind -> (ensemble template, {step: template directory})
KINDS = {
    "embed": ("embed", {"tokenizer": "tokenizer", "encoder": "encoder"}),
    "rerank": ("rerank", {"tokenizer": "rerank_tokenizer", "encoder": "rerank_encoder"}),
}


def _parameter_pattern(key: str) -> str:
    return rf'(\{{ key: "{re.escape(key)}", value: \{{ string_value: )"([^"]*)"'


def get_parameter(config: str, key: str) -> str:
    """A config.pbtxt string parameter's value."""
    match = re.search(_parameter_pattern(key), config)
    if match is None:
        raise ValueError(f"config has no parameter {key!r}")
    return match.group(2)


def rerank_models(model_repository: Path) -> set[str]:
    """A repository's reranking models, whatever they are named: the steps whose `task`
    parameter is "rerank" and the ensembles that run them."""
    configs = {p.parent.name: p.read_text() for p in Path(model_repository).glob("*/config.pbtxt")}
    tasks = {name: re.search(_parameter_pattern("task"), c) for name, c in configs.items()}
    steps = {name for name, task in tasks.items() if task and task.group(2) == "rerank"}
    ensembles = {
        name
        for name, config in configs.items()
        if steps & set(re.findall(r'model_name: "([^"]+)"', config))
    }
    return steps | ensembles


def _set_parameter(config: str, key: str, value: str) -> str:
    """Set a string parameter, adding it to the `parameters [ ... ]` list if absent (engine
    settings the template leaves at their defaults)."""
    updated, n = re.subn(_parameter_pattern(key), rf'\1"{value}"', config)
    if n == 1:
        return updated
    block = re.search(r"^parameters \[\n(.*?)\n\]", config, flags=re.M | re.S)
    if n > 1 or block is None:
        raise ValueError(f"config has no single parameter {key!r} and no parameters list")
    entry = f'  {{ key: "{key}", value: {{ string_value: "{value}" }} }}'
    body = block.group(1).rstrip()
    body = f"{body},\n{entry}" if body.endswith("}") else f"{body}\n{entry}"
    return config[: block.start(1)] + body + config[block.end(1) :]


def set_instance_group(config: str, group: str) -> str:
    """Replace a config.pbtxt's one-line instance_group with `[ { GROUP } ]`."""
    updated, n = re.subn(
        r"^instance_group \[.*\]$", f"instance_group [ {{ {group} }} ]", config, count=1, flags=re.M
    )
    if n != 1:
        raise ValueError("config has no one-line instance_group")
    return updated


def _pinned(model_dir: str | Path) -> str:
    """A directory as an absolute path; anything else (a Hugging Face model id) as given."""
    path = Path(model_dir).expanduser()
    return str(path.resolve()) if path.exists() else str(model_dir)


def render(
    out_dir: str | Path,
    deployments: dict[str, str | Path],
    overrides: dict[str, dict[str, str]] | None = None,
    encoder_instances: str | None = None,
    max_queue_size: int | None = None,
    rerankers: dict[str, str | Path] | None = None,
) -> Path:
    """Write one tokenizer/encoder/ensemble trio per deployment (and reranker) name into
    out_dir; `overrides` ({"tokenizer"|"encoder": {key: value}}) apply to both kinds."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    named = [("embed", n, d) for n, d in deployments.items()]
    named += [("rerank", n, d) for n, d in (rerankers or {}).items()]
    for kind, name, model_dir in named:
        ensemble_template, templates = KINDS[kind]
        names = {s: t if name == ensemble_template else f"{name}_{s}" for s, t in templates.items()}
        for step, template in templates.items():
            target = out / names[step]
            shutil.copytree(
                TEMPLATE / template,
                target,
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("__pycache__"),
            )
            config = (TEMPLATE / template / "config.pbtxt").read_text()
            config = config.replace(f'name: "{template}"', f'name: "{names[step]}"', 1)
            config = _set_parameter(config, "model_dir", _pinned(model_dir))
            for key, value in (overrides or {}).get(step, {}).items():
                config = _set_parameter(config, key, value)
            if step == "encoder" and encoder_instances:
                config = set_instance_group(config, encoder_instances)
            if step == "encoder" and max_queue_size is not None:
                config = re.sub(r"max_queue_size: \d+", f"max_queue_size: {max_queue_size}", config)
            (target / "config.pbtxt").write_text(config)
        ensemble = (TEMPLATE / ensemble_template / "config.pbtxt").read_text()
        ensemble = ensemble.replace(f'name: "{ensemble_template}"', f'name: "{name}"', 1)
        for step, template in templates.items():
            ensemble = ensemble.replace(f'model_name: "{template}"', f'model_name: "{names[step]}"')
        (out / name / "1").mkdir(parents=True, exist_ok=True)
        (out / name / "config.pbtxt").write_text(ensemble)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("deployments", nargs="*", metavar="NAME=MODEL_DIR")
    p.add_argument(
        "--rerank",
        action="append",
        default=[],
        metavar="NAME=MODEL_DIR",
        help="a reranker (Qwen3-Reranker layout or a sequence-classification head)",
    )
    p.add_argument("--set", action="append", default=[], metavar="MODEL.KEY=VALUE")
    p.add_argument("--encoder-instances", help="e.g. 'count: 1, kind: KIND_GPU'")
    p.add_argument("--max-queue-size", type=int, help="encoder requests waiting, then UNAVAILABLE")
    args = p.parse_args()
    overrides: dict[str, dict[str, str]] = {}
    for item in args.set:
        target, value = item.split("=", 1)
        step, key = target.split(".", 1)
        overrides.setdefault(step, {})[key] = value
    deployments = dict(d.split("=", 1) for d in args.deployments)
    rerankers = dict(d.split("=", 1) for d in args.rerank)
    if not deployments and not rerankers:
        p.error("name at least one NAME=MODEL_DIR or --rerank NAME=MODEL_DIR")
    out = render(
        args.out_dir, deployments, overrides, args.encoder_instances, args.max_queue_size, rerankers
    )
    print(f"rendered {out}: {', '.join([*deployments, *rerankers])}")


if __name__ == "__main__":
    main()
