"""Render a model repository that serves several checkpoints side by side.

    python -m qwen_embed_deploy.repository OUT_DIR NAME=MODEL_DIR [NAME=MODEL_DIR ...]
        [--rerank NAME=MODEL_DIR ...] [--set encoder.tp_size=2 ...]

Each NAME gets its own tokenizer, encoder and ensemble (`NAME_tokenizer`, `NAME_encoder`,
`NAME`), copied from the checked-in model_repository with `model_dir` pinned; a NAME of `embed`
keeps the original names. A `--rerank` NAME gets the same trio from the rerank templates
(`rerank_tokenizer`, `rerank_encoder`, `rerank`; a NAME of `rerank` keeps those names).
`--set MODEL.KEY=VALUE` overrides a config parameter of every copy;
`--encoder-instances 'count: 1, kind: KIND_GPU'` replaces the encoder's instance_group (GPUs);
`--max-queue-size N` bounds the encoder's queue (requests beyond it get UNAVAILABLE at once).

Every config.pbtxt is read and written as Triton's own `ModelConfig` message (the protobuf that
tritonclient ships), never edited as text; `edited_copy` is the one way the launcher serves a
changed repository.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc.model_config_pb2 import ModelConfig, ModelInstanceGroup

from qwen_embed_client.contract import FACTS
from qwen_embed_deploy.serving.config import MODEL_REPOSITORY, model_facts

TEMPLATE = MODEL_REPOSITORY
STEPS = ("tokenizer", "encoder")
# kind -> (ensemble template, {step: template directory})
KINDS = {
    "embed": ("embed", {"tokenizer": "tokenizer", "encoder": "encoder"}),
    "rerank": ("rerank", {"tokenizer": "rerank_tokenizer", "encoder": "rerank_encoder"}),
}


def read_config(path: Path) -> ModelConfig:
    """A config.pbtxt as Triton's own ModelConfig message."""
    return text_format.Parse(Path(path).read_text(), ModelConfig())


def write_config(path: Path, config: ModelConfig) -> None:
    Path(path).write_text(text_format.MessageToString(config))


def get_parameter(config: ModelConfig, key: str) -> str:
    """A string parameter's value; "" where it is not set (the setting's default)."""
    return config.parameters[key].string_value if key in config.parameters else ""


def set_parameter(config: ModelConfig, key: str, value: str) -> None:
    config.parameters[key].string_value = value


def instance_group(text: str) -> ModelInstanceGroup:
    """'count: 1, kind: KIND_GPU' (the text form of one instance_group entry)."""
    return text_format.Parse(text.replace(",", " "), ModelInstanceGroup())


def set_instance_group(config: ModelConfig, group: ModelInstanceGroup) -> None:
    del config.instance_group[:]
    config.instance_group.append(group)


def repository_configs(model_repository: Path) -> dict[str, ModelConfig]:
    return {p.parent.name: read_config(p) for p in Path(model_repository).glob("*/config.pbtxt")}


def rerank_models(model_repository: Path) -> set[str]:
    """A repository's reranking models, whatever they are named: the steps whose `task`
    parameter is "rerank" and the ensembles that run them."""
    configs = repository_configs(model_repository)
    steps = {name for name, c in configs.items() if get_parameter(c, "task") == "rerank"}
    ensembles = {
        name
        for name, config in configs.items()
        if steps & {s.model_name for s in config.ensemble_scheduling.step}
    }
    return steps | ensembles


def ensembles(model_repository: Path) -> tuple[list[str], list[str]]:
    """A repository's embedding ensembles and its reranking ones (rerank_models), by name but
    `embed` and `rerank` first, where they are: those answer requests that name no model."""
    configs = repository_configs(model_repository)
    reranking = rerank_models(model_repository)
    names = sorted(name for name, config in configs.items() if config.platform == "ensemble")
    embedders = sorted((n for n in names if n not in reranking), key=lambda n: n != "embed")
    rerankers = sorted((n for n in names if n in reranking), key=lambda n: n != "rerank")
    return embedders, rerankers


Edit = Callable[[str, ModelConfig], None]


