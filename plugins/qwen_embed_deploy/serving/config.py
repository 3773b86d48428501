"""Where the serving files live, and the typed settings of the Triton models.

In a source checkout the model repository template is the checkout's `model_repository/` and
demo checkpoints and the unpacked Triton server go to its `.cache/`. Installed as a wheel, the
template is the copy shipped inside the package (setup.py) and the data directory is
`$XDG_CACHE_HOME/qwen-embed` (default `~/.cache/qwen-embed`), whatever the working directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

from qwen_embed.config import ModelConfig
from qwen_embed.fingerprint import (
    KnownHashes,
    adapter_fingerprint,
    encoder_fingerprint,
    tokenizer_fingerprint,
)
from qwen_embed.hub import resolve_checkpoint
from qwen_embed.settings import EncoderSettings, from_parameters
from qwen_embed_client import pseudo_query
from qwen_embed_client.contract import (
    FACTS,
    MAX_TEXT_BYTES,
    RERANK_RECIPES,
    TRUNCATION_DIRECTIONS,
)

from .tokenizer import (
    PromptSet,
    chunk_separator,
    load_tokenizer,
    special_tokens,
    tokenizer_file,
)

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
# Checkpoint files' hashes (the fingerprints' content) kept between starts
KNOWN_HASHES = KnownHashes(DATA_DIR / "file-hashes.json")
DEMO_RERANKER_DIR = DATA_DIR / "demo-reranker"
MODEL_DIR_ENV = "QWEN_EMBED_MODEL_DIR"
RERANK_MODEL_DIR_ENV = "QWEN_EMBED_RERANK_MODEL_DIR"
# task -> (environment variable, demo checkpoint `make setup` builds)
_DEFAULT_DIRS = {
    "embed": (MODEL_DIR_ENV, DEMO_MODEL_DIR),
    "rerank": (RERANK_MODEL_DIR_ENV, DEMO_RERANKER_DIR),
    "auto": (MODEL_DIR_ENV, DEMO_MODEL_DIR),
}
# The encoders' lora_modules where their config leaves it empty (`make serve LORA_MODULES=...`)
LORA_MODULES_ENV = "QWEN_EMBED_LORA_MODULES"
RERANK_LORA_MODULES_ENV = "QWEN_EMBED_RERANK_LORA_MODULES"
# Every encoder's parameters where its config leaves them empty, "key=value,key=value"
# (`make serve ENCODER_SETTINGS=quantization=int8`)
ENCODER_SETTINGS_ENV = "QWEN_EMBED_ENCODER_SETTINGS"


@dataclass(frozen=True)
class TokenizerSettings:
    """A tokenizer model's config.pbtxt parameters (docs/configuration.md); its texts per
    request are its max_batch_size."""

    task: str = "embed"  # "embed": TEXT -> ids; "rerank": QUERY + DOCUMENTS -> pairs
    model_dir: str = ""  # empty: $QWEN_EMBED_MODEL_DIR, else the demo model (resolve_model_dir)
    max_input_tokens: int = 0  # tokens per text, special tokens included; 0: the model's positions
    truncation_direction: str = "right"  # which end survives when a request does not say
    max_text_bytes: int = MAX_TEXT_BYTES
    cpu_pinning: str = "auto"  # "auto": on 8+ cores, one core the CPU encoders leave free
    # An embedder that reranks as its authors do (contract.RERANK_RECIPES; "": none): a fact
    # for clients, which build its texts (qwen_embed_client.pseudo_query).
    rerank_recipe: str = ""

    def __post_init__(self):
        if self.task not in ("embed", "rerank"):
            raise ValueError(f"task must be 'embed' or 'rerank', got {self.task!r}")
        if self.rerank_recipe and (
            self.task != "embed" or self.rerank_recipe not in RERANK_RECIPES
        ):
            raise ValueError(
                f"rerank_recipe must be one of {list(RERANK_RECIPES)} on an embed tokenizer, "
                f"got {self.rerank_recipe!r}"
            )
        if self.truncation_direction not in TRUNCATION_DIRECTIONS:
            raise ValueError(
                f"truncation_direction must be one of {list(TRUNCATION_DIRECTIONS)}, "
                f"got {self.truncation_direction!r}"
            )


@dataclass(frozen=True)
class EncoderServing:
    """An encoder model's parameters beside the engine's EncoderSettings."""

    model_dir: str = ""
    cpu_pinning: str = "auto"  # "auto": each CPU instance pinned to its share of the cores


def model_parameters(args: dict) -> dict[str, str]:
    """The `parameters` of a model's config as a plain dict, without its published facts."""
    params = json.loads(args["model_config"]).get("parameters", {})
    return {k: v.get("string_value", "") for k, v in params.items() if k not in FACTS}


def tokenizer_checkpoint(settings: TokenizerSettings) -> tuple[Path, ModelConfig, int]:
    """(checkpoint directory, its config, tokens per text) of a tokenizer model: the model's
    positions unless the deployment sets fewer; never more (the encoder would refuse them)."""
    model_dir = resolve_model_dir(settings.model_dir, settings.task)
    config = ModelConfig.from_dir(model_dir)
    positions = config.max_position_embeddings
    return model_dir, config, min(settings.max_input_tokens or positions, positions)


