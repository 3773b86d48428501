"""Per-request options and text handling shared by the tokenizer and encoder Triton models.

Everything here raises RequestError with a message naming the field and the limit; the model.py
files turn it into an INVALID_ARG response for that request only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ..compact import EMBEDDING_TYPES

# Qwen3-Embedding's default task (its query prompt and the reranker's default instruction).
DEFAULT_TASK = "Given a web search query, retrieve relevant passages that answer the query"
TRUNCATION_DIRECTIONS = ("right", "left")
MAX_CHUNKS = 512  # chunks per text (late chunking): each is a read-out row of the forward


class RequestError(ValueError):
    pass


@dataclass(frozen=True)
class RequestOptions:
    truncate: bool = True
    prompt_name: str | None = None  # a name in the checkpoint's prompts (serving/prompts.py)
    instruction: str | None = None  # the task of the model's own query prompt
    prompt: str | None = None  # a literal prefix
    truncation_direction: str | None = None  # None: the deployment's default
    dimensions: int | None = None
    normalize: bool = True
    embedding_type: str = "float"  # compact.EMBEDDING_TYPES
    # Late chunking: chunks of this many of the text's tokens, or these [start, end) spans of
    # them (serving/tokenizer.py); one vector per chunk.
    chunk_size: int | None = None
    chunk_spans: tuple[tuple[int, int], ...] | None = None

    @property
    def chunked(self) -> bool:
        return self.chunk_size is not None or self.chunk_spans is not None


def _expect(name: str, value, kind: type, what: str):
    # bool is an int in Python: keep the two apart so `dimensions=true` is refused.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RequestError(f"parameter '{name}' must be {what}, got {value!r}")
    return value


def _text(params: dict, name: str) -> str:
    text = _expect(name, params[name], str, "a string")
    if not text.strip():
        raise RequestError(f"parameter '{name}' must not be empty")
    return text


def parse_common(params: dict, options: type, what: str) -> dict:
    """Refuse parameters `options` (a dataclass) has no field for; check `truncate`."""
    known = set(options.__dataclass_fields__)
    unknown = sorted(set(params) - known)
    if unknown:
        raise RequestError(f"unknown parameter(s) {unknown}; {what}: {sorted(known)}")
    opts = {}
    if "truncate" in params:
        opts["truncate"] = _expect("truncate", params["truncate"], bool, "a boolean")
    return opts


def parse_options(params: dict, hidden_size: int, prompts=None) -> RequestOptions:
    """Validate Triton request parameters (already JSON-decoded). With `prompts` (the
    checkpoint's PromptSet) a prompt_name must be one of its names."""
    opts = parse_common(params, RequestOptions, "supported")
    if "normalize" in params:
        opts["normalize"] = _expect("normalize", params["normalize"], bool, "a boolean")
    if "prompt_name" in params:
        name = _expect("prompt_name", params["prompt_name"], str, "a string")
        opts["prompt_name"] = prompts.check_name(name) if prompts is not None else name
    for name in ("instruction", "prompt"):
        if name in params:
            opts[name] = _text(params, name)
    if "prompt" in opts and ("prompt_name" in opts or "instruction" in opts):
        raise RequestError(
            "parameter 'prompt' replaces 'prompt_name' and 'instruction': send one of them"
        )
    if "instruction" in opts and opts.get("prompt_name", "query") != "query":
        raise RequestError(
            "parameter 'instruction' fills the 'query' prompt: it cannot be "
            f"combined with prompt_name={opts['prompt_name']!r}"
        )
    if "truncation_direction" in params:
        direction = _expect("truncation_direction", params["truncation_direction"], str, "a string")
        if direction not in TRUNCATION_DIRECTIONS:
            raise RequestError(
                f"parameter 'truncation_direction' must be 'left' or 'right', got {direction!r}"
            )
        opts["truncation_direction"] = direction
    if "dimensions" in params:
        dims = _expect("dimensions", params["dimensions"], int, "an integer")
        if not 1 <= dims <= hidden_size:
            raise RequestError(f"parameter 'dimensions' must be in 1..{hidden_size}, got {dims}")
        opts["dimensions"] = dims
    if "embedding_type" in params:
        kind = _expect("embedding_type", params["embedding_type"], str, "a string")
        if kind not in EMBEDDING_TYPES:
            raise RequestError(
                f"parameter 'embedding_type' must be one of {list(EMBEDDING_TYPES)}, got {kind!r}"
            )
        opts["embedding_type"] = kind
    opts.update(_chunk_options(params, opts.get("embedding_type", "float")))
    return RequestOptions(**opts)


def _chunk_options(params: dict, embedding_type: str) -> dict:
    opts = {}
    if "chunk_size" in params:
        size = _expect("chunk_size", params["chunk_size"], int, "an integer")
        if size < 1:
            raise RequestError(f"parameter 'chunk_size' must be >= 1, got {size}")
        opts["chunk_size"] = size
    if "chunk_spans" in params:
        opts["chunk_spans"] = _spans(params["chunk_spans"])
    if len(opts) == 2:
        raise RequestError("parameters 'chunk_size' and 'chunk_spans' exclude each other")
    if opts and embedding_type != "float":
        raise RequestError(
            f"parameter 'embedding_type' must be 'float' with chunks, got {embedding_type!r}"
        )
    return opts


def _spans(value) -> tuple[tuple[int, int], ...]:
    what = f"a JSON list of at most {MAX_CHUNKS} [start, end] token spans"
    try:
        spans = json.loads(_expect("chunk_spans", value, str, what))
    except ValueError:
        spans = None
    ok = (
        isinstance(spans, list)
        and 0 < len(spans) <= MAX_CHUNKS
        and all(
            isinstance(s, list)
            and len(s) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in s)
            for s in spans
        )
    )
    if not ok:
        raise RequestError(f"parameter 'chunk_spans' must be {what}, got {value!r}")
    for j, (start, end) in enumerate(spans):
        if not 0 <= start < end:
            raise RequestError(
                f"parameter 'chunk_spans'[{j}] = [{start}, {end}] must have 0 <= start < end"
            )
    return tuple((start, end) for start, end in spans)


