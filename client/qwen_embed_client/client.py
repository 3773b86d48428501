"""Clients for the Triton `embed` and `rerank` ensembles: one or many servers, sync and async.

One implementation (async); the sync client runs it on a private event-loop thread so it also
works where a loop is already running (notebooks). Depends on tritonclient and numpy only.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import numpy as np
from tritonclient.utils import InferenceServerException

from . import pseudo_query
from .contract import (
    ANSWER_TOO_LARGE,
    ITEM_INPUTS,
    MAX_TEXTS_PER_REQUEST,
    EmbedOptions,
    RerankOptions,
    at_least_one,
    ensemble_steps,
    is_utf8,
    model_fingerprint,
    pack_frames,
    pack_ids,
    pack_images,
    priority_level,
    read_facts,
)
from .scheduler import ServerState, run_job

# Worth sending again: overload (a full queue), a server or model not there yet, a transport
# failure; never a refusal of the request itself (INVALID_ARGUMENT / 400).
RETRYABLE_STATUSES = {
    "StatusCode.UNAVAILABLE",
    "StatusCode.RESOURCE_EXHAUSTED",
    "502",
    "503",
    "504",
    "None",
}
# Triton 2.51's answer (INTERNAL) while a model's Python process is dead: the launcher's
# watchdog loads the model again within seconds.
DEAD_STUB = "is not healthy"
# The status of a request not sent: its caller's deadline (deadline()) had passed.
DEADLINE_PASSED = "DEADLINE_PASSED"
MAX_BACKOFF_S = 2.0
FAILOVER_S = 1.0  # with several servers: retries in place before a chunk moves to another
FACTS_TTL_S = 10.0  # a reloaded model may publish new facts (another checkpoint)
# An item a server's error names, 'TEXT[3]': its index within that Triton request.
_ITEM = re.compile(rf"'({'|'.join(ITEM_INPUTS)})\[(\d+)\]'")
_TEXT = re.compile(r"'TEXT\[(\d+)\]'")


def _pseudo_named(message: str) -> str:
    """An embed error of E2Rank's texts named by the caller's inputs: text 0 is the pseudo
    query (the query with the first documents), text k document k - 1."""

    def name(match: re.Match) -> str:
        k = int(match[1])
        return "'QUERY' (with the documents it reads)" if k == 0 else f"'DOCUMENTS[{k - 1}]'"

    return _TEXT.sub(name, message)


# When the caller stops waiting (time.monotonic()), for the requests sent within deadline().
_DEADLINE: ContextVar[float | None] = ContextVar("qwen_embed_deadline", default=None)


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Within it, the client's calls (from this task and the tasks it starts, or this thread)
    end `seconds` from now, retries included: each Triton request waits at most what is left and
    carries it as its server-side timeout, so that a request still queued for the encoder
    when its caller stops waiting is dropped there, not computed."""
    token = _DEADLINE.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


# Tokens per Triton model of the requests answered within metered().
_USAGE: ContextVar[dict[str, int] | None] = ContextVar("qwen_embed_usage", default=None)


@contextmanager
def metered() -> Iterator[dict[str, int]]:
    """Within it, the client's calls (from this task and the tasks it starts, or this thread)
    add to the dict it yields each model asked, by its Triton name, and the tokens its answers
    ran (their TOKEN_COUNT: prompts, special tokens and media included, after truncation); a
    model asked whose answer failed stays at 0. The tokenizer-only calls (tokenize,
    count_tokens, decode) run no model and add nothing."""
    usage: dict[str, int] = {}
    token = _USAGE.set(usage)
    try:
        yield usage
    finally:
        _USAGE.reset(token)


# What each Triton request within guarded() passes first: check(model, priority) -> priority.
Check = Callable[[str, int], int]
_GUARD: ContextVar[Check | None] = ContextVar("qwen_embed_guard", default=None)


@contextmanager
def guarded(check: Check | None) -> Iterator[None]:
    """Within it, every Triton request a call would send (to an ensemble, or to a tokenizer
    for the tokenizer-only calls) first passes `check(model, priority)` (None: no check),
    which refuses it by raising, before anything is sent, or returns the priority it goes at
    (Triton's level; 0: the model's default): a gateway's per-key models and priority, in the
    one place every request passes."""
    token = _GUARD.set(check)
    try:
        yield
    finally:
        _GUARD.reset(token)


def listed(texts, what: str, token_ids: bool = False) -> list:
    """`texts` (one string: one text) as a list, each refused here, named by its place, where
    the server could not even be sent it: other than a str (with `token_ids`, other than a
    list of ids), or a str with a lone surrogate."""
    texts = [texts] if isinstance(texts, str) else texts
    if isinstance(texts, (bytes, dict)) or not hasattr(texts, "__iter__"):
        raise TypeError(f"{what} must be a str or a list of str, got {type(texts).__name__}")
    texts = list(texts)
    if not texts:
        raise ValueError(f"{what} must not be empty")
    for i, text in enumerate(texts):
        if not token_ids:
            ids = what == "texts" and isinstance(text, (list, tuple))
            text_checked(text, f"{what}[{i}]", " (token ids go with token_ids=True)" if ids else "")
        elif isinstance(text, (str, bytes)) or not hasattr(text, "__len__"):
            raise TypeError(f"{what}[{i}] must be a list of token ids (token_ids=True)")
    return texts


