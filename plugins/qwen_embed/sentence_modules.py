"""What a checkpoint does after its transformer: pooling and dense projections.

Read from the checkpoint's own files, so a model runs as its authors publish it:
- sentence-transformers' `modules.json`: the Pooling module's mode (`1_Pooling/config.json`)
  and each `Dense` module (`2_Dense/config.json` with its weights in the folder's
  `model.safetensors`), applied to the pooled vector in the listed order;
- a projection saved beside the transformer's own tensors as a top-level `linear.weight`
  (voyage-4-nano: hidden 1024 -> 2048 after the final norm). Without an activation it commutes
  with pooling, so it runs on the pooled vector, before any Dense module;
- a multi-vector retriever's projection of every token, a top-level `embedding_proj_layer`
  (ColQwen3: hidden -> 320 and a bias, then each token normalised; colpali-engine's
  `custom_text_proj`): its vectors are per token only (heads.build_head: a ProjectionHead
  over every token); jina-embeddings-v4's `multi_vector_projector` (hidden -> 128 and a
  bias), its vectors per token beside its pooled ones;
- a sentence-transformers MultiVectorEncoder (ColBERT-style late interaction over a Qwen
  backbone): its `MultiVectorMask` module makes it a multi-vector model and names the tokens
  its skiplist leaves out, its `Dense` module on `token_embeddings` is that projection of every
  token (its queries' expansion and lengths are the tokenizer's: serving/late_interaction.py);
- pplx-embed's `st_quantize.FlexibleQuantizer`, whose int8 codes are round(127 tanh(x)) of the
  pooled x: its float counterpart, tanh, ends the head (the request's `embedding_type` makes
  codes, as for every model);
- a causal-LM reranker in sentence-transformers' CrossEncoder form: its `LogitScore` module
  (`1_LogitScore/config.json`) names the output head's rows it scores with (heads.py), and its
  pairs are its chat template's (serving/chat_pairs.py);
- a CrossEncoder's `activation_fn`, what its `predict` makes of a reranker's one score: the
  sigmoid (its default, a probability) or none (the raw logit: zerank-2's since May 2026).
A checkpoint without these files pools its last token (Qwen3-Embedding's recipe).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .loader import checkpoint_files, read_json, tensor_shapes

# 1_Pooling/config.json's modes -> pooling.POOLING_METHODS
POOLING_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
# sentence-transformers before 6 wrote a flag per mode instead of one `pooling_mode`
_POOLING_FLAGS = {
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
POOLED = "sentence_embedding"  # what a Dense module reads after pooling
TOKENS = "token_embeddings"  # what a MultiVectorEncoder's Dense module reads: every token
MULTI_VECTOR_MASK = "MultiVectorMask"  # the module that makes a MultiVectorEncoder
# sentence-transformers Dense activations this engine applies (torch.nn names)
ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.activation.ReLU": "relu",
    "torch.nn.modules.activation.GELU": "gelu",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
}
MODULES_FILE = "modules.json"
ROOT_PROJECTION = "linear."
# a multi-vector retriever's projection of every token: ColQwen3's and transformers' ColQwen2
# port's, colpali-engine's
TOKEN_PROJECTIONS = ("embedding_proj_layer.", "custom_text_proj.")
MULTI_VECTOR_PROJECTOR = "multi_vector_projector."  # jina-embeddings-v4's, beside its pooling
# custom modules after pooling known by their class -> the activation that stands for them
QUANTIZERS = {"st_quantize.FlexibleQuantizer": "tanh"}
# prompts, and a CrossEncoder's activation (serving/tokenizer.PromptSet reads the prompts)
SENTENCE_TRANSFORMERS_CONFIG = "config_sentence_transformers.json"
# what a CrossEncoder's `predict` applies to a reranker's one score
SCORE_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
}


class SentenceModulesError(ValueError):
    pass


@dataclass(frozen=True)
class Dense:
    """One projection of the pooled vector: `weights` (a safetensors file) holds
    `{prefix}weight` [out, in] and, with `bias`, `{prefix}bias`."""

    weights: str
    prefix: str
    in_features: int
    out_features: int
    bias: bool
    activation: str  # a value of ACTIVATIONS


@dataclass(frozen=True)
class SentenceModules:
    pooling: str | None  # None: the checkpoint does not say
    dense: tuple[Dense, ...] = ()
    final_activation: str = "identity"  # after the dense layers (QUANTIZERS)
    # a CrossEncoder's LogitScore: the (relevant, not relevant or None) rows it scores with
    logit_score: tuple[int, int | None] | None = None
    # a multi-vector retriever's projection of each token's final hidden state
    token_projection: Dense | None = None
    # a CrossEncoder's activation_fn as saved (None: unsaid, the sigmoid of one label)
    activation_fn: str | None = None
    # a MultiVectorEncoder's: its vectors are one per token (a MultiVectorMask module), but
    # for its skiplist's tokens in the texts of its skiplist's tasks
    late_interaction: bool = False
    skiplist: tuple[int, ...] = ()  # token ids
    skiplist_tasks: tuple[str, ...] = ("document",)

    @classmethod
    def from_dir(cls, model_dir: str | Path, hidden_size: int, hf: dict) -> SentenceModules:
        """`hf`: the checkpoint's config.json, read."""
        model_dir = Path(model_dir)
        modules = _read_json(model_dir / MODULES_FILE, default=[])
        pooling, dense, final, logit_score = None, [], "identity", None
        top = _top_level_projections(model_dir)
        if ROOT_PROJECTION in top:
            dense.append(top[ROOT_PROJECTION])
        token_dense = [top[p] for p in (*TOKEN_PROJECTIONS, MULTI_VECTOR_PROJECTOR) if p in top]
        late, mask = False, {}
        for module in modules:
            kind = str(module.get("type", "")).rsplit(".", 1)[-1]
            folder = model_dir / module.get("path", "")
            if str(module.get("type", "")).startswith("pylate."):
                # read as a pooled Dense it would give wrong vectors, not a refusal
                raise SentenceModulesError(
                    f"{model_dir / MODULES_FILE}: {module['type']} is PyLate's: a ColBERT saved "
                    "by PyLate (its own markers and skiplist) is not served; a "
                    "sentence-transformers 6.2+ MultiVectorEncoder is"
                )
            if kind == "Pooling":
                pooling = _pooling_mode(folder / "config.json")
            elif kind == "Dense":
                config = _read_json(folder / "config.json")
                reads = config.get("module_input_name", POOLED)
                (token_dense if reads == TOKENS else dense).append(_dense(folder, config))
            elif module.get("type") in QUANTIZERS:
                final = QUANTIZERS[module["type"]]
            elif kind == "LogitScore":
                logit_score = _logit_score(folder / "config.json")
            elif kind == MULTI_VECTOR_MASK:
                late, mask = True, _multi_vector_mask(model_dir, folder / "config.json")
            elif kind not in ("Transformer", "Normalize"):  # normalising is per request
                raise SentenceModulesError(
                    f"{model_dir / 'modules.json'}: module {module.get('type')!r} is not "
                    "supported (Transformer, Pooling, Dense, Normalize, LogitScore, "
                    f"MultiVectorMask and {sorted(QUANTIZERS)} are)"
                )
        tokens = _token_projection(token_dense, hidden_size, late)
        width = hidden_size
        for layer in dense:
            if layer.in_features != width:
                raise SentenceModulesError(
                    f"{layer.weights}: a projection from {layer.in_features} features follows "
                    f"a vector of {width}"
                )
            width = layer.out_features
        activation_fn = _cross_encoder_activation(model_dir, hf)
        fields = (pooling, tuple(dense), final, logit_score, tokens, activation_fn, late)
        return cls(*fields, **mask)

    def score_activation(self) -> str:
        """What a reranker's one score goes through, as the CrossEncoder's `predict`
        applies it: "sigmoid" or "identity" (SentenceModulesError for another)."""
        if self.activation_fn is None:
            return "sigmoid"
        if self.activation_fn not in SCORE_ACTIVATIONS:
            raise SentenceModulesError(
                f"activation_fn {self.activation_fn!r}: a reranker's scores here are one of "
                f"{sorted(SCORE_ACTIVATIONS)}"
            )
        return SCORE_ACTIVATIONS[self.activation_fn]

    @property
    def has_head(self) -> bool:
        return bool(self.dense) or self.final_activation != "identity"

    @property
    def output_size(self) -> int | None:
        return self.dense[-1].out_features if self.dense else None