def finish_rows(opts: RequestOptions, n: int) -> np.ndarray:
    """What the encoder needs of a request's options, for each of its n texts: the tokenizer's
    FINISH output [n, 3] = (dimensions, 0 for all; normalize 0/1; embedding type, an index
    into compact.EMBEDDING_TYPES). Options are parsed once, in the tokenizer; the encoder's
    result depends on its inputs alone (so Triton's response cache, which hashes inputs,
    never mixes two requests' options)."""
    row = (opts.dimensions or 0, int(opts.normalize), EMBEDDING_TYPES.index(opts.embedding_type))
    return np.tile(np.array(row, dtype=np.int32), (n, 1))


def read_finish(rows: np.ndarray | None, hidden_size: int) -> tuple[int | None, bool, str]:
    """FINISH [n, 3] (absent: every dimension, normalised, float) -> (dimensions, normalize,
    embedding type)."""
    if rows is None:
        return None, True, "float"
    if rows.ndim != 2 or rows.shape[1] != 3 or len(rows) == 0 or (rows != rows[0]).any():
        raise RequestError("input 'FINISH' must be [n, 3], the same row for every text")
    dims, normalize, kind = (int(v) for v in rows[0])
    if (
        not 0 <= dims <= hidden_size
        or normalize not in (0, 1)
        or not 0 <= kind < len(EMBEDDING_TYPES)
    ):
        raise RequestError(
            f"input 'FINISH' must hold (dimensions in 0..{hidden_size}, normalize 0 or 1, "
            f"embedding type in 0..{len(EMBEDDING_TYPES) - 1}), got ({dims}, {normalize}, {kind})"
        )
    return dims or None, bool(normalize), EMBEDDING_TYPES[kind]


def decode_texts(
    raw: np.ndarray, max_texts: int, max_text_bytes: int, name: str = "TEXT"
) -> list[str]:
    """TEXT [n, 1] (or the input `name`) of bytes -> n strings.

    Refuses n = 0, n > max_texts, texts longer than max_text_bytes (checked before tokenizing,
    so a huge text costs nothing), invalid UTF-8, NUL characters and empty texts.
    """
    flat = raw.reshape(-1)
    if flat.size == 0:
        raise RequestError(f"input '{name}' must hold at least 1 text, got 0")
    if flat.size > max_texts:
        raise RequestError(
            f"input '{name}' holds {flat.size} texts, more than the limit of "
            f"{max_texts} per request"
        )
    texts = []
    for i, item in enumerate(flat):
        item = item if isinstance(item, bytes) else str(item).encode()
        if len(item) > max_text_bytes:
            raise RequestError(
                f"input '{name}[{i}]' is {len(item)} bytes, more than the limit of "
                f"{max_text_bytes} bytes per text"
            )
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
        if not text.strip():
            raise RequestError(f"input '{name}[{i}]' is empty or only whitespace")
        texts.append(text)
    return texts


def pack_ids(ids: list[int]) -> bytes:
    """Token ids travel between the models as one BYTES element per text: with padded id
    tensors Triton's dynamic batcher stops batching across requests (docs/architecture.md)."""
    return np.asarray(ids, dtype="<i4").tobytes()


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
    """Per-text arrays [k_i, ...] -> one request output [n, max k_i, ...], `fill` past each
    text's own rows (late chunking's outputs: texts have different chunk counts)."""
    out = np.full((len(rows), max(len(r) for r in rows), *rows[0].shape[1:]), fill, dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def unpack_ids(blob: bytes, index: int) -> np.ndarray:
    if len(blob) == 0 or len(blob) % 4:
        raise RequestError(f"input 'TOKEN_IDS[{index}]' must be a non-empty packed int32 list")
    return np.frombuffer(blob, dtype="<i4")