def _media_per_text(count: int, images, videos) -> dict:
    """IMAGES and VIDEOS as the server's inputs name them: per text, its files (None: none
    given); a list of another length than the texts' is refused."""
    media = {"IMAGES": images, "VIDEOS": videos}
    for name, files in media.items():
        if files is not None and len(files) != count:
            raise ValueError(
                f"{name.lower()} must hold a list per text ({count}), got {len(files)}"
            )
    return media


def joined_documents(documents, separator: str) -> list[str]:
    """Each document (a list of chunks) as one text, its chunks joined by `separator`; a
    document without chunks, an empty chunk or one holding the separator is refused, named by
    its place."""
    if isinstance(documents, (str, bytes, dict)) or not hasattr(documents, "__iter__"):
        raise TypeError("documents must be a list of lists of str (each document's chunks)")
    texts = []
    for i, chunks in enumerate(documents):
        if isinstance(chunks, (str, bytes, dict)) or not hasattr(chunks, "__iter__"):
            raise TypeError(f"documents[{i}] must be a list of str (the document's chunks)")
        chunks = [text_checked(c, f"documents[{i}][{j}]") for j, c in enumerate(chunks)]
        if not chunks:
            raise ValueError(f"documents[{i}] must hold at least one chunk")
        for j, chunk in enumerate(chunks):
            if not chunk or separator in chunk:
                why = "is empty" if not chunk else f"holds the separator {separator!r}"
                raise ValueError(f"documents[{i}][{j}] {why}: each chunk is a text of its own")
        texts.append(separator.join(chunks))
    if not texts:
        raise ValueError("documents must not be empty")
    return texts


def text_checked(text, what: str, hint: str = "") -> str:
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str, got {type(text).__name__}{hint}")
    if not is_utf8(text):
        raise ValueError(f"{what} is not valid UTF-8 (a lone surrogate)")
    return text


def halving(send):
    """`send(server, start, end)`, a list per item, sent again as two halves where the server
    refuses its answer as too large (ANSWER_TOO_LARGE), down to one item: a per-token or chunks
    job's requests follow the server's limit on one answer, whatever its texts' lengths."""

    async def fitting(server, start: int, end: int) -> list:
        try:
            return await send(server, start, end)
        except EmbeddingError as e:
            if end - start < 2 or ANSWER_TOO_LARGE not in str(e):
                raise
        middle = (start + end) // 2
        first = await fitting(server, start, middle)
        try:
            return first + await fitting(server, middle, end)
        except EmbeddingError as e:  # named from `start`, as the whole request's would be
            raise e.counted_from(middle - start) from None

    return fitting


class EmbeddingError(Exception):
    """An error answered by the server (message kept verbatim) or a transport failure."""

    def __init__(self, message: str, status: str | None = None, url: str | None = None):
        super().__init__(message)
        self.status = status
        self.url = url

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status in RETRYABLE_STATUSES or DEAD_STUB in str(self)

    def counted_from(self, start: int) -> EmbeddingError:
        """The error of a request that carried the caller's items from `start` on, its items
        named by their index in the caller's list."""
        if not start:
            return self
        message = _ITEM.sub(lambda m: f"'{m[1]}[{int(m[2]) + start}]'", str(self))
        return EmbeddingError(message, self.status, self.url)


@dataclass
class EmbeddingResult:
    embeddings: np.ndarray  # [n, dim]: float32, or the embedding type's int8/uint8 codes
    token_counts: np.ndarray  # int32 [n]: tokens embedded per text, <|endoftext|> included
    # Every type asked for ("float,int8" asks for two), from one computation of the vectors;
    # `embeddings` is the first of them.
    by_type: dict[str, np.ndarray] = field(default_factory=dict)
    # int32 [n]: tokens per text before truncation (more than token_counts where it was cut)
    input_tokens: np.ndarray | None = None

    @property
    def total_tokens(self) -> int:
        return int(self.token_counts.sum())

    @property
    def truncated(self) -> np.ndarray:
        """bool [n]: whether each text was cut to fit the model's tokens per text."""
        if self.input_tokens is None:
            return np.zeros(len(self.token_counts), dtype=bool)
        return self.input_tokens > self.token_counts


@dataclass
class ChunkedEmbedding:
    """Late chunking: one text's chunk vectors and where each chunk lies in the text."""

    embeddings: np.ndarray  # float32 [chunks, dim]
    spans: np.ndarray  # int32 [chunks, 2]: each chunk's characters [start, end) in the text
    token_count: int  # tokens of the text, <|endoftext|> included