def model_facts(params: dict[str, str], instance_kind: str, tokenizer: bool) -> dict:
    """What a tokenizer or encoder model will be, from its config parameters and its first
    instance group's kind, without loading it: the facts (contract.FACTS) the launcher writes
    into the served config, where clients read them."""
    if tokenizer:
        settings = tokenizer_settings(params)
        model_dir, config, max_tokens = tokenizer_checkpoint(settings)
        tokenizer_file(model_dir)  # missing: said before any server starts
        direction = settings.truncation_direction
        facts = {
            "dimension": config.embedding_size,
            "tokens_per_text": max_tokens,
            "fingerprint": tokenizer_fingerprint(model_dir, max_tokens, direction, KNOWN_HASHES),
        }
        if settings.rerank_recipe:
            facts["reranks_by"] = recipe_checked(settings.rerank_recipe, model_dir)
        if settings.task == "embed":
            prompts = PromptSet.from_dir(model_dir)
            facts |= {"prompt_names": prompts.names, "default_prompt_name": prompts.default_name}
            if (separator := chunk_separator(model_dir)) is not None:
                facts["chunk_separator"] = separator
            if config.multi_vector:
                facts["multi_vector"] = True
        return facts
    import torch

    from qwen_embed.engine import host_weights, plan
    from qwen_embed.lora import adapter_folders

    serving, settings = encoder_parameters(params)
    device = encoder_device(
        instance_kind.removeprefix("KIND_"),
        "0",
        settings.device,
        settings.tp_size,
        torch.cuda.is_available(),
    )
    model_dir = resolve_model_dir(serving.model_dir, settings.task)
    checkpoint, config, route = plan(model_dir, settings.replace(device=device))
    weights = host_weights(checkpoint, config, route)
    facts = {
        "dimension": config.embedding_size,
        "route": route.to_dict(),
        "tokens_per_forward": settings.max_batch_tokens,
        "host_weight_bytes": weights.bytes,
        "host_weight_elements": weights.elements,
        "fingerprint": encoder_fingerprint(checkpoint, route, KNOWN_HASHES),
    }
    if route.lora_names:  # each adapter's vectors are fingerprinted apart
        folders = adapter_folders(settings.lora_modules, checkpoint)
        facts["adapter_fingerprints"] = {
            n: adapter_fingerprint(f, KNOWN_HASHES, task) for n, f, task in folders
        }
    if route.task == "classify":  # LOGITS' columns
        facts["labels"] = list(config.labels)
    if route.task == "rerank":  # what SCORES are (a probability, a logit or a cosine)
        facts["scores"] = config.score_kind
    return facts


def recipe_checked(recipe: str, model_dir: Path) -> str:
    """E2Rank's recipe appends <|endoftext|> to each document itself, as its tokenizer does
    not: a checkpoint whose tokenizer appends it (Qwen3-Embedding's) would read it twice."""
    tok = load_tokenizer(model_dir)
    _, tail = special_tokens(tok, model_dir)
    if tail and tok.id_to_token(tail[-1]) == pseudo_query.END:
        raise ValueError(
            f"rerank_recipe {recipe!r}: {model_dir}'s tokenizer appends <|endoftext|> to every "
            "text, which E2Rank's tokenizer does not (its recipe appends it to each document)"
        )
    return recipe


def tokenizer_settings(params: dict[str, str]) -> TokenizerSettings:
    return from_parameters(TokenizerSettings, params, "tokenizer")


def encoder_parameters(params: dict[str, str]) -> tuple[EncoderServing, EncoderSettings]:
    """An encoder model's parameters (model_parameters): the serving ones and the engine's
    settings, each built whole (an unknown key is refused); where they leave a key empty, its
    value in $QWEN_EMBED_ENCODER_SETTINGS, and lora_modules from $QWEN_EMBED_LORA_MODULES (a
    reranker's: $QWEN_EMBED_RERANK_LORA_MODULES)."""
    params = {**environment_settings(), **{k: v for k, v in params.items() if v != ""}}
    serving_keys = {f.name for f in fields(EncoderServing)}
    serving = {k: params.pop(k) for k in list(params) if k in serving_keys}
    settings = EncoderSettings.from_parameters(params)
    env = RERANK_LORA_MODULES_ENV if settings.task == "rerank" else LORA_MODULES_ENV
    if not settings.lora_modules and os.environ.get(env):
        settings = settings.replace(lora_modules=os.environ[env])
    return from_parameters(EncoderServing, serving, "encoder"), settings


def environment_settings() -> dict[str, str]:
    """$QWEN_EMBED_ENCODER_SETTINGS as parameters: "quantization=int8, dtype=bfloat16"."""
    text = os.environ.get(ENCODER_SETTINGS_ENV, "")
    pairs = [item.strip() for item in text.split(",") if item.strip()]
    malformed = [item for item in pairs if "=" not in item]
    if malformed:
        raise ValueError(f"${ENCODER_SETTINGS_ENV} takes key=value pairs, got {malformed}")
    return dict((k.strip(), v.strip()) for k, v in (item.split("=", 1) for item in pairs))


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