def edited_copy(model_repository: Path, *edits: Edit) -> Path:
    """The repository itself when the `edits` (each `edit(model name, config)`, in order)
    change no model's config, else a copy (in a temporary directory) with the edited configs
    written out."""
    changed = {}
    for name, config in repository_configs(model_repository).items():
        before = config.SerializeToString(deterministic=True)
        for edit in edits:
            edit(name, config)
        if config.SerializeToString(deterministic=True) != before:
            changed[name] = config
    if not changed:
        return model_repository
    copy = Path(tempfile.mkdtemp(prefix="qwen-embed-repository-")) / "models"
    shutil.copytree(model_repository, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for name, config in changed.items():
        write_config(copy / name / "config.pbtxt", config)
    return copy


def facts_question(config: ModelConfig) -> tuple[dict[str, str], str, bool] | None:
    """model_facts' arguments for a tokenizer or encoder model (its parameters but the facts,
    its first instance group's kind, whether it is a tokenizer); None for any other model."""
    names = {t.name for t in config.output} | {t.name for t in config.input}
    if config.backend != "python" or "TOKEN_IDS" not in names:
        return None
    params = {k: v.string_value for k, v in config.parameters.items() if k not in FACTS}
    group = config.instance_group[0] if config.instance_group else ModelInstanceGroup()
    kind = ModelInstanceGroup.Kind.Name(group.kind)
    return params, kind, "TOKEN_IDS" in {t.name for t in config.output}


def publish_facts(name: str, config: ModelConfig, facts=model_facts) -> None:
    """An Edit: a tokenizer or encoder model's facts (contract.FACTS: dimension, tokens per
    text, prompt names, route) written into its parameters, where Triton clients read a
    model's config. Triton keeps no parameter a Python model's auto_complete_config adds, so
    the served config carries them from the start. `facts` computes them (model_facts'
    arguments: facts_question's)."""
    question = facts_question(config)
    if question is None:
        return
    for key, value in facts(*question).items():
        set_parameter(config, key, json.dumps(value))


def _pinned(model_dir: str | Path) -> str:
    """A directory (or a GGUF file) as an absolute path; anything else (a Hugging Face model
    id) as given."""
    path = Path(model_dir).expanduser()
    return str(path.resolve()) if path.exists() else str(model_dir)


def render(
    out_dir: str | Path,
    deployments: dict[str, str | Path],
    overrides: dict[str, dict[str, str]] | None = None,
    encoder_instances: str | None = None,
    max_queue_size: int | None = None,
    rerankers: dict[str, str | Path] | None = None,
    tokenizer_instances: str | None = None,
) -> Path:
    """Write one tokenizer/encoder/ensemble trio per deployment (and reranker) name into
    out_dir; `overrides` ({"tokenizer"|"encoder": {key: value}}) apply to both kinds, as do
    the instance groups ('count: 2, kind: KIND_GPU'); {"NAME.encoder": {...}} to the one
    deployment NAME, over those."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    named = [("embed", n, d) for n, d in deployments.items()]
    named += [("rerank", n, d) for n, d in (rerankers or {}).items()]
    groups = {
        step: instance_group(text)
        for step, text in (("encoder", encoder_instances), ("tokenizer", tokenizer_instances))
        if text
    }
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
            config = read_config(TEMPLATE / template / "config.pbtxt")
            config.name = names[step]
            set_parameter(config, "model_dir", _pinned(model_dir))
            mine = {
                **(overrides or {}).get(step, {}),
                **(overrides or {}).get(f"{name}.{step}", {}),
            }
            for key, value in mine.items():
                set_parameter(config, key, value)
            if step in groups:
                set_instance_group(config, groups[step])
            if step == "encoder" and max_queue_size is not None:
                config.dynamic_batching.default_queue_policy.max_queue_size = max_queue_size
            write_config(target / "config.pbtxt", config)
        ensemble = read_config(TEMPLATE / ensemble_template / "config.pbtxt")
        ensemble.name = name
        by_template = {t: names[s] for s, t in templates.items()}
        for step in ensemble.ensemble_scheduling.step:
            step.model_name = by_template[step.model_name]
        (out / name / "1").mkdir(parents=True, exist_ok=True)
        write_config(out / name / "config.pbtxt", ensemble)
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
    p.add_argument("--set", action="append", default=[], metavar="[NAME.]STEP.KEY=VALUE")
    p.add_argument("--encoder-instances", help="e.g. 'count: 1, kind: KIND_GPU'")
    p.add_argument("--max-queue-size", type=int, help="encoder requests waiting, then UNAVAILABLE")
    args = p.parse_args()
    overrides: dict[str, dict[str, str]] = {}
    for item in args.set:
        target, value = item.split("=", 1)
        step, _, key = target.rpartition(".")  # STEP.KEY, or NAME.STEP.KEY for one deployment
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