@dataclass
class Classification:
    """A sequence classifier's answer: logits per text and the labels they belong to."""

    logits: np.ndarray  # float32 [n, labels]
    labels: list[str]  # the checkpoint's id2label, in column order
    token_counts: np.ndarray  # int32 [n]

    @property
    def probabilities(self) -> np.ndarray:
        """Softmax over the labels (sigmoid for a one-label classifier), float64 [n, labels]."""
        logits = self.logits.astype(np.float64)
        if logits.shape[1] == 1:
            return 1.0 / (1.0 + np.exp(-logits))
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)


@dataclass
class RerankResult:
    scores: np.ndarray  # float32 [n]: relevance in [0, 1], in document order
    token_counts: np.ndarray  # int32 [n]: tokens per templated (query, document) pair
    top_n: int | None = None

    @property
    def ranking(self) -> list[tuple[int, float]]:
        """(document index, score), best first; the top_n best when top_n was given."""
        order = np.argsort(-self.scores, kind="stable")[: self.top_n]
        return [(int(i), float(self.scores[i])) for i in order]

    @property
    def total_tokens(self) -> int:
        return int(self.token_counts.sum())


@dataclass
class _Server:
    url: str
    client: object
    state: ServerState = field(default_factory=ServerState)


class AsyncEmbeddingClient:
    """`await client.embed(texts, ...)` against one or several Triton servers.

    Lists larger than one request are split and sent concurrently; with several URLs the
    chunks go to whichever server is free, sized to its measured throughput.
    """

    def __init__(
        self,
        url: str | list[str],
        *,
        protocol: str = "grpc",
        timeout: float = 120.0,
        model: str = "embed",
        rerank_model: str = "rerank",
        max_texts_per_request: int = MAX_TEXTS_PER_REQUEST,
        requests_in_flight: int = 4,
        retry_deadline_s: float = 60.0,
        backoff_s: float = 0.25,
        bench_s: float = 30.0,
    ):
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
        self.urls = [url] if isinstance(url, str) else list(url)
        if not self.urls:
            raise ValueError("at least one server URL is needed")
        self.protocol = protocol
        self._module = importlib.import_module(f"tritonclient.{protocol}.aio")
        self.timeout = timeout
        self.model = model
        self.rerank_model = rerank_model
        self.max_texts_per_request = max_texts_per_request
        self.requests_in_flight = requests_in_flight
        self.retry_deadline_s = retry_deadline_s
        self.backoff_s = backoff_s
        self.bench_s = bench_s
        self._servers: list[_Server] | None = None
        self._facts: dict[str, tuple[float, dict]] = {}  # model -> (when read, served_facts)

    def _connect(self) -> list[_Server]:
        # Created lazily, inside the loop that will use them (aio clients bind to it).
        if self._servers is None:
            self._servers = [_Server(u, self._make_client(u)) for u in self.urls]
        return self._servers

    def _make_client(self, url: str):
        kwargs = {"conn_timeout": self.timeout} if self.protocol == "http" else {}
        return self._module.InferenceServerClient(url.split("://", 1)[-1], **kwargs)

    async def embed(self, texts: list[str], **options) -> np.ndarray:
        return (await self.embed_with_usage(texts, **options)).embeddings

    async def embed_with_usage(
        self,
        texts: list[str],
        *,
        priority: str | int | None = None,
        headers: dict[str, str] | None = None,
        images: list[list[bytes]] | None = None,
        videos: list[list[bytes | list[bytes]]] | None = None,
        **options,
    ) -> EmbeddingResult:
        """`priority`: "interactive" (the server's default) or "bulk" (served after every
        waiting interactive request); `headers` go with every Triton request (e.g. a W3C
        `traceparent`); `images` and `videos` (a multimodal model): per text, its image files
        (PNG, JPEG, ...) and videos, each a file (MP4, WebM, ...) or the list of its frames'
        image files (the text may then be ""); the other options are the server's request
        parameters. With `token_ids=True`, `texts` are lists of the model's own token ids."""
        texts = listed(texts, "texts", options.get("token_ids", False))
        opts = EmbedOptions(**options)
        level = priority_level(priority)
        media = _media_per_text(len(texts), images, videos)

        def send(server, a, b):
            batch = {k: v[a:b] for k, v in media.items() if v is not None}
            return self._send(server, texts[a:b], opts, level, headers, batch)

        chunks = await self._split(len(texts), send)
        kinds = opts.embedding_type.split(",")  # as asked: the first is `embeddings`
        by_type = {k: np.concatenate([c[0][k] for c in chunks]) for k in kinds}
        return EmbeddingResult(
            embeddings=by_type[kinds[0]],
            token_counts=np.concatenate([c[1] for c in chunks]),
            by_type=by_type,
            input_tokens=np.concatenate([c[2] for c in chunks]),
        )

    async def tokenize(
        self, texts: list[str], *, headers: dict[str, str] | None = None, **options
    ) -> list[list[dict]]:
        """Each text's tokens as the model receives them (prompt and special tokens included):
        dicts of id, text, special, and start/stop, the token's UTF-8 byte offsets in the
        prompted text (None for special tokens). Options as `embed`'s."""
        texts = listed(texts, "texts", options.get("token_ids", False))
        result = await self._tokenizer_call(texts, EmbedOptions(**options), "TOKENS", headers)
        return [json.loads(item) for item in result.reshape(-1)]

    async def count_tokens(
        self, texts: list[str], *, headers: dict[str, str] | None = None, **options
    ) -> np.ndarray:
        """Each text's token count as the model would receive it (prompt and special tokens
        included, after truncation), int [n]: the tokenizer step alone, no forward. Options
        as `embed`'s."""
        texts = listed(texts, "texts", options.get("token_ids", False))
        opts = EmbedOptions(**options)
        return (await self._tokenizer_call(texts, opts, "TOKEN_COUNT", headers)).reshape(-1)

    async def decode(self, id_lists: list[list[int]], skip_special_tokens: bool = True) -> list:
        """Each list of the model's token ids as text."""
        opts = EmbedOptions(token_ids=True, truncate=False)
        result = await self._tokenizer_call(list(id_lists), opts, "DECODED")
        return [row[0 if skip_special_tokens else 1].decode() for row in result]

    async def _tokenizer_call(
        self, items: list, opts: EmbedOptions, output: str, headers=None
    ) -> np.ndarray:
        """The served model's tokenizer step, called directly for one of its views, the items
        split over requests and servers as `embed`'s texts (one request takes at most
        max_texts_per_request)."""
        if not items:
            raise ValueError("nothing to tokenize")
        tokenizer, _ = ensemble_steps(self.model)
        requested = [self._module.InferRequestedOutput(output)]

        async def send(server, start, end):
            inp = self._text_input(items[start:end], opts)
            result = await self._infer(
                server, tokenizer, [inp], opts.parameters(), headers=headers, outputs=requested
            )
            return result.as_numpy(output)

        return np.concatenate(await self._split(len(items), send))

    async def served_facts(self, model: str | None = None) -> dict:
        """An ensemble's facts (default the embed model's): its tokenizer's and encoder's
        (contract.FACTS), with `fingerprint` the whole model's (contract.model_fingerprint;
        None if unpublished) and `adapter_fingerprints` the whole model's with each adapter.
        Two config reads, remembered for FACTS_TTL_S once both steps answered."""
        model = model or self.model
        now = time.monotonic()
        held = self._facts.get(model)
        if held is not None and now - held[0] <= FACTS_TTL_S:
            return held[1]
        tokenizer, encoder = [await self.model_facts(m) for m in ensemble_steps(model)]
        facts = {**encoder, **tokenizer, "fingerprint": model_fingerprint(tokenizer, encoder)}
        if "adapter_fingerprints" in encoder:
            facts["adapter_fingerprints"] = {
                name: model_fingerprint(tokenizer, encoder, name)
                for name in encoder["adapter_fingerprints"]
            }
        if tokenizer and encoder:
            self._facts[model] = (now, facts)
        return facts

    async def score_kind(self) -> str:
        """What the rerank model's scores are (its encoder's `scores` fact): "probability",
        P(relevant) in [0, 1], "logit" (a CrossEncoder's raw score, as its `predict` gives
        it) or "cosine" (a listwise reranker's or an embedder's rerank_recipe's, in
        [-1, 1])."""
        facts = await self.served_facts(self.rerank_model)
        return "cosine" if "reranks_by" in facts else facts.get("scores", "probability")

    async def model_fingerprint(self) -> str | None:
        return (await self.served_facts())["fingerprint"]

    async def embed_chunks(
        self,
        texts: list[str],
        *,
        chunk_size: int | None = None,
        spans: list[tuple[int, int]] | None = None,
        char_spans: list[tuple[int, int]] | None = None,
        priority: str | int | None = None,
        headers: dict[str, str] | None = None,
        **options,
    ) -> list[ChunkedEmbedding]:
        """Late chunking: for each text, one vector per chunk, every chunk computed in the
        context of its whole text (docs/api.md). Chunks of `chunk_size` tokens, `spans`:
        [start, end) over the text's own tokens (after any prompt), or `char_spans` over its
        characters (a chunk: the tokens that begin in it), the same for every text.
        Other options as `embed` (embedding_type stays float)."""
        texts = listed(texts, "texts", options.get("token_ids", False))
        if [chunk_size, spans, char_spans].count(None) != 2:
            raise ValueError("give chunk_size, spans or char_spans (one of them)")
        params = EmbedOptions(
            **options, chunk_size=chunk_size, chunk_spans=spans, chunk_chars=char_spans
        ).parameters()
        return await self._chunked(texts, params, priority, headers)

    async def embed_contextual(
        self,
        documents: list[list[str]],
        *,
        priority: str | int | None = None,
        headers: dict[str, str] | None = None,
        **options,
    ) -> list[ChunkedEmbedding]:
        """Contextual chunk embeddings (pplx-embed-context's): for each document, given as its
        chunks in order, one vector per chunk, each computed in the context of the document's
        other chunks: the chunks joined by the model's separator (a contextual checkpoint's
        sep_token) and late-chunked between the separators (docs/api.md). A result's spans are each
        chunk's characters in the joined text. Other options as `embed` (embedding_type stays
        float)."""
        separator = (await self.served_facts()).get("chunk_separator")
        if separator is None:
            raise EmbeddingError(
                f"model '{self.model}' has no chunk separator (a contextual checkpoint's "
                "sep_token, as pplx-embed-context's): late-chunk its documents with "
                "embed_chunks(char_spans=...)"
            )
        texts = joined_documents(documents, separator)
        params = EmbedOptions(**options, chunk_by_separator=True).parameters()
        return await self._chunked(texts, params, priority, headers)

    async def _chunked(self, texts, params, priority, headers) -> list[ChunkedEmbedding]:
        """Each text's chunk vectors, its requests split over the servers by `_split`."""
        level = priority_level(priority)
        parts = await self._split(
            len(texts),
            halving(lambda s, a, b: self._send_chunks(s, texts[a:b], params, level, headers)),
        )
        return [text for part in parts for text in part]

    async def embed_tokens(
        self,
        texts: list[str],
        *,
        priority: str | int | None = None,
        headers: dict[str, str] | None = None,
        images: list[list[bytes]] | None = None,
        videos: list[list[bytes | list[bytes]]] | None = None,
        **options,
    ) -> list[np.ndarray]:
        """One vector per token of each text, float32 [tokens, dim]: the model's final hidden
        states (prompt and special tokens included, before pooling; a multi-vector
        retriever's, ColQwen3's, through its projection), for late interaction (`maxsim`) or
        a pooling of your own; `normalize` and `dimensions` apply per token. `images` and
        `videos` (a multimodal model) and the other options as `embed` (embedding_type
        stays float)."""
        texts = listed(texts, "texts", options.get("token_ids", False))
        opts = EmbedOptions(**{**options, "per_token": True})
        level = priority_level(priority)
        media = _media_per_text(len(texts), images, videos)

        async def send(server, start, end):
            batch = {k: v[start:end] for k, v in media.items() if v is not None}
            vectors, _, _, rows = await self._send(
                server, texts[start:end], opts, level, headers, batch
            )
            return [vectors["float"][i, :n] for i, n in enumerate(rows)]

        parts = await self._split(len(texts), halving(send))
        return [text for part in parts for text in part]

    async def classify(
        self,
        texts: list[str],
        *,
        priority: str | int | None = None,
        headers: dict[str, str] | None = None,
        **options,
    ) -> Classification:
        """A sequence-classification checkpoint served as the embed model: each text's logits
        and the labels (the encoder's `labels` fact). Options as `embed`'s (truncation,
        prompts; the vector options do not apply)."""
        texts = listed(texts, "texts", options.get("token_ids", False))
        opts = EmbedOptions(**options)
        level = priority_level(priority)
        labels = (await self.served_facts()).get("labels")
        if not labels:  # not the server's failure: nothing to retry
            raise ValueError(f"model {self.model!r} is not a sequence classifier (no labels)")

        async def send(server, start, end):
            inp = self._text_input(texts[start:end], opts)
            params = opts.parameters()
            result = await self._infer(server, self.model, [inp], params, level, headers)
            return result.as_numpy("LOGITS"), result.as_numpy("TOKEN_COUNT").reshape(-1)

        parts = await self._split(len(texts), send)
        return Classification(
            logits=np.concatenate([p[0] for p in parts]),
            labels=list(labels),
            token_counts=np.concatenate([p[1] for p in parts]),
        )

    async def rerank(
        self,
        query: str,
        documents: list[str],
        *,
        top_n: int | None = None,
        instruction: str | None = None,
        truncate: bool = True,
        max_document_tokens: int | None = None,
        priority: str | int | None = None,
        headers: dict[str, str] | None = None,
        query_images: list[bytes] | None = None,
        document_images: list[list[bytes]] | None = None,
        query_videos: list[bytes | list[bytes]] | None = None,
        document_videos: list[list[bytes | list[bytes]]] | None = None,
        video_fps: float | None = None,
        video_max_frames: int | None = None,
        adapter: str | None = None,
    ) -> RerankResult:
        """Score each document against the query (the `rerank` ensemble); the documents are
        split over requests and servers like `embed`'s texts, a listwise reranker's (its
        `score_kind` "cosine") in requests of max_texts_per_request documents, whose scores
        it merges. A multimodal reranker takes
        the query's image and video files (`query_images`, `query_videos`) and each
        document's (`document_images`, `document_videos`: a list per document); a text with
        images or videos may be "". `video_fps` and `video_max_frames`: how many frames of
        each video are kept (default 1 per second, at most 64). `adapter`: a LoRA adapter the
        reranker keeps (its encoder's lora_modules)."""
        documents = listed(documents, "documents")
        text_checked(query, "query")
        per_document = {"DOCUMENT_IMAGES": document_images, "DOCUMENT_VIDEOS": document_videos}
        for name, files in per_document.items():
            if files is not None and len(files) != len(documents):
                raise ValueError(
                    f"{name.lower()} must hold a list per document ({len(documents)}), "
                    f"got {len(files)}"
                )
        query_media = {"QUERY_IMAGES": query_images, "QUERY_VIDEOS": query_videos}
        at_least_one("top_n", top_n)
        opts = RerankOptions(
            truncate,
            **({"instruction": instruction} if instruction else {}),
            max_document_tokens=max_document_tokens,
            video_fps=video_fps,
            video_max_frames=video_max_frames,
            adapter=adapter,
        )
        params = opts.parameters()
        level = priority_level(priority)
        facts = await self.served_facts(self.rerank_model)
        if facts.get("reranks_by") == pseudo_query.RECIPE:
            given = {**per_document, **query_media, "max_document_tokens": max_document_tokens}
            if unread := [k.lower() for k, v in given.items() if v is not None]:
                raise EmbeddingError(  # as the server refuses what a reranker does not read
                    f"E2Rank's reranking reads the query's and documents' text alone: {unread} "
                    "not taken",
                    "StatusCode.INVALID_ARGUMENT",
                )
            opts = EmbedOptions(truncate=truncate, truncation_direction="right", adapter=adapter)
            return await self._rerank_by_pseudo_query(
                query, documents, instruction, opts, top_n, level, headers
            )
        listwise = facts.get("scores") == "cosine"  # score_kind, its facts read above
        chunks = await self._split(
            len(documents),
            lambda s, a, b: self._send_pairs(
                s,
                query,
                documents[a:b],
                params,
                level,
                headers,
                query_media | {k: v[a:b] for k, v in per_document.items() if v is not None},
            ),
            whole=listwise,
        )
        return RerankResult(
            scores=np.concatenate([c[0] for c in chunks]),
            token_counts=np.concatenate([c[1] for c in chunks]),
            top_n=top_n,
        )

    async def _rerank_by_pseudo_query(
        self, query, documents, instruction, opts, top_n, level, headers
    ) -> RerankResult:
        """E2Rank's reranking (pseudo_query.py) on the rerank model, an embedder: the pseudo
        query and the documents embedded as texts, their cosines the scores; the pseudo query's
        tokens are counted on the first document."""
        ended = pseudo_query.ended(documents)
        texts = [pseudo_query.pseudo_query(query, ended, instruction), *ended]

        def send(server, a, b):
            return self._send(server, texts[a:b], opts, level, headers, model=self.rerank_model)

        try:
            chunks = await self._split(len(texts), send)
        except EmbeddingError as e:  # the texts' indices as the caller's documents'
            raise EmbeddingError(_pseudo_named(str(e)), e.status, e.url) from None
        vectors = np.concatenate([c[0]["float"] for c in chunks])
        counts = np.concatenate([c[1] for c in chunks])
        counts[1] += counts[0]
        return RerankResult(
            scores=pseudo_query.scores(vectors[0], vectors[1:]),
            token_counts=counts[1:],
            top_n=top_n,
        )

    async def _split(self, count: int, send, whole: bool = False) -> list:
        """`send(server, start, end)` for chunks of `count` items over the servers, retried:
        on one server until `retry_deadline_s`; with several, for at most FAILOVER_S before
        the scheduler moves the chunk to another server. `whole`: chunks of
        max_texts_per_request items."""
        servers = self._connect()
        window = (
            self.retry_deadline_s if len(servers) == 1 else min(self.retry_deadline_s, FAILOVER_S)
        )

        async def chunk(index: int, start: int, end: int):
            try:
                return await self._with_retries(lambda: send(servers[index], start, end), window)
            except EmbeddingError as e:  # named by the caller's indices, not the chunk's
                raise e.counted_from(start) from None

        return await run_job(
            count,
            [s.state for s in servers],
            send=chunk,
            max_chunk=self.max_texts_per_request,
            slots_per_server=self.requests_in_flight,
            bench_s=self.bench_s,
            whole=whole,
        )

    async def _with_retries(self, call, window_s: float):
        """`call()`, sent again after a retryable failure (backoff from `backoff_s`, doubling
        up to MAX_BACKOFF_S, jittered) until `window_s` after the first try."""
        until = time.monotonic() + window_s
        caller = _DEADLINE.get()
        until = until if caller is None else min(until, caller)
        wait = self.backoff_s
        while True:
            try:
                return await call()
            except EmbeddingError as e:
                pause = wait * (0.5 + random.random())
                if not e.retryable or time.monotonic() + pause > until:
                    raise
            await asyncio.sleep(pause)
            wait = min(2 * wait, MAX_BACKOFF_S)

    def _bytes_input(self, name: str, texts: list[str], shape: list[int]):
        data = np.array([t.encode("utf-8") for t in texts], dtype=np.object_).reshape(shape)
        inp = self._module.InferInput(name, shape, "BYTES")
        inp.set_data_from_numpy(data)
        return inp

    def _text_input(self, texts: list, opts: EmbedOptions):
        """TEXT [n, 1]: the texts, or with token_ids their ids packed as int32."""
        if not opts.token_ids:
            return self._bytes_input("TEXT", texts, [len(texts), 1])
        data = np.array([[pack_ids(ids)] for ids in texts], dtype=np.object_)
        inp = self._module.InferInput("TEXT", [len(texts), 1], "BYTES")
        inp.set_data_from_numpy(data)
        return inp

    async def _send(
        self,
        server: _Server,
        texts: list,
        opts: EmbedOptions,
        priority,
        headers,
        media=None,
        model: str | None = None,
    ):
        """(vectors by type, TOKEN_COUNT, INPUT_TOKENS, per_token's vectors per text);
        `media`: IMAGES and VIDEOS, per text its files; `model`: an embed ensemble other than
        this client's (an embedder reranking: `rerank_model`)."""
        inputs = [self._text_input(texts, opts)]
        for name, files in (media or {}).items():
            if any(files):
                inputs.append(self._images_input(name, files, [len(texts), 1]))
        params = opts.parameters()
        result = await self._infer(server, model or self.model, inputs, params, priority, headers)
        vectors = {kind: result.as_numpy(name) for kind, name in opts.outputs.items()}
        counts = result.as_numpy("TOKEN_COUNT").reshape(-1)
        before = result.as_numpy("INPUT_TOKENS")  # absent from a server without it
        # per_token: each text's vectors, fewer than its tokens where a MultiVectorEncoder's
        # skiplist leaves some out (absent from a server without it: one per token)
        rows = result.as_numpy("TOKEN_ROWS") if opts.per_token else None
        rows = counts if rows is None else rows.reshape(-1)
        return vectors, counts, counts if before is None else before.reshape(-1), rows

    def _images_input(self, name: str, images: list[list], shape: list[int]):
        """Per element, its image (or video) files packed into one BYTES element
        (contract.pack_images); a video given as a list of frame files goes as one entry
        (contract.pack_frames)."""
        data = np.array(
            [
                pack_images([pack_frames(f) if isinstance(f, (list, tuple)) else f for f in files])
                for files in images
            ],
            dtype=np.object_,
        )
        inp = self._module.InferInput(name, shape, "BYTES")
        inp.set_data_from_numpy(data.reshape(shape))
        return inp

    async def _send_chunks(self, server: _Server, texts: list[str], params, priority, headers):
        inp = self._bytes_input("TEXT", texts, [len(texts), 1])
        result = await self._infer(server, self.model, [inp], params, priority, headers)
        vectors, spans = result.as_numpy("CHUNK_EMBEDDING"), result.as_numpy("CHUNK_SPANS")
        counts = result.as_numpy("TOKEN_COUNT").reshape(-1)
        out = []
        for i in range(len(texts)):  # padded to the request's most chunks: -1 spans
            k = int((spans[i, :, 0] >= 0).sum())
            out.append(ChunkedEmbedding(vectors[i, :k], spans[i, :k], int(counts[i])))
        return out

    async def _send_pairs(
        self,
        server: _Server,
        query,
        documents,
        params,
        priority,
        headers,
        media=None,
    ):
        """`media`: QUERY_IMAGES and QUERY_VIDEOS (the query's files), DOCUMENT_IMAGES and
        DOCUMENT_VIDEOS (per document, its files)."""
        inputs = [
            self._bytes_input("QUERY", [query], [1]),
            self._bytes_input("DOCUMENTS", documents, [len(documents), 1]),
        ]
        for name, files in (media or {}).items():
            if name.startswith("QUERY") and files:
                inputs.append(self._images_input(name, [files], [1]))
            elif name.startswith("DOCUMENT") and files is not None and any(files):
                inputs.append(self._images_input(name, files, [len(documents), 1]))
        result = await self._infer(server, self.rerank_model, inputs, params, priority, headers)
        return result.as_numpy("SCORES").reshape(-1), result.as_numpy("TOKEN_COUNT").reshape(-1)

    async def _infer(
        self, server: _Server, model, inputs, params, priority=0, headers=None, outputs=None
    ):
        wait = self._wait_s()
        if wait <= 0:  # the caller's deadline passed during retries or earlier chunks
            raise EmbeddingError("no time left before the caller's deadline", DEADLINE_PASSED)
        check = _GUARD.get()
        if check is not None:
            priority = check(model, priority)
        kwargs = {"client_timeout": wait} if self.protocol == "grpc" else {}
        usage = _USAGE.get() if outputs is None else None  # an ensemble's whole answer
        if usage is not None:
            usage.setdefault(model, 0)
        try:
            result = await asyncio.wait_for(
                server.client.infer(
                    model,
                    inputs,
                    outputs=outputs,
                    parameters=params,
                    priority=priority,
                    headers=headers,
                    # Triton's request timeout (us): the encoder's queue drops the request
                    # once it has waited there as long as this client waits for the answer.
                    timeout=int(wait * 1e6),
                    **kwargs,
                ),
                timeout=wait,
            )
        except InferenceServerException as e:
            raise EmbeddingError(e.message() or str(e), str(e.status()), server.url) from None
        except asyncio.TimeoutError:
            message = f"{server.url}: not answered within {wait:.3g} s"
            raise EmbeddingError(message, None, server.url) from None
        except OSError as e:
            raise EmbeddingError(f"{server.url}: {type(e).__name__}: {e}", None, server.url) from e
        except Exception as e:  # aiohttp/grpc transport errors that are not OSError
            if type(e).__module__.split(".")[0] in ("aiohttp", "grpc"):
                raise EmbeddingError(f"{server.url}: {e}", None, server.url) from e
            raise
        counts = result.as_numpy("TOKEN_COUNT") if usage is not None else None
        if counts is not None:
            usage[model] += int(counts.sum())
        return result

    def _wait_s(self) -> float:
        """How long the next request may take: `timeout`, or less within deadline()."""
        caller = _DEADLINE.get()
        return self.timeout if caller is None else min(self.timeout, caller - time.monotonic())

    async def model_ready(self, model: str) -> bool:
        """Whether any of the servers has `model` loaded and ready."""
        for server in self._connect():
            try:
                if await server.client.is_model_ready(model):
                    return True
            except Exception:  # unreachable or unknown: not ready there
                continue
        return False

    async def model_facts(self, model: str) -> dict:
        """What `model` publishes about itself in its config (contract.FACTS), from the first
        server that answers; {} where none does."""
        for server in self._connect():
            try:
                kwargs = {"as_json": True} if self.protocol == "grpc" else {}
                config = await server.client.get_model_config(model, **kwargs)
            except Exception:  # unreachable or unknown: ask the next one
                continue
            return read_facts(config.get("config", config))
        return {}

    async def close(self) -> None:
        for server in self._servers or []:
            await server.client.close()
        self._servers = None

    async def __aenter__(self) -> AsyncEmbeddingClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def stats(self) -> dict[str, dict]:
        """Per server: measured texts/s per request in flight (remembered across calls; 0 = not
        measured yet), texts embedded so far, and whether it is benched after a failure."""
        return {
            s.url: {
                "texts_per_s": s.state.texts_per_s,
                "texts_done": s.state.texts_done,
                "benched": s.state.benched(),
            }
            for s in self._servers or []
        }