def module_kinds(model_dir: str | Path) -> set[str]:
    """The class names of the modules modules.json lists (none without one)."""
    modules = _read_json(Path(model_dir) / MODULES_FILE, default=[])
    return {str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules}


def _read_json(path: Path, default=None):
    if not path.is_file():
        if default is not None:
            return default
        raise SentenceModulesError(f"{path} is missing")
    return read_json(path)


def _pooling_mode(path: Path) -> str:
    config = _read_json(path)
    chosen = config.get("pooling_mode")
    if chosen is None:
        chosen = [_POOLING_FLAGS[key] for key, on in config.items() if key in _POOLING_FLAGS and on]
    elif isinstance(chosen, str):
        chosen = [chosen]
    if len(chosen) != 1 or chosen[0] not in POOLING_MODES:
        raise SentenceModulesError(
            f"{path}: pooling {chosen} is not supported; one of {sorted(POOLING_MODES)}"
        )
    if POOLING_MODES[chosen[0]] == "mean" and config.get("include_prompt") is False:
        raise SentenceModulesError(
            f"{path}: mean pooling without the prompt's tokens (include_prompt false) is "
            "not supported"
        )
    return POOLING_MODES[chosen[0]]


def _logit_score(path: Path) -> tuple[int, int | None]:
    config = _read_json(path)
    if config.get("module_input_name", "causal_logits") != "causal_logits":
        raise SentenceModulesError(f"{path}: only a LogitScore on the causal LM's logits is read")
    false = config.get("false_token_id")
    return int(config["true_token_id"]), None if false is None else int(false)


