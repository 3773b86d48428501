"""The request contract of the `embed` and `rerank` ensembles, written once.

Every option a request carries is a field of `EmbedOptions` or `RerankOptions` with its type,
default and limit. Clients (client.py, the gateway, the CLI) build one and send its
`parameters()`; the tokenizer model parses the same parameters back (`from_parameters`) and
checks what needs the model (`check_model`: its dimension and prompt names). The part of the
options the encoder step needs crosses the ensemble as FINISH rows (`finish_rows` /
`read_finish`); token ids and late chunking's spans as packed int32 BYTES elements. A new
request option is a field here (its help text too: the CLI's flags are made from the fields,
`option_flags`) and a row in docs/api.md.

numpy only: clients never import torch. A broken rule raises RequestError (a ValueError) with a
message naming the field and the limit; the Triton models answer it as INVALID_ARG for that
request only.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field, fields

import numpy as np

# Compact vectors: the `embedding_type` request option (Cohere's names), computed from the
# float vector after `dimensions` and `normalize`.
#
# - "float": float32, as computed.
# - "int8": each vector scaled by 127 / its own largest |value| and rounded half to even, in
#   -127..127 (an all-zero vector stays zero). The scale is per vector, so a vector's codes do
#   not depend on its batch, and cosine similarity between codes approximates the float one.
# - "uint8": the int8 codes + 128, in 1..255.
# - "ubinary": one bit per dimension, 1 where the value is > 0, packed 8 per byte, the first
#   dimension in the most significant bit; a last partial byte is padded with 0 bits.
#   ceil(dimensions / 8) bytes as uint8.
# - "binary": the ubinary bytes - 128, as int8 (what Cohere and sentence-transformers return).
#
# Where each embedding type travels (`compact` makes its codes); a response holds only the
# outputs of the types it asked for.
EMBEDDING_OUTPUTS = {
    "float": "EMBEDDING",
    "int8": "EMBEDDING_INT8",
    "uint8": "EMBEDDING_UINT8",
    "binary": "EMBEDDING_BINARY",
    "ubinary": "EMBEDDING_UBINARY",
}
EMBEDDING_TYPES = tuple(EMBEDDING_OUTPUTS)
TRUNCATION_DIRECTIONS = ("right", "left")
# Texts per request: every served model's max_batch_size (a test checks the repository).
MAX_TEXTS_PER_REQUEST = 256
# The inputs holding one element per item of a request (a text, a document): an error about one
# names it 'NAME[i]', i counted within that Triton request.
ITEM_INPUTS = ("TEXT", "DOCUMENTS", "IMAGES", "VIDEOS", "DOCUMENT_IMAGES", "DOCUMENT_VIDEOS")
MAX_TEXT_BYTES = 262144  # per text, checked before tokenizing (a deployment may lower it)
MAX_CHUNKS = 512  # chunks per text (late chunking): each is a read-out row of the forward
# What one request's vectors may take (a per_token request's TOKEN_EMBEDDING, padded to its
# longest text; late chunking's CHUNK_EMBEDDING, padded to its most chunks), float32; a
# server whose /dev/shm is small allows less (qwen_embed_deploy.host.answer_bytes_limit).
MAX_ANSWER_BYTES = 64 * 2**20
# The words of a refusal of an answer past that limit: a client halves such a request's texts
ANSWER_TOO_LARGE = "one request may return"
# Images (a multimodal checkpoint): per text, in the request's IMAGES input (pack_images),
# each an encoded file (PNG, JPEG, WebP, ...) of at most MAX_IMAGE_BYTES, decoded only up to
# MAX_DECODED_PIXELS (then resized to the checkpoint's pixel budget).
MAX_IMAGES_PER_TEXT = 16
MAX_IMAGE_BYTES = 20 * 2**20
MAX_DECODED_PIXELS = 64 * 2**20
# Videos, in the VIDEOS input (pack_images again): each a video file (MP4, WebM, ...) of at most
# MAX_VIDEO_BYTES holding at most MAX_VIDEO_FRAMES frames (each decoded to find the ones kept).
MAX_VIDEOS_PER_TEXT = 4
MAX_VIDEO_BYTES = 64 * 2**20
MAX_VIDEO_FRAMES = 7200
# Frames kept of each video: `video_fps` per second of it, at most `video_max_frames` (request
# options, the scripts' per-input `fps` and `max_frames`; default 1 and 64), up to
# MAX_KEPT_FRAMES; in whole temporal patches of 2.
MAX_KEPT_FRAMES = 256
FEWER_FRAMES = "a video keeps fewer frames with the options 'video_fps' and 'video_max_frames'"
# What one HTTP request may carry at the gateway (every API): texts or token id lists to embed,
# documents to rerank; the client splits them over Triton requests of MAX_TEXTS_PER_REQUEST.
MAX_INPUTS = 2048
MAX_DOCUMENTS = 1000
# Qwen3-Embedding's default task: its query prompt and the reranker's default instruction.
DEFAULT_TASK = "Given a web search query, retrieve relevant passages that answer the query"
# Triton priority levels of the models (1 is served first): a batch takes every waiting
# interactive request before any bulk one. 0 asks for the model's default, interactive.
PRIORITIES = {"interactive": 1, "bulk": 2}


# What a served model publishes about itself at load, as parameters of its config (each a JSON
# text): the tokenizer its dimension, tokens per text and the checkpoint's prompt names and
# default; the encoder its dimension, arithmetic route (with its task) and tokens per forward,
# a sequence classifier its labels (LOGITS' columns); each its fingerprint (what fixes its part
# of the vectors: qwen_embed.fingerprint).
FACTS = (
    "dimension",
    "tokens_per_text",
    "prompt_names",
    "default_prompt_name",
    "route",
    "tokens_per_forward",
    "labels",
    "scores",
    "fingerprint",
    "adapter_fingerprints",  # an encoder's lora_modules: {name: the adapter's own}
    "chunk_separator",  # a contextual checkpoint's sep_token (chunk_by_separator)
    "multi_vector",  # true: its vectors are one per token only (per_token; ColQwen3, ...)
    "reranks_by",  # an embedder that also reranks, its rerank_recipe ("e2rank": pseudo_query)
    "host_weight_bytes",  # an encoder instance's floor of host memory for its weights
    "host_weight_elements",  # the elements those weights hold (bytes / elements: their width)
)
# An embedding model's way to rerank, named by its deployment (the embed tokenizer's
# rerank_recipe): its checkpoint files are a plain embedder's.
RERANK_RECIPES = ("e2rank",)


def ensemble_steps(model: str) -> tuple[str, str]:
    """The (tokenizer, encoder) models of a served ensemble, as the repository names them:
    embed -> tokenizer, encoder; NAME -> NAME_tokenizer, NAME_encoder."""
    if model == "embed":
        return "tokenizer", "encoder"
    return f"{model}_tokenizer", f"{model}_encoder"


def model_fingerprint(
    tokenizer_facts: dict, encoder_facts: dict, adapter: str | None = None
) -> str | None:
    """The served model's fingerprint: its tokenizer's and encoder's together, and with an
    `adapter` (a request's, lora_modules) that adapter's own."""
    parts = (tokenizer_facts.get("fingerprint"), encoder_facts.get("fingerprint"))
    if adapter is not None:
        parts += (encoder_facts.get("adapter_fingerprints", {}).get(adapter),)
    if None in parts:
        return None
    return hashlib.sha256(":".join(parts).encode()).hexdigest()[:32]


class RequestError(ValueError):
    """A broken rule of the contract; the message names the field first ("parameter
    'dimensions' ...", "input 'TEXT[3]' ...") and the limit."""

    @property
    def field(self) -> str | None:
        """The request parameter it names, if any."""
        found = re.match(r"parameters? '(\w+)'", str(self))
        return found.group(1) if found else None


def read_facts(config: dict) -> dict:
    """A model's published facts from its config (Triton's JSON form, as get_model_config
    answers it with as_json)."""
    params = config.get("parameters", {})
    return {k: json.loads(params[k]["string_value"]) for k in FACTS if k in params}


def priority_level(priority: str | int | None) -> int:
    if priority is None:
        return 0
    if isinstance(priority, str) and priority in PRIORITIES:
        return PRIORITIES[priority]
    if isinstance(priority, int) and not isinstance(priority, bool) and priority in (0, 1, 2):
        return priority
    raise RequestError(f"priority must be one of {list(PRIORITIES)} (or 1, 2), got {priority!r}")


def _expect(name: str, value, kind: type, what: str):
    # bool is an int in Python: keep the two apart so `dimensions=true` is refused.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RequestError(f"parameter '{name}' must be {what}, got {_got(value)}")
    # Triton carries an integer parameter as int64: a wider one cannot even be sent.
    if kind is int and not -(2**63) <= value < 2**63:
        raise RequestError(f"parameter '{name}' must be {what} of at most 64 bits, got {value}")
    if kind is str and not is_utf8(value):
        raise RequestError(f"parameter '{name}' is not valid UTF-8 (a lone surrogate)")
    return value


def parse_json(text: str | bytes):
    """json.loads, with a text nested deeper than Python's recursion limit refused as JSON
    that is not valid (a ValueError), as any other client's mistake."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def is_utf8(text: str) -> bool:
    """False for a text with a lone surrogate (JSON may escape one, \\ud800), which no UTF-8
    text can hold. An ASCII text (most) is a scan, not an encoding: the client encodes each
    text once more to send it."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _got(value, limit: int = 100) -> str:
    """The value a message quotes, cut to `limit` characters: a client's megabyte stays out."""
    shown = repr(value)
    return shown if len(shown) <= limit else f"{shown[:limit]}... ({len(shown)} characters)"


def _optional(name: str, value, kind: type, what: str):
    return None if value is None else _expect(name, value, kind, what)


def at_least_one(name: str, value) -> int | None:
    """An optional integer >= 1 (`top_n`, `max_document_tokens`): None where not given."""
    n = _optional(name, value, int, "an integer")
    if n is not None and n < 1:
        raise RequestError(f"parameter '{name}' must be >= 1, got {n}")
    return n


def _text(name: str, value) -> str | None:
    if value is not None and not _expect(name, value, str, "a string").strip():
        raise RequestError(f"parameter '{name}' must not be empty")
    return value


def _one_of(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise RequestError(f"parameter '{name}' must be one of {list(allowed)}, got {_got(value)}")


def _video_sampling(opts) -> None:
    fps = opts.video_fps
    if fps is not None and (
        isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < math.inf
    ):
        raise RequestError(f"parameter 'video_fps' must be a number > 0, got {fps!r}")
    n = _optional("video_max_frames", opts.video_max_frames, int, "an integer")
    if n is not None and not 2 <= n <= MAX_KEPT_FRAMES:
        raise RequestError(f"parameter 'video_max_frames' must be in 2..{MAX_KEPT_FRAMES}, got {n}")


_VIDEO_FPS_HELP = "frames kept per second of each video (default 1)"
_VIDEO_MAX_FRAMES_HELP = (
    f"at most N frames kept of each video (default 64, up to {MAX_KEPT_FRAMES})"
)
_ADAPTER_HELP = "a LoRA adapter the server keeps beside the weights (its lora_modules)"


def _option(default, help: str, choices: tuple[str, ...] | None = None):
    """A request option's field, with what a user is told of it (the CLI's help)."""
    return field(default=default, metadata={"help": help, "choices": choices})


def option_flags(options: type[_Options]) -> list[tuple[str, dict]]:
    """argparse flags for the fields of `options` that have help text: (flag, keywords), the
    flag's destination the field's name. A boolean that defaults to true becomes --no-NAME."""
    flags = []
    for f in fields(options):
        if "help" not in f.metadata:
            continue
        name, keywords = f.name.replace("_", "-"), {"dest": f.name, "help": f.metadata["help"]}
        if isinstance(f.default, bool):
            flag = f"--no-{name}" if f.default else f"--{name}"
            keywords["action"] = "store_false" if f.default else "store_true"
            if f.default:
                keywords["help"] = f"off (on by default): {keywords['help']}"
        else:
            flag = f"--{name}"
            keywords["default"] = f.default
            if f.metadata["choices"]:
                keywords["choices"] = list(f.metadata["choices"])
            elif "int" in str(f.type):
                keywords["type"] = int
            elif "float" in str(f.type):
                keywords["type"] = float
        flags.append((flag, keywords))
    return flags


def options_from_flags(options: type[_Options], args) -> dict:
    """The values of `option_flags(options)` that argparse filled in `args`."""
    return {f.name: getattr(args, f.name) for f in fields(options) if "help" in f.metadata}


class _Options:
    """Shared by both option records: Triton request parameters in and out."""

    @classmethod
    def from_parameters(cls, params: dict):
        """From a Triton request's parameters (JSON-decoded); unknown names are refused."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise RequestError(f"unknown parameter(s) {unknown}; supported: {sorted(known)}")
        return cls(**{k: cls._decode(k, v) for k, v in params.items()})

    @classmethod
    def _decode(cls, name: str, value):
        return value

    def parameters(self) -> dict:
        """The Triton request parameters: every field that differs from its default."""
        defaults = type(self)()
        return {
            f.name: self._encode(f.name, getattr(self, f.name))
            for f in fields(self)
            if getattr(self, f.name) != getattr(defaults, f.name)
        }

    def _encode(self, name: str, value):
        return value


@dataclass(frozen=True)
class EmbedOptions(_Options):
    """Options of one `embed` request (docs/api.md)."""

    truncate: bool = _option(True, "cut a text past max_input_tokens (else refuse it)")
    truncation_direction: str | None = _option(
        None, "which end a cut text loses (default: the deployment's)", TRUNCATION_DIRECTIONS
    )
    max_tokens: int | None = _option(
        None, "tokens per text for this request, within the deployment's limit"
    )
    prompt_name: str | None = _option(None, "a name among the checkpoint's prompts")
    instruction: str | None = _option(None, "the task of the model's own query prompt")
    prompt: str | None = _option(None, "a literal prefix for every text")
    dimensions: int | None = _option(None, "Matryoshka: the first N dimensions")
    normalize: bool = _option(True, "unit-length vectors")
    embedding_type: str = _option(
        "float",
        "float32, or compact codes: int8, uint8, binary/ubinary (8 dimensions a byte)",
        EMBEDDING_TYPES,
    )  # or several separated by commas: each from one computation, in its own output
    # Late chunking: chunks of this many of a text's own tokens, or these [start, end) spans
    # of them, or of its characters (a chunk: the tokens that begin in it); one vector per
    # chunk.
    chunk_size: int | None = _option(
        None,
        "late chunking: one vector per this many tokens of each text, each in the context of "
        "the whole text",
    )
    chunk_spans: tuple[tuple[int, int], ...] | None = None
    chunk_chars: tuple[tuple[int, int], ...] | None = None
    # Or each text is a document's chunks joined by the model's separator (a contextual
    # checkpoint's sep_token, the fact chunk_separator), as pplx-embed-context's recipe does.
    chunk_by_separator: bool = False
    per_token: bool = _option(
        False,
        "one vector per token (the final hidden states, for late interaction) instead of one "
        "per text",
    )
    video_fps: float | None = _option(None, _VIDEO_FPS_HELP)
    video_max_frames: int | None = _option(None, _VIDEO_MAX_FRAMES_HELP)
    adapter: str | None = _option(None, _ADAPTER_HELP)
    # Each TEXT element holds the model's own token ids (pack_ids), taken as given: no
    # prompt, no special tokens added; the same limits as texts.
    token_ids: bool = False

    def __post_init__(self):
        _expect("truncate", self.truncate, bool, "a boolean")
        _expect("normalize", self.normalize, bool, "a boolean")
        if self.truncation_direction is not None:
            _one_of("truncation_direction", self.truncation_direction, TRUNCATION_DIRECTIONS)
        _optional("prompt_name", self.prompt_name, str, "a string")
        _text("instruction", self.instruction)
        _text("prompt", self.prompt)
        _text("adapter", self.adapter)
        if self.prompt is not None and (self.prompt_name or self.instruction) is not None:
            raise RequestError(
                "parameter 'prompt' replaces 'prompt_name' and 'instruction': send one of them"
            )
        if self.instruction is not None and self.prompt_name not in (None, "query"):
            raise RequestError(
                "parameter 'instruction' fills the 'query' prompt: it cannot be "
                f"combined with prompt_name={self.prompt_name!r}"
            )
        if _optional("max_tokens", self.max_tokens, int, "an integer") is not None:
            if self.max_tokens < 1:
                raise RequestError(f"parameter 'max_tokens' must be >= 1, got {self.max_tokens}")
        if _optional("dimensions", self.dimensions, int, "an integer") is not None:
            if self.dimensions < 1:
                raise RequestError(f"parameter 'dimensions' must be >= 1, got {self.dimensions}")
        self._check_types()
        self._check_chunks()
        _video_sampling(self)
        if _expect("per_token", self.per_token, bool, "a boolean"):
            if self.chunked or self.embedding_types != ("float",):
                raise RequestError(
                    "parameter 'per_token' gives float vectors of every token: it cannot be "
                    "combined with chunks or embedding_type "
                    f"{self.embedding_type!r}"
                )
        if _expect("token_ids", self.token_ids, bool, "a boolean"):
            given = [n for n in ("prompt_name", "instruction", "prompt") if getattr(self, n)]
            if given or self.chunked:
                raise RequestError(
                    f"parameter 'token_ids' takes the ids as given: it cannot be combined with "
                    f"{given[0] if given else 'chunks'!r} (prompts and chunks are for texts)"
                )

    def _check_types(self) -> None:
        kinds = _expect("embedding_type", self.embedding_type, str, "a string").split(",")
        if not all(k in EMBEDDING_TYPES for k in kinds) or len(set(kinds)) != len(kinds):
            raise RequestError(
                f"parameter 'embedding_type' must be one of {list(EMBEDDING_TYPES)}, or several "
                f"of them separated by commas, got {_got(self.embedding_type)}"
            )

    @property
    def embedding_types(self) -> tuple[str, ...]:
        """The types asked for, in EMBEDDING_TYPES order."""
        kinds = self.embedding_type.split(",")
        return tuple(k for k in EMBEDDING_TYPES if k in kinds)

    def _check_chunks(self) -> None:
        _expect("chunk_by_separator", self.chunk_by_separator, bool, "a boolean")
        if _optional("chunk_size", self.chunk_size, int, "an integer") is not None:
            if self.chunk_size < 1:
                raise RequestError(f"parameter 'chunk_size' must be >= 1, got {self.chunk_size}")
        for name in SPAN_OPTIONS:
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _spans(name, getattr(self, name)))
        given = [n for n in ("chunk_size", *SPAN_OPTIONS) if getattr(self, n) is not None]
        given += ["chunk_by_separator"] if self.chunk_by_separator else []
        if len(given) > 1:
            raise RequestError(f"parameters {given} exclude each other: send one")
        if self.chunked and self.embedding_types != ("float",):
            raise RequestError(
                f"parameter 'embedding_type' must be 'float' with chunks, "
                f"got {_got(self.embedding_type)}"
            )

    @property
    def chunked(self) -> bool:
        given = (getattr(self, n) is not None for n in ("chunk_size", *SPAN_OPTIONS))
        return self.chunk_by_separator or any(given)

    @property
    def outputs(self) -> dict[str, str]:
        """embedding type -> the Triton output that carries its vectors."""
        if self.chunked:
            return {"float": "CHUNK_EMBEDDING"}
        if self.per_token:
            return {"float": "TOKEN_EMBEDDING"}
        return {k: EMBEDDING_OUTPUTS[k] for k in self.embedding_types}

    def check_model(self, dimension: int, prompt_names: list[str]) -> EmbedOptions:
        """What needs the served model: its dimension and its checkpoint's prompt names."""
        if self.dimensions is not None and self.dimensions > dimension:
            raise RequestError(
                f"parameter 'dimensions' must be in 1..{dimension}, got {self.dimensions}"
            )
        if self.prompt_name is not None and self.prompt_name not in prompt_names:
            raise RequestError(
                f"parameter 'prompt_name' must be one of {sorted(prompt_names)} (the "
                f"prompts of this model), got {_got(self.prompt_name)}"
            )
        return self

    @classmethod
    def _decode(cls, name: str, value):
        # Triton parameters are scalars: the spans travel as a JSON text.
        if name in SPAN_OPTIONS and isinstance(value, str):
            try:
                return parse_json(value)
            except ValueError:
                raise RequestError(
                    f"parameter '{name}' must be {_spans_form(name)}, got {_got(value)}"
                ) from None
        return value

    def _encode(self, name: str, value):
        return json.dumps([list(s) for s in value]) if name in SPAN_OPTIONS else value

    def finish(self) -> Finish:
        return Finish(self.dimensions, self.normalize, self.embedding_types, self.per_token)


# Late chunking's spans: of a text's own tokens, or of its characters.
SPAN_OPTIONS = ("chunk_spans", "chunk_chars")


def _spans_form(name: str) -> str:
    unit = "character" if name == "chunk_chars" else "token"
    return f"a JSON list of at most {MAX_CHUNKS} [start, end] {unit} spans"


def _spans(name: str, value) -> tuple[tuple[int, int], ...]:
    ok = (
        isinstance(value, (list, tuple))
        and 0 < len(value) <= MAX_CHUNKS
        and all(
            isinstance(s, (list, tuple))
            and len(s) == 2
            and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in s)
            for s in value
        )
    )
    if not ok:
        raise RequestError(f"parameter '{name}' must be {_spans_form(name)}, got {_got(value)}")
    for j, (start, end) in enumerate(value):
        if not 0 <= start < end:
            raise RequestError(
                f"parameter '{name}'[{j}] = [{start}, {end}] must have 0 <= start < end"
            )
    return tuple((int(start), int(end)) for start, end in value)


@dataclass(frozen=True)
class RerankOptions(_Options):
    """Options of one `rerank` request (docs/api.md); `top_n` is the client's own."""

    truncate: bool = _option(True, "cut the document to fit max_input_tokens (else refuse it)")
    instruction: str | None = _option(
        None, "the task the query states (None: the reranker's own default)"
    )
    max_document_tokens: int | None = _option(None, "each document cut to its first N tokens")
    video_fps: float | None = _option(None, _VIDEO_FPS_HELP)
    video_max_frames: int | None = _option(None, _VIDEO_MAX_FRAMES_HELP)
    adapter: str | None = _option(None, _ADAPTER_HELP)

    def __post_init__(self):
        _expect("truncate", self.truncate, bool, "a boolean")
        _text("instruction", self.instruction)
        _text("adapter", self.adapter)
        at_least_one("max_document_tokens", self.max_document_tokens)
        _video_sampling(self)


@dataclass(frozen=True)
class Finish:
    """The encoder's share of an embed request's options: how pooled vectors are finished."""

    dimensions: int | None = None  # None: all
    normalize: bool = True
    embedding_types: tuple[str, ...] = ("float",)  # in EMBEDDING_TYPES order
    per_token: bool = False  # a vector per token (TOKEN_EMBEDDING), not per text
    # per_token: a MultiVectorEncoder's document, its skiplist's tokens left out (TOKEN_ROWS)
    skiplist: bool = False


def finish_rows(finish: Finish, n: int) -> np.ndarray:
    """FINISH int32 [n, 5] for a request's n texts: (dimensions, 0 for all; normalize 0/1;
    the embedding types as bits, 1 << their index in EMBEDDING_TYPES; per_token 0/1;
    skiplist 0/1). Options are parsed once, in the tokenizer; the encoder's answer depends on
    its inputs alone (so Triton's response cache, which hashes inputs, never mixes two
    requests' options)."""
    types = sum(1 << EMBEDDING_TYPES.index(k) for k in finish.embedding_types)
    row = (finish.dimensions or 0, int(finish.normalize), types, int(finish.per_token))
    row += (int(finish.skiplist),)
    return np.tile(np.array(row, dtype=np.int32), (n, 1))


def read_finish(rows: np.ndarray | None, dimension: int) -> Finish:
    """FINISH rows back (absent: every dimension, normalised, float)."""
    if rows is None:
        return Finish()
    if rows.ndim != 2 or rows.shape[1] != 5 or len(rows) == 0 or (rows != rows[0]).any():
        raise RequestError("input 'FINISH' must be [n, 5], the same row for every text")
    dims, normalize, types, per_token, skiplist = (int(v) for v in rows[0])
    all_types = (1 << len(EMBEDDING_TYPES)) - 1
    if (
        not 0 <= dims <= dimension
        or normalize not in (0, 1)
        or not 0 < types <= all_types
        or per_token not in (0, 1)
        or skiplist not in (0, per_token)
    ):
        raise RequestError(
            f"input 'FINISH' must hold (dimensions in 0..{dimension}, normalize 0 or 1, "
            f"embedding types as bits in 1..{all_types}, per_token 0 or 1, skiplist 0 or "
            f"per_token), got ({dims}, {normalize}, {types}, {per_token}, {skiplist})"
        )
    kinds = tuple(k for i, k in enumerate(EMBEDDING_TYPES) if types >> i & 1)
    return Finish(dims or None, bool(normalize), kinds, bool(per_token), bool(skiplist))


def required(tensor, name: str) -> np.ndarray:
    """A model's required input (a pb_utils.Tensor, or None where absent) as its array: Triton
    2.51 lets a request without it through to a model that also has optional inputs."""
    if tensor is None:
        raise RequestError(f"input '{name}' is required")
    return tensor.as_numpy()


def _elements(raw: np.ndarray, max_texts: int, max_text_bytes: int, name: str) -> list[bytes]:
    """A BYTES input [n, 1] -> its n elements as bytes, refusing n = 0, n > max_texts and an
    element longer than max_text_bytes (checked before any decoding)."""
    flat = raw.reshape(-1)
    if flat.size == 0:
        raise RequestError(f"input '{name}' must hold at least 1 text, got 0")
    if flat.size > max_texts:
        raise RequestError(
            f"input '{name}' holds {flat.size} texts, more than the limit of "
            f"{max_texts} per request"
        )
    items = [item if isinstance(item, bytes) else str(item).encode() for item in flat]
    for i, item in enumerate(items):
        if len(item) > max_text_bytes:
            raise RequestError(
                f"input '{name}[{i}]' is {len(item)} bytes, more than the limit of "
                f"{max_text_bytes} bytes per text"
            )
    return items


def decode_texts(
    raw: np.ndarray,
    max_texts: int,
    max_text_bytes: int,
    name: str = "TEXT",
    may_be_empty: frozenset[int] = frozenset(),
) -> list[str]:
    """A BYTES input [n, 1] -> n strings. Refuses n = 0, n > max_texts, texts longer than
    max_text_bytes (checked before tokenizing, so a huge text costs nothing), invalid UTF-8,
    NUL characters and empty texts (but those in `may_be_empty`: texts with images)."""
    texts = []
    for i, item in enumerate(_elements(raw, max_texts, max_text_bytes, name)):
        try:
            text = item.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(
                f"input '{name}[{i}]' is not valid UTF-8 ({e.reason} at byte {e.start})"
            ) from None
        if "\x00" in text:
            raise RequestError(
                f"input '{name}[{i}]' contains a NUL character (byte {item.index(0)})"
            )
        if not text.strip() and i not in may_be_empty:
            raise RequestError(f"input '{name}[{i}]' is empty or only whitespace")
        texts.append(text)
    return texts


def decode_id_lists(
    raw: np.ndarray, max_texts: int, max_text_bytes: int, name: str = "TEXT"
) -> list[np.ndarray]:
    """A BYTES input [n, 1] of packed token ids (parameter token_ids) -> n int32 arrays, with
    decode_texts' limits on n and on each element's bytes."""
    lists = []
    for i, item in enumerate(_elements(raw, max_texts, max_text_bytes, name)):
        if len(item) == 0 or len(item) % 4:
            raise RequestError(
                f"input '{name}[{i}]' must be a non-empty list of token ids packed as int32 "
                "(parameter token_ids)"
            )
        lists.append(np.frombuffer(item, dtype="<i4"))
    return lists


def pack_images(images: list[bytes]) -> bytes:
    """A text's images for the IMAGES input (one BYTES element per text; b"" for none):
    int32 count, int32 byte length of each, then the files one after another."""
    if not images:
        return b""
    head = np.array([len(images), *(len(b) for b in images)], dtype="<i4").tobytes()
    return head + b"".join(images)


def unpack_images(blob: bytes, index: int, name: str = "IMAGES") -> list[bytes]:
    """pack_images' files back, refusing more than MAX_IMAGES_PER_TEXT images (for VIDEOS:
    MAX_VIDEOS_PER_TEXT videos), a file over MAX_IMAGE_BYTES (MAX_VIDEO_BYTES) and a malformed
    element (checked before anything is decoded)."""
    if not blob:
        return []
    kind, most, max_bytes = (
        ("videos", MAX_VIDEOS_PER_TEXT, MAX_VIDEO_BYTES)
        if name == "VIDEOS"
        else ("images", MAX_IMAGES_PER_TEXT, MAX_IMAGE_BYTES)
    )
    return _unpack(blob, f"input '{name}[{index}]'", kind, most, max_bytes)


# A video given as its frames (image files, in order) rather than a file: this prefix, then
# the frames packed as pack_images packs files. At most MAX_VIDEO_FRAMES frames, each at most
# MAX_IMAGE_BYTES, the whole within MAX_VIDEO_BYTES.
FRAMES_PREFIX = b"qwen-embed frames\n"


def pack_frames(frames: list[bytes]) -> bytes:
    """A video as the image files of its frames, one entry of a VIDEOS element's list."""
    if not frames:
        raise ValueError("a video given as frames needs at least one frame")
    return FRAMES_PREFIX + pack_images(frames)


def unpack_frames(video: bytes, where: str) -> list[bytes] | None:
    """pack_frames' image files back; None for a video file."""
    if not video.startswith(FRAMES_PREFIX):
        return None
    return _unpack(video[len(FRAMES_PREFIX) :], where, "frames", MAX_VIDEO_FRAMES, MAX_IMAGE_BYTES)


def _unpack(blob: bytes, where: str, kind: str, most: int, max_bytes: int) -> list[bytes]:
    count = int(np.frombuffer(blob[:4], "<i4")[0]) if len(blob) >= 4 else -1
    if not 0 < count <= most:
        raise RequestError(f"{where} must hold 1 to {most} {kind} (pack_images), got {count}")
    if len(blob) < 4 * (count + 1):
        raise RequestError(f"{where} is not packed {kind} (pack_images)")
    sizes = np.frombuffer(blob[4 : 4 * (count + 1)], "<i4")
    if (sizes <= 0).any() or 4 * (count + 1) + int(sizes.sum()) != len(blob):
        raise RequestError(f"{where} is not packed {kind} (pack_images)")
    big = np.flatnonzero(sizes > max_bytes)
    if big.size:
        raise RequestError(
            f"{where} {kind[:-1]} {int(big[0])} is {int(sizes[big[0]])} bytes, more than the "
            f"limit of {max_bytes} bytes per {kind[:-1]}"
        )
    ends = 4 * (count + 1) + np.cumsum(sizes)
    return [blob[int(b - n) : int(b)] for n, b in zip(sizes, ends, strict=True)]


def pack_media(visuals: list[np.ndarray]) -> bytes:
    """A text's images and videos for the encoder (MEDIA, one BYTES element per text; b"" for
    none) in the order of their placeholders, each resized RGB uint8: an image [height, width,
    3], a video's frames [frames, height, width, 3]. int32 count, (frames, height, width) of
    each (frames 0: an image), then their pixels."""
    if not visuals:
        return b""
    shapes = [(0, *v.shape[:2]) if v.ndim == 3 else v.shape[:3] for v in visuals]
    head = np.array([len(visuals)] + [d for shape in shapes for d in shape], "<i4")
    return head.tobytes() + b"".join(np.ascontiguousarray(v, np.uint8).tobytes() for v in visuals)


def unpack_media(blob: bytes, index: int) -> list[np.ndarray]:
    """pack_media's images and videos back (views of the element's bytes)."""
    if not blob:
        return []
    count = int(np.frombuffer(blob[:4], "<i4")[0]) if len(blob) >= 4 else 0
    shapes = np.frombuffer(blob[4 : 4 + 12 * count], "<i4").reshape(-1, 3) if count > 0 else None
    if shapes is None or len(shapes) != count or (shapes < 0).any() or (shapes[:, 1:] == 0).any():
        raise RequestError(f"input 'MEDIA[{index}]' is not packed images (pack_media)")
    sizes = np.maximum(shapes[:, 0], 1) * shapes[:, 1] * shapes[:, 2] * 3
    ends = 4 + 12 * count + np.cumsum(sizes)
    if int(ends[-1]) != len(blob):
        raise RequestError(f"input 'MEDIA[{index}]' is not packed images (pack_media)")
    pixels = np.frombuffer(blob, np.uint8)
    return [
        pixels[int(end - size) : int(end)].reshape(*([t] if t else []), h, w, 3)
        for (t, h, w), size, end in zip(shapes.tolist(), sizes, ends, strict=True)
    ]


def pack_ids(ids) -> bytes:
    """Token ids travel between the steps as one BYTES element per text: with padded id
    tensors Triton's dynamic batcher stops batching across requests (docs/architecture.md)."""
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(blob: bytes, index: int) -> np.ndarray:
    if len(blob) == 0 or len(blob) % 4:
        raise RequestError(f"input 'TOKEN_IDS[{index}]' must be a non-empty packed int32 list")
    return np.frombuffer(blob, dtype="<i4")


def pack_chunks(tail: int, spans: np.ndarray) -> bytes:
    """A text's chunks for the encoder (one BYTES element): int32 (tail, start, end, ...), the
    spans over its token ids, `tail` the special tokens appended after the text."""
    return np.concatenate([[tail], np.asarray(spans).reshape(-1)]).astype("<i4").tobytes()


def unpack_chunks(blob: bytes, index: int) -> tuple[int, np.ndarray] | None:
    """pack_chunks' (tail, spans [k, 2]); None for an empty element (no chunking)."""
    if len(blob) == 0:
        return None
    arr = np.frombuffer(blob, dtype="<i4") if len(blob) % 4 == 0 else np.zeros(0, "<i4")
    if arr.size < 3 or arr.size % 2 == 0:
        raise RequestError(f"input 'CHUNKS[{index}]' must be packed int32 (tail, start, end, ...)")
    return int(arr[0]), arr[1:].reshape(-1, 2).astype(np.int64)


def stack_ragged(rows: list[np.ndarray], fill, dtype) -> np.ndarray:
    """Per-text arrays [k_i, ...] -> one output [n, max k_i, ...], `fill` past each text's own
    rows: late chunking's CHUNK_EMBEDDING (zeros) and CHUNK_SPANS (-1), as texts have
    different chunk counts."""
    out = np.full((len(rows), max(len(r) for r in rows), *rows[0].shape[1:]), fill, dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def compact(vectors: np.ndarray, embedding_type: str) -> np.ndarray:
    """float32 [n, d] -> the `embedding_type` codes [n, d] (or [n, ceil(d / 8)] for bits)."""
    if embedding_type == "float":
        return vectors
    if embedding_type in ("int8", "uint8"):
        peak = np.abs(vectors).max(axis=1, keepdims=True)
        scale = np.divide(127.0, peak, out=np.zeros_like(peak), where=peak > 0)
        codes = np.clip(np.rint(vectors * scale), -127, 127).astype(np.int8)
        return (
            codes if embedding_type == "int8" else (codes.astype(np.int16) + 128).astype(np.uint8)
        )
    if embedding_type in ("binary", "ubinary"):
        bits = np.packbits(vectors > 0, axis=1)
        return (
            bits if embedding_type == "ubinary" else (bits.astype(np.int16) - 128).astype(np.int8)
        )
    raise ValueError(
        f"embedding_type must be one of {list(EMBEDDING_TYPES)}, not {embedding_type!r}"
    )


def coded_outputs(vectors: np.ndarray, embedding_types: tuple[str, ...]) -> dict[str, np.ndarray]:
    """A response's outputs: each asked type's codes in its own, all from the same vectors;
    the others are left out (an empty output would keep Triton's response cache from storing
    the response)."""
    return {EMBEDDING_OUTPUTS[kind]: compact(vectors, kind) for kind in embedding_types}