class EmbeddingClient:
    """Blocking twin of AsyncEmbeddingClient (same arguments)."""

    def __init__(self, url: str | list[str], **kwargs):
        self._async = AsyncEmbeddingClient(url, **kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="qwen-embed-client"
        )
        self._thread.start()

    def _run(self, coro):
        caller = _DEADLINE.get(), _USAGE.get(), _GUARD.get()

        async def in_callers_context():  # the loop's thread has a context of its own
            _DEADLINE.set(caller[0])
            _USAGE.set(caller[1])
            _GUARD.set(caller[2])
            return await coro

        future = asyncio.run_coroutine_threadsafe(in_callers_context(), self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: cancel the in-flight requests too
            raise

    def embed(self, texts: list[str], **options) -> np.ndarray:
        return self._run(self._async.embed(texts, **options))

    def embed_with_usage(self, texts: list[str], **options) -> EmbeddingResult:
        return self._run(self._async.embed_with_usage(texts, **options))

    def embed_chunks(self, texts: list[str], **options) -> list[ChunkedEmbedding]:
        return self._run(self._async.embed_chunks(texts, **options))

    def embed_contextual(self, documents: list[list[str]], **options) -> list[ChunkedEmbedding]:
        return self._run(self._async.embed_contextual(documents, **options))

    def embed_tokens(self, texts: list[str], **options) -> list[np.ndarray]:
        return self._run(self._async.embed_tokens(texts, **options))

    def classify(self, texts: list[str], **options) -> Classification:
        return self._run(self._async.classify(texts, **options))

    def rerank(self, query: str, documents: list[str], **options) -> RerankResult:
        return self._run(self._async.rerank(query, documents, **options))

    def tokenize(self, texts: list[str], **options) -> list[list[dict]]:
        return self._run(self._async.tokenize(texts, **options))

    def count_tokens(self, texts: list[str], **options) -> np.ndarray:
        return self._run(self._async.count_tokens(texts, **options))

    def decode(self, id_lists: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return self._run(self._async.decode(id_lists, skip_special_tokens))

    def model_fingerprint(self) -> str | None:
        return self._run(self._async.model_fingerprint())

    def score_kind(self) -> str:
        return self._run(self._async.score_kind())

    def stats(self) -> dict[str, dict]:
        return self._async.stats()

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._async.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def __enter__(self) -> EmbeddingClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