def _cross_encoder_activation(model_dir: Path, hf: dict) -> str | None:
    """A CrossEncoder's activation_fn where sentence-transformers looks for it: its own config,
    then config.json's (`hf`) `sentence_transformers` (a CrossEncoder saved by 4.x-5.x), then
    the name before 4.0."""
    saved = _read_json(model_dir / SENTENCE_TRANSFORMERS_CONFIG, default={}).get("activation_fn")
    if saved is not None:
        return saved
    saved = (hf.get("sentence_transformers") or {}).get("activation_fn")
    return saved if saved is not None else hf.get("sbert_ce_default_activation_function")


def _multi_vector_mask(model_dir: Path, path: Path) -> dict:
    """A MultiVectorEncoder's scoring mask: a text's tokens (and a query's expansion,
    serving/late_interaction.py) but its skiplist's, in the texts of its skiplist's tasks
    (documents, and texts without a task, by default). Its words are single tokens of the
    checkpoint's tokenizer (the others are dropped, as sentence-transformers drops them); an
    allowlist of token ids (an image page's patches) is refused."""
    config = _read_json(path, default={})
    if config.get("keep_only_token_ids"):
        raise SentenceModulesError(f"{path}: keep_only_token_ids is not supported")
    words = config.get("skiplist_words") or []
    ids = ()
    if words:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        ids = tuple(sorted({i for i in map(tok.token_to_id, words) if i is not None}))
    tasks = config.get("skiplist_tasks") or ["document"]
    return {"skiplist": ids, "skiplist_tasks": (tasks,) if isinstance(tasks, str) else tuple(tasks)}


def _token_projection(dense: list[Dense], hidden_size: int, late: bool) -> Dense | None:
    """The one projection of every token: ColQwen3's or jina-embeddings-v4's top-level one, or
    a MultiVectorEncoder's Dense module on token_embeddings."""
    if not dense:
        return None
    if len(dense) > 1:
        raise SentenceModulesError(
            f"{[d.weights for d in dense]}: one projection of every token is supported"
        )
    (tokens,) = dense
    if tokens.prefix not in (*TOKEN_PROJECTIONS, MULTI_VECTOR_PROJECTOR) and not late:
        raise SentenceModulesError(
            f"{tokens.weights}: a Dense module on {TOKENS} belongs to a MultiVectorEncoder, "
            "and modules.json lists no MultiVectorMask"
        )
    if tokens.in_features != hidden_size:
        raise SentenceModulesError(
            f"{tokens.weights}: a token projection from {tokens.in_features} features "
            f"follows hidden states of {hidden_size}"
        )
    return tokens


def _dense(folder: Path, config: dict) -> Dense:
    """A Dense module (`config`: its config.json), on the pooled vector or on every token."""
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise SentenceModulesError(
            f"{folder} has no model.safetensors; only safetensors weights are loaded"
        )
    if config.get("use_residual") or config.get("module_input_name", POOLED) not in (
        POOLED,
        TOKENS,
    ):
        raise SentenceModulesError(
            f"{folder}: only a Dense module on the pooled vector or on every token without a "
            f"residual (module_input_name {POOLED} or {TOKENS}, use_residual false) is supported"
        )
    activation = config.get("activation_function", "torch.nn.modules.linear.Identity")
    if activation not in ACTIVATIONS:
        raise SentenceModulesError(
            f"{folder}: activation {activation!r} is not supported; one of {sorted(ACTIVATIONS)}"
        )
    return Dense(
        weights=str(weights),
        prefix="linear.",
        in_features=int(config["in_features"]),
        out_features=int(config["out_features"]),
        bias=bool(config.get("bias", True)),
        activation=ACTIVATIONS[activation],
    )


def _top_level_projections(model_dir: Path) -> dict[str, Dense]:
    """The top-level projections among the checkpoint's tensors (ROOT_PROJECTION,
    TOKEN_PROJECTIONS, MULTI_VECTOR_PROJECTOR): `{prefix}weight` and, where present,
    `{prefix}bias`."""
    if not any(model_dir.glob("*.safetensors")):
        return {}
    wanted = (ROOT_PROJECTION, *TOKEN_PROJECTIONS, MULTI_VECTOR_PROJECTOR)
    index = model_dir / "model.safetensors.index.json"
    paths = checkpoint_files(model_dir)
    if index.is_file():  # the shards that hold them, without opening every shard
        weight_map = read_json(index)["weight_map"]
        shards = {weight_map.get(prefix + "weight") for prefix in wanted} - {None}
        paths = [model_dir / shard for shard in sorted(shards)]
    found = {}
    for path in paths:
        shapes = tensor_shapes(path)
        for prefix in wanted:
            if prefix + "weight" in shapes:
                out_features, in_features = shapes[prefix + "weight"]
                bias = prefix + "bias" in shapes
                found[prefix] = Dense(
                    str(path), prefix, in_features, out_features, bias, "identity"
                )
    return found
