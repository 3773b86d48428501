"""The OpenAI API: POST /v1/embeddings (texts, or the model's own token ids), GET /v1/models,
and the Jina/Cohere v1 rerank shape on POST /v1/rerank (also /rerank, shared with TEI's).

Extension fields (the OpenAI SDK keeps unknown fields, pydantic `extra="allow"`): each data
item's `tokens`, `input_tokens` and `truncated`; in the request, `embedding_type` /
`embedding_types`, `priority`, `chunks` and the contract's EXTENSION_OPTIONS (docs/api.md).
NVIDIA NIM's fields, which its clients send to /v1/embeddings: `input_type` ("query" or
"passage") picks the checkpoint's query or document prompt (common.prompt_options), and
`truncate` may be one of NIM's modes ("NONE", "START", "END": common.TRUNCATE_MODES). vLLM's:
`truncate_prompt_tokens` (-1: the model's limit) is `max_tokens`, `truncation_side` is
`truncation_direction`, `use_activation` is `normalize`; `embed_dtype` and `endianness` shape a
base64 vector's bytes (common.Encoding); `add_special_tokens` false (for texts) and `padding`
"max_length" are refused, not ignored. Jina's: `task`, `normalized`, `late_chunking`,
`embedding_type` "base64" (jina.py) and `return_multivector` (a vector per token of each input,
`data[i].embeddings`, as its v4 API answers). Voyage AI's (its `voyageai` SDK posts them):
`input_type` "document" (beside NIM's "passage"), `truncation` (`truncate`), `output_dimension`
(`dimensions`) and `output_dtype` (`embedding_type`); on /v1/rerank its `top_k` (`top_n`) and
`truncation`, and a body with either is answered in Voyage's shape (`voyage_ranking`); its
multimodal route and its form of the contextualized one are voyage.py's. Infinity's: `modality`
"image" (each input an image's URL) and its URL, POST /embeddings; its rerank bodies are
Cohere's with `raw_scores` (`use_activation` false), answered in the Cohere shape that vLLM's
clients read on /rerank too.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..client import EmbeddingError
from ..contract import EMBEDDING_TYPES, MAX_DOCUMENTS, EmbedOptions, priority_level
from ..maxsim import maxsim_scores
from . import gemini, keys
from .bodies import (
    Body,
    NonBlank,
    Text,
    TokenIds,
    at_most,
    batch,
    contract_options,
    described,
    distinct,
    one_of,
    token_ids,
)
from .common import (
    EMBED_DTYPES,
    PERPLEXITY_FORMATS,
    TRUNCATE_MODES,
    Encoding,
    check_model,
    checkpoint_facts,
    embed,
    embed_tokens,
    late_interaction_prompts,
    model_adapters,
    multi_vector_data,
    prompt_options,
    raw_scores,
    served_names,
    text_usage,
)
from .errors import (
    BACKEND,
    NOT_FOUND,
    OVERLOADED,
    RATE_LIMITED,
    STATUS,
    UNAUTHORIZED,
    UNAVAILABLE,
    APIError,
    backend_error,
    in_body_words,
    invalid,
    named_as_sent,
    options_checked,
    rerank_checked,
)
from .jina import (
    TASK_INSTRUCTIONS_BY_TASK,
    checked_task,
    is_passage_task,
    late_chunk_embeddings,
    task_options,
)
from .media import (
    MEDIA_PARTS,
    JinaParts,
    Message,
    Parts,
    QwenParts,
    ScriptInput,
    TextPart,
    has_parts,
    texts_and_media,
)
from .state import answered_adapter, respond, respond_bytes, routed

# Request options of the contract taken as extension fields of the body (docs/api.md).
EXTENSION_OPTIONS = (
    "prompt_name",
    "instruction",
    "prompt",
    "normalize",
    "truncate",
    "truncation_direction",
    "max_tokens",
    "video_fps",
    "video_max_frames",
)

# NIM's `input_type`: its "passage" takes the checkpoint's document prompt (and "query", by
# name, the query prompt, as Voyage's "document" the document prompt).
INPUT_TYPE_PROMPTS = {"passage": "document"}
PASSAGES = ("passage", "document")  # the input types of what a query is matched against

# Fields by which other servers name one option: at most one of each group is sent (the
# contract's name first).
TWINS = (
    ("max_tokens", "truncate_prompt_tokens"),  # vLLM's
    ("truncation_direction", "truncation_side"),  # vLLM's
    ("normalize", "use_activation", "normalized"),  # vLLM's, Jina's
    ("input_type", "task"),  # NIM's, Jina's
    ("embedding_type", "encoding_type", "output_dtype"),  # Jina's (either), Voyage's
    ("dimensions", "output_dimension"),  # Voyage's
    ("truncate", "truncation"),  # Voyage's
)
# Voyage's names of the contract's options, as its refusals name them
VOYAGE_FIELDS = {"dimensions": "output_dimension", "truncate": "truncation"}
VOYAGE_RERANK_FIELDS = {"top_n": "top_k", "truncate": "truncation"}

# `encoding_format`: OpenAI's, a compact type's name (as vLLM and NIM take it), vLLM's binary
# formats: the vectors' bytes as the response's body, their layout in its `metadata` header
# ("bytes") or nowhere ("bytes_only": the client knows it), or Perplexity's (unnormalised
# vectors, unless the body asks otherwise).
BINARY_FORMATS = ("bytes", "bytes_only")
VECTOR_FORMATS = ("float", "base64", *BINARY_FORMATS, *PERPLEXITY_FORMATS)
ENCODINGS = ("float", "base64", *EMBEDDING_TYPES, *BINARY_FORMATS, *PERPLEXITY_FORMATS)
MediaInputs = Annotated[
    described(
        Text | list[Text] | TokenIds | list[TokenIds] | list[Text | Parts | QwenParts | JinaParts],
        "must be a string, a list of strings, the model's token ids (a list of integers), a "
        "list of such lists (not a mix of texts and ids), or a list of inputs each a string, "
        'a list of content parts ({"type": "text", ...}, {"type": "image_url", ...}), an '
        'object as Qwen3-VL-Embedding\'s scripts take one ({"text", "image", "video"}) or '
        'an image as Jina\'s {"url"} or {"bytes"}',
    ),
    AfterValidator(batch),
]

router = APIRouter(tags=["openai"])

_CODES = {
    NOT_FOUND: "model_not_found",
    UNAUTHORIZED: "invalid_api_key",
    RATE_LIMITED: "rate_limit_exceeded",
}


# The contract's options that the body holds otherwise (late chunking's `chunks`).
_FIELDS = {"chunk_size": "chunks.size", "chunk_spans": "chunks.spans"}


def error_response(e: APIError) -> JSONResponse:
    server = e.kind in (OVERLOADED, UNAVAILABLE, BACKEND)
    body = {
        "message": in_body_words(e.message, _FIELDS),
        "type": "server_error" if server else "invalid_request_error",
        "param": e.param,
        "code": _CODES.get(e.kind),
    }
    # `detail`: the message where Voyage AI's SDK reads one (its API's error shape)
    return JSONResponse({"error": body, "detail": body["message"]}, status_code=STATUS[e.kind])


def _priority(value: str | int | None) -> str | int | None:
    """`priority`: "interactive" (default) or "bulk" (Triton's levels 1 and 2; vLLM's
    integer form is accepted as those levels)."""
    try:
        priority_level(value)
    except ValueError as e:
        raise PydanticCustomError("priority", e.args[0].removeprefix("priority ")) from None
    return value


Priority = Annotated[str | int | None, AfterValidator(_priority)]


class ChunkSize(Body):
    model_config = ConfigDict(extra="forbid")
    size: int


class ChunkSpans(Body):
    model_config = ConfigDict(extra="forbid")
    spans: list[list[int]]


# vLLM's pooling-request fields refused, and why
_RECIPE = "the checkpoint's own recipe forms its inputs"
_NOT_SERVED = {
    "cache_salt": "this server's prefix cache is shared by every client (its operator can keep "
    "no prefix between batches: prefix_cache_mb 0)",
    "chat_template": _RECIPE,
    "media_io_kwargs": "the server's image and video settings read the media (a video's frames "
    "per second: 'video_fps')",
}


class _VllmPoolingFields(Body):
    """Fields vLLM takes on every pooling request (embeddings, rerank), read rather than
    ignored: `mm_processor_kwargs`, the HF processor's arguments, whose `fps` is the request's
    `video_fps` (the others, pixel budgets, sizes and frame counts, are the server's image and
    video settings here, refused by name); `cache_salt`, which isolates a client's cached
    prefixes in vLLM, refused: this server's prefix cache is one for all clients (the
    encoder's `prefix_cache_mb` 0 keeps no prefix between batches); a `chat_template` of the
    client's, refused: the checkpoint's own recipe forms its inputs; `media_io_kwargs` (how
    vLLM loads a medium), refused: the server's image and video settings do."""

    mm_processor_kwargs: dict[str, object] | None = None
    cache_salt: str | None = None
    chat_template: str | None = None
    media_io_kwargs: dict[str, object] | None = None
    video_fps: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _vllm_pooling_fields(cls, body):
        if not isinstance(body, dict):  # the body's own check names it
            return body
        for name, why in _NOT_SERVED.items():
            if body.get(name) not in (None, {}):
                raise PydanticCustomError(
                    "vllm",
                    "'{name}' is not served: {why}",
                    {"param": name, "name": name, "why": why},
                )
        kwargs = body.get("mm_processor_kwargs")
        if not isinstance(kwargs, dict):  # absent, or not an object: its field says so
            return body
        kwargs = dict(kwargs)
        fps = kwargs.pop("fps", None)
        if kwargs:
            raise PydanticCustomError(
                "vllm",
                "'mm_processor_kwargs' takes 'fps' only (the video frames per second): {keys} "
                "are the server's image and video settings",
                {"param": "mm_processor_kwargs", "keys": sorted(kwargs)},
            )
        if fps is not None and body.get("video_fps") is not None:
            raise PydanticCustomError(
                "vllm",
                "send 'video_fps' or 'mm_processor_kwargs.fps', not both",
                {"param": "mm_processor_kwargs"},
            )
        return body if fps is None else body | {"video_fps": fps}


class _Embeddings(_VllmPoolingFields):
    """POST /v1/embeddings (and a Batch API line's body); EXTENSION_OPTIONS are added from
    the contract (EmbeddingsRequest)."""

    model: str | None = None
    # texts or token ids; for a multimodal model also inputs of content parts (media.py), or
    # vLLM's `messages` (one input, its system turn the instruction)
    input: MediaInputs | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=2)] | None = None
    # null is the default, as OpenAI takes it (LiteLLM sends null when none is set)
    encoding_format: Annotated[
        Literal[ENCODINGS], BeforeValidator(lambda v: "float" if v is None else v)
    ] = "float"
    embedding_type: Literal[(*EMBEDDING_TYPES, "base64")] | None = None  # base64: Jina's
    encoding_type: Literal[(*EMBEDDING_TYPES, "base64")] | None = None  # Jina's
    embedding_types: distinct(Literal[EMBEDDING_TYPES]) | None = None
    priority: Priority = None
    input_type: Literal[("query", *PASSAGES)] | None = None  # NIM's, Voyage's
    output_dtype: Literal[EMBEDDING_TYPES] | None = None  # Voyage's `embedding_type`
    output_dimension: int | None = None  # Voyage's `dimensions`
    truncation: bool | None = None  # Voyage's `truncate`
    truncate_prompt_tokens: int | None = None  # vLLM's
    truncation_side: Literal["left", "right"] | None = None  # vLLM's
    # vLLM's: a base64 float vector's type and byte order ("native": this host's); the
    # pooler's activation (false: vectors not normalized); special tokens; padding
    embed_dtype: Literal[tuple(EMBED_DTYPES)] = "float32"
    endianness: Literal["native", "big", "little"] = "native"
    use_activation: bool | None = None
    add_special_tokens: bool | None = None
    padding: Literal["max_length", "do_not_pad"] | None = None
    task: Annotated[str, AfterValidator(checked_task)] | None = None  # Jina's
    normalized: bool | None = None  # Jina's
    # vLLM's switches of its chat template for `messages` (refused where set: _RECIPE)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, object] | None = None
    late_chunking: bool = False  # Jina's: the inputs read as one text, a vector per input
    modality: Literal["text", "image"] | None = None  # Infinity's (_modality)
    return_multivector: bool = False  # Jina's (its v4 API): a vector per token of each input
    # late chunking: {"size": tokens} or {"spans": [[start, end], ...]} over each text's own
    # tokens (the contract checks their form, the server their ranges)
    chunks: (
        described(
            ChunkSize | ChunkSpans, 'must be {"size": tokens} or {"spans": [[start, end], ...]}'
        )
        | None
    ) = None

    @model_validator(mode="before")
    @classmethod
    def _modality(cls, body):
        """Infinity's `modality` "image": each input is an image's URL (a data URL, or a remote
        one where the operator allows them), read as an image content part, not as text;
        "audio" is refused by the field's type."""
        if not isinstance(body, dict) or body.get("modality") != "image":
            return body
        urls = body.get("input")
        urls = [urls] if isinstance(urls, str) else urls
        if not (isinstance(urls, list) and urls and all(isinstance(u, str) for u in urls)):
            raise PydanticCustomError(
                "modality",
                "'modality' 'image' reads 'input' as image URLs: a string or a list of strings",
                {"param": "input"},
            )
        return body | {"input": [[{"type": "image_url", "image_url": {"url": u}}] for u in urls]}

    @model_validator(mode="before")
    @classmethod
    def _truncate_mode(cls, body):
        """NIM's `truncate` modes as the contract's `truncate` and `truncation_direction`."""
        if not isinstance(body, dict) or not isinstance(body.get("truncate"), str):
            return body
        modes = ", ".join(map(repr, TRUNCATE_MODES))
        if body["truncate"] not in TRUNCATE_MODES:
            raise PydanticCustomError(
                "truncate",
                "'truncate' must be a boolean or one of {modes}",
                {"modes": modes, "param": "truncate"},
            )
        for side in ("truncation_direction", "truncation_side"):
            if body.get(side) is not None:
                raise PydanticCustomError(
                    "truncate",
                    "'truncate' as one of {modes} says the direction: send no '{param}' with it",
                    {"modes": modes, "param": side},
                )
        return {**body, "truncate": True, **TRUNCATE_MODES[body["truncate"]]}

    @model_validator(mode="after")
    def _one_input_field(self):
        one_of(self, "input", "messages")
        return self

    @model_validator(mode="after")
    def _other_servers_fields(self):
        """Other servers' fields that name the contract's (TWINS): not beside them; vLLM's
        that would change a vector in ways not served: refused."""
        for group in TWINS:
            given = [name for name in group if getattr(self, name) is not None]
            if len(given) > 1:
                raise PydanticCustomError(
                    "twins",
                    "send '{param}' or '{ours}', not both",
                    {"param": given[-1], "ours": given[0]},
                )
        for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
            if getattr(self, name):
                raise PydanticCustomError(
                    "vllm", "'{param}' is not served: {why}", {"param": name, "why": _RECIPE}
                )
        tokens = self.truncate_prompt_tokens
        if tokens is not None and tokens != -1 and tokens < 1:
            raise PydanticCustomError(
                "truncation",
                "'truncate_prompt_tokens' must be -1 (the model's limit) or >= 1, got {tokens}",
                {"param": "truncate_prompt_tokens", "tokens": tokens},
            )
        if self.padding == "max_length":
            raise PydanticCustomError(
                "padding",
                "'padding' 'max_length' pads a text to the model's limit, which a model read "
                "out at a text's last token does not take: send 'do_not_pad' or none",
                {"param": "padding"},
            )
        if self.add_special_tokens is False and self.input and not token_ids(self.input):
            raise PydanticCustomError(
                "add_special_tokens",
                "'add_special_tokens' false is not served for texts: the model reads a text "
                "out at the special tokens its tokenizer appends (send the model's token ids "
                "to give every token yourself)",
                {"param": "add_special_tokens"},
            )
        return self

    @model_validator(mode="after")
    def _one_prompt(self):
        """`input_type` (NIM's) or `task` (Jina's) picks a prompt: not beside the fields that
        name one, nor beside an instruction where it is a passage's or gives its own."""
        picker = "input_type" if self.input_type is not None else "task"
        picked = getattr(self, picker)
        if picked is None:
            return self
        named = [n for n in ("prompt_name", "prompt") if getattr(self, n) is not None]
        if named:
            raise PydanticCustomError(
                "prompt",
                "send '{picker}' or '{param}', not both",
                {"picker": picker, "param": named[0]},
            )
        if self.instruction is None:
            return self
        if picked in PASSAGES or is_passage_task(picked):
            raise PydanticCustomError(
                "prompt",
                "'instruction' is a query's task, and {picker} '{picked}' embeds passages",
                {"picker": picker, "picked": picked, "param": "instruction"},
            )
        if picked in TASK_INSTRUCTIONS_BY_TASK:
            raise PydanticCustomError(
                "prompt",
                "task '{picked}' gives the instruction: send no 'instruction' with it",
                {"picked": picked, "param": "instruction"},
            )
        return self

    @model_validator(mode="after")
    def _late_chunking(self):
        """Jina's late chunking reads texts, and answers float vectors."""
        if not self.late_chunking:
            return self
        if self.chunks is not None or self.messages is not None:
            other = "chunks" if self.chunks is not None else "messages"
            raise PydanticCustomError(
                "late_chunking",
                "'late_chunking' chunks the texts of 'input': send no '{param}' with it",
                {"param": other},
            )
        if not all(isinstance(item, str) for item in self.input):
            raise PydanticCustomError(
                "late_chunking",
                "'late_chunking' reads texts: 'input' must be strings",
                {"param": "input"},
            )
        blank = next((i for i, text in enumerate(self.input) if not text.strip()), None)
        if blank is not None:
            raise PydanticCustomError(
                "late_chunking",
                "'input[{i}]' is blank: 'late_chunking' makes a vector of each input's own text",
                {"i": blank, "param": "input"},
            )
        return self

    @model_validator(mode="after")
    def _multivector(self):
        """Jina's per-token vectors: of whole inputs (kinds: as floats, in JSON)."""
        if not self.return_multivector:
            return self
        other = next((k for k in ("chunks", "late_chunking") if getattr(self, k)), None)
        if other is not None:
            raise PydanticCustomError(
                "return_multivector",
                "'return_multivector' gives a vector per token of each input: send no "
                "'{param}' with it",
                {"param": other},
            )
        return self

    @property
    def inputs(self) -> list:
        """Texts, token id lists, or content part lists (one per vector)."""
        if self.input is not None:
            return self.input
        users = [m.content for m in self.messages if m.role == "user"]
        if len(users) != 1:
            raise invalid("'messages' must hold one user message (and a system one)", "messages")
        return users

    def options(self, facts: dict | None = None) -> dict:
        """The contract's options; `facts`: the checkpoint's (common.checkpoint_facts), which
        `input_type` and `task` pick a prompt by."""
        facts = facts or {}
        prompt_names = facts.get("prompt_names", [])
        options = self.given("dimensions", *EXTENSION_OPTIONS, "priority")
        if self.task is not None:
            options |= task_options(self.task, prompt_names, facts.get("route", {}))
        else:
            options |= prompt_options(self.input_type, prompt_names, INPUT_TYPE_PROMPTS)
        if self.truncate_prompt_tokens not in (None, -1):
            options["max_tokens"] = self.truncate_prompt_tokens
        if self.truncation_side is not None:
            options["truncation_direction"] = self.truncation_side
        for ours, voyage in VOYAGE_FIELDS.items():
            if getattr(self, voyage) is not None:
                options[ours] = getattr(self, voyage)
        for twin in ("use_activation", "normalized"):
            if getattr(self, twin) is not None:
                options["normalize"] = getattr(self, twin)
        if self.encoding_format in PERPLEXITY_FORMATS:
            options.setdefault("normalize", False)
        system = [m.content for m in self.messages or () if m.role == "system"]
        if system:
            if not isinstance(system[0], str) or "instruction" in options:
                raise invalid(
                    "the system message is the instruction: a string, and no 'instruction'",
                    "messages",
                )
            options["instruction"] = system[0]
        if token_ids(self.inputs):  # the model's own token ids, as vLLM takes them
            options["token_ids"] = True
        if isinstance(self.chunks, ChunkSize):
            options["chunk_size"] = self.chunks.size
        elif self.chunks is not None:
            options["chunk_spans"] = self.chunks.spans
        return options_checked(**options)

    @property
    def binary(self) -> bool:
        return self.encoding_format in BINARY_FORMATS

    def in_its_words(self, e: APIError) -> APIError:
        """A refusal with the contract's options named as this body named them (Voyage's)."""
        given = VOYAGE_FIELDS.items()
        return named_as_sent(
            e, {ours: theirs for ours, theirs in given if getattr(self, theirs) is not None}
        )

    def kinds(self) -> tuple[Encoding, list[str], bool]:
        """(encoding, embedding types, keyed by name) from `encoding_format` (OpenAI: float or
        base64; a compact type's name as in vLLM and NIM), `embedding_type` (ours; Jina's, or
        its `encoding_type`, may be "base64"; Voyage's `output_dtype`) or `embedding_types`
        (Cohere: a list, answered keyed by type); a base64 float vector's bytes from
        `embed_dtype` and `endianness` (vLLM's), as are a binary format's (BINARY_FORMATS)."""
        fields = ("embedding_type", "encoding_type", "output_dtype", "embedding_types")
        asked = [k for k in fields if getattr(self, k)]
        single = self.embedding_type or self.encoding_type or self.output_dtype
        if self.encoding_format not in VECTOR_FORMATS:
            asked.append("encoding_format")
        if len(asked) > 1:
            raise invalid(f"send one of {asked}, not several", asked[1])
        if self.embedding_types:
            encoding, kinds, keyed = self.encoding_format, self.embedding_types, True
        elif asked == ["encoding_format"]:
            encoding, kinds, keyed = "float", [self.encoding_format], False
        elif single == "base64":  # Jina's: a float vector in base64
            encoding, kinds, keyed = "base64", ["float"], False
        else:
            kinds = [single or EmbedOptions.embedding_type]
            encoding, keyed = self.encoding_format, False
        float_only = ("chunks", "late_chunking", "return_multivector")
        shaped = next((k for k in float_only if getattr(self, k)), None)
        if shaped and (kinds != ["float"] or keyed):
            raise invalid(f"'{shaped}' gives float vectors: send no embedding type", shaped)
        if self.encoding_format in PERPLEXITY_FORMATS and (
            kinds != ["float"] or keyed or self.embed_dtype != "float32"
        ):
            other = "'embed_dtype'" if kinds == ["float"] else f"embedding type {kinds[-1]!r}"
            raise invalid(
                f"'encoding_format' {self.encoding_format!r} codes float32 vectors: send no "
                f"{other} with it",
                "encoding_format",
            )
        if self.binary:
            if shaped or kinds != ["float"] or keyed:
                raise invalid(
                    f"'encoding_format' {self.encoding_format!r} answers float vectors, one "
                    f"per input: not with {shaped or 'embedding types'}",
                    "encoding_format",
                )
            encoding = "bytes"
        if self.embed_dtype != "float32" and kinds != ["float"]:
            raise invalid(
                f"'embed_dtype' casts float vectors: send no embedding type {kinds[-1]!r} with it",
                "embed_dtype",
            )
        order = sys.byteorder if self.endianness == "native" else self.endianness
        return Encoding(encoding, self.embed_dtype, order), kinds, keyed


EmbeddingsRequest = create_model(
    "EmbeddingsRequest",
    __base__=_Embeddings,
    **contract_options(EmbedOptions, ("dimensions", *EXTENSION_OPTIONS)),
)


def checked_request(
    body: object, served_model: str | tuple[str, ...], adapters: tuple[str, ...] = ()
) -> EmbeddingsRequest:
    """An OpenAI embeddings request body, validated and for a served model or one of its
    `adapters` (common.model_adapters)."""
    request = EmbeddingsRequest.parse(body)
    check_model(request.model, (*served_names(served_model), *adapters))
    if has_parts(request.inputs) and request.chunks is not None:
        raise invalid("'chunks' are for texts, not inputs with images", "chunks")
    return request


async def served_request(gw, body: object) -> EmbeddingsRequest:
    """checked_request for this gateway's embed model and its adapters."""
    model = body.get("model") if isinstance(body, dict) else None
    return checked_request(body, gw.model_names, await model_adapters(gw, model, gw.model_names))


def request_plan(
    request: EmbeddingsRequest, facts: dict | None = None, served_model: tuple[str, ...] = ()
) -> tuple[list, dict, Encoding, list[str], bool]:
    """(texts or token id lists, client options, encoding, the embedding types to return,
    whether the response keys them by name); `facts`: the checkpoint's, where read. A `model`
    that is none of the `served_model` names is an adapter (checked_request)."""
    encoding, kinds, keyed = request.kinds()
    options = request.options(facts)
    if request.model is not None and served_model and request.model not in served_model:
        options["adapter"] = request.model
    return request.inputs, options, encoding, kinds, keyed


def parse_request(
    body: object, served_model: str | tuple[str, ...], facts: dict | None = None
) -> tuple[list, dict, Encoding, list[str], bool]:
    """checked_request, then its request_plan."""
    return request_plan(checked_request(body, served_model), facts)


class Document(ScriptInput):
    """Cohere's and Jina's document object (other fields ignored, as theirs are); one with
    an image or a video is a QwenInput."""

    text: Text
    image: object = None
    video: object = None

    @model_validator(mode="after")
    def _checked(self):
        if self.image is not None or self.video is not None:
            raise ValueError("not a text document")
        return self


class RerankRequest(_VllmPoolingFields):
    """POST /v1/rerank, the Cohere v1 / Jina shape; for a multimodal reranker, the query and
    each document may be content parts (as /v1/embeddings' inputs), objects as
    Qwen3-VL-Reranker's scripts write them ({"text", "image", "video"}), or vLLM's
    {"content": [parts]}: a query's parts are the one query, a document list's are one
    document each."""

    model: str | None = None
    query: described(
        NonBlank | Parts | QwenParts,
        "must be a string, content parts, or an object of 'text', 'image' and 'video'",
    )
    documents: Annotated[
        list[
            described(
                # left to right: {"text", ...} is Cohere's and Jina's text document, one with
                # an image or a video the scripts' input
                Annotated[Text | Parts | Document | QwenParts, Field(union_mode="left_to_right")],
                "must be a string, an object with a string 'text' (and, for a multimodal "
                "reranker, 'image' or 'video'), or content parts",
            )
        ],
        at_most(MAX_DOCUMENTS),
    ]
    top_n: int | None = None  # vLLM's 0: every document
    instruction: str | None = None
    return_documents: bool = True
    priority: Priority = None
    video_fps: float | None = None
    video_max_frames: int | None = None
    # vLLM's: false answers the reranker's logit; a cut per document (0: none); the
    # template's instruction; the cuts not served (0 and -1: none)
    use_activation: bool | None = None
    raw_scores: bool | None = None  # Infinity's: true, the logits (`use_activation` false)
    max_tokens_per_doc: Annotated[int, Field(ge=0)] | None = None
    chat_template_kwargs: dict[str, object] | None = None
    max_tokens_per_query: int | None = None
    truncate_prompt_tokens: int | None = None
    top_k: int | None = None  # Voyage's `top_n`
    truncation: bool | None = None  # Voyage's `truncate`
    rank_fields: list[str] | None = None  # Cohere v1's: its default, ["text"], is served

    @model_validator(mode="after")
    def _rank_fields(self):
        if self.rank_fields not in (None, ["text"]):
            raise PydanticCustomError(
                "cohere",
                "'rank_fields' other than ['text'] is not served: a document is ranked by its "
                "'text' (join the fields to rank by into it)",
                {"param": "rank_fields"},
            )
        return self

    @model_validator(mode="after")
    def _twins(self):
        if self.top_n is not None and self.top_k is not None:
            raise PydanticCustomError(
                "twins", "send 'top_k' or 'top_n', not both", {"param": "top_k"}
            )
        if self.raw_scores is not None and self.use_activation is not None:
            raise PydanticCustomError(
                "twins", "send 'raw_scores' or 'use_activation', not both", {"param": "raw_scores"}
            )
        return self

    @property
    def logits(self) -> bool:
        """Whether the answer's scores are the reranker's logits, not its scores."""
        return self.use_activation is False or self.raw_scores is True

    @model_validator(mode="after")
    def _vllm_fields(self):
        kwargs = self.chat_template_kwargs or {}
        if set(kwargs) - {"instruction"}:
            raise PydanticCustomError(
                "vllm",
                "'chat_template_kwargs' takes 'instruction' only",
                {"param": "chat_template_kwargs"},
            )
        if "instruction" in kwargs and self.instruction is not None:
            raise PydanticCustomError(
                "vllm",
                "send 'instruction' or 'chat_template_kwargs.instruction', not both",
                {"param": "chat_template_kwargs"},
            )
        if self.max_tokens_per_query not in (None, 0):
            raise PydanticCustomError(
                "vllm",
                "'max_tokens_per_query' is not served: a query is read whole (refused past the "
                "model's limit)",
                {"param": "max_tokens_per_query"},
            )
        if self.truncate_prompt_tokens not in (None, -1):
            raise PydanticCustomError(
                "vllm",
                "'truncate_prompt_tokens' cuts a query and document together, which is not "
                "served: send 'max_tokens_per_doc'",
                {"param": "truncate_prompt_tokens"},
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _vllm_content(cls, body):
        if not isinstance(body, dict):
            return body
        body = dict(body)
        if isinstance(body.get("query"), dict) and "content" in body["query"]:
            body["query"] = body["query"]["content"]
        documents = body.get("documents")
        if isinstance(documents, dict) and isinstance(documents.get("content"), list):
            body["documents"] = [[part] for part in documents["content"]]
        return body

    @property
    def inputs(self) -> tuple[str | list, list[str | list]]:
        """The query and the documents, each a text or a list of content parts."""
        return self.query, [d.text if isinstance(d, Document) else d for d in self.documents]


def parse_rerank_request(
    body: object, served: str | tuple[str, ...] | None, adapters: tuple[str, ...] = ()
) -> tuple[RerankRequest, dict]:
    """Validate a Cohere/Jina-style rerank body -> (the request, its options); `served`: the
    reranker's names (none: the routes are off); a `model` among its `adapters`
    (common.model_adapters) is the adapter option."""
    request = RerankRequest.parse(body)
    names = served_names(served)
    check_model(request.model, (*names, *adapters) if names else None)
    asked = request.given("top_n", "instruction", "priority", "video_fps", "video_max_frames")
    if asked.get("top_n") == 0:  # vLLM's: every document
        del asked["top_n"]
    asked |= {
        ours: v
        for ours, theirs in VOYAGE_RERANK_FIELDS.items()
        if (v := getattr(request, theirs)) is not None
    }
    if request.max_tokens_per_doc:  # vLLM's; 0: no cut
        asked["max_document_tokens"] = request.max_tokens_per_doc
    asked |= request.chat_template_kwargs or {}
    if request.model is not None and request.model not in names:
        asked["adapter"] = request.model
    options = rerank_checked(**asked)
    return request, options


def _embeddings_body(data: list, model_name: str, tokens: int) -> dict:
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model_name, "usage": usage}


@router.get("/v1/models")
@router.get("/models")  # Infinity's URL
async def models(request: Request):
    if gemini.from_google(request):  # the google-genai SDK's models.list (its version v1)
        return await gemini.list_models(request)
    return {"object": "list", "data": await _served_models(request)}


@router.get("/v1/models/{model:path}")  # a Hugging Face id as a served name holds a "/"
async def one_model(request: Request, model: str):
    if gemini.from_google(request):
        return await gemini.get_model(request, model)
    served = {e["id"]: e for e in await _served_models(request)}
    if model not in served:
        check_model(model, tuple(served))
    return served[model]


async def _served_models(request: Request) -> list[dict]:
    """/v1/models' entries: each embedder's names and its adapters' (with its prompts, chunk
    separator, whether it is multi-vector, fingerprint and tokens per text), and each
    reranker's names while Triton serves it (served.ServedModels)."""
    served = []
    for gw in keys.embedders(request):
        served += await _embedder_entries(gw)
    for gw in keys.rerankers(request):
        if gw.rerank_model_names and await gw.client.model_ready(gw.triton_rerank_model):
            served += [{"id": name} for name in gw.rerank_model_names]
    return [
        {**entry, "object": "model", "created": request.app.state.models.default.created}
        | {"owned_by": "qwen-embed"}
        for entry in served
    ]


async def _embedder_entries(gw) -> list[dict]:
    facts = await gw.facts()  # published by the tokenizer and encoder models
    embed_facts = {}
    if "prompt_names" in facts:
        embed_facts.update(
            prompt_names=facts["prompt_names"], default_prompt_name=facts["default_prompt_name"]
        )
    if "chunk_separator" in facts:  # it takes /v1/contextualizedembeddings
        embed_facts["chunk_separator"] = facts["chunk_separator"]
    if facts.get("multi_vector"):  # its vectors: /pooling's token_embed, /v1/score
        embed_facts["multi_vector"] = True
    if facts.get("fingerprint"):
        embed_facts["fingerprint"] = facts["fingerprint"]
    if facts.get("tokens_per_text"):  # vLLM's name: a text's most tokens, clients chunk by it
        embed_facts["max_model_len"] = facts["tokens_per_text"]
    served = [{"id": name, **embed_facts} for name in gw.model_names]
    # the encoder's adapters, each a model a request names (vLLM lists its LoRA models so)
    adapters = facts.get("route", {}).get("lora_names", [])
    return served + [{"id": name, "parent": gw.model_name, **embed_facts} for name in adapters]


@router.post("/v1/embeddings")
@router.post("/embeddings")  # Infinity's URL (its default prefix is none)
async def embeddings(request: Request):
    return await embeddings_response(*await routed(request))


async def embeddings_response(gw, body: object):
    """The route's response to an embeddings body: JSON, or vLLM's binary formats."""
    answer = await embeddings_body(gw, body, binary=True)
    if "layout" in answer:
        return await _binary_response(gw, answer)
    return await respond(gw, answer, adapter=answered_adapter(gw, answer))


async def _binary_response(gw, answer: dict):
    """vLLM's binary embeddings response: the vectors' bytes one after another, and (format
    "bytes") the `metadata` header: {id, created, model, data: [{index, embed_dtype,
    endianness, start, end, shape}], usage}, each vector's bytes at [start, end)."""
    layout, items, offset = answer["layout"], [], 0
    for entry in answer["data"]:
        size = len(entry["embedding"])
        shape = [size // np.dtype(EMBED_DTYPES[layout["embed_dtype"]]).itemsize]
        items.append(
            {
                "index": entry["index"],
                **layout,
                "start": offset,
                "end": offset + size,
                "shape": shape,
            }
        )
        offset += size
    content = b"".join(entry["embedding"] for entry in answer["data"])
    adapter = answered_adapter(gw, answer)
    if answer["format"] == "bytes_only":
        return await respond_bytes(gw, content, adapter=adapter)
    metadata = {
        "id": f"embd-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": answer["model"],
        "data": items,
        "usage": answer["usage"],
    }
    return await respond_bytes(gw, content, {"metadata": json.dumps(metadata)}, adapter)


async def embeddings_body(
    gw, body: object, binary: bool = False, media: tuple | None = None
) -> dict:
    """The answer to an embeddings request body (the route's, and a batch line's); a binary
    format's (`binary`: where the answer may be one, the route's) with each vector's bytes and
    their `layout` and `format`; `media`: the content parts' texts, images and videos where the
    caller has read them already (media.texts_and_media; voyage.py counts their pixels)."""
    request = await served_request(gw, body)
    try:
        return await _embeddings_answer(gw, request, binary, media)
    except APIError as e:
        raise request.in_its_words(e) from None


async def _embeddings_answer(gw, request: EmbeddingsRequest, binary: bool, media) -> dict:
    if request.binary and not binary:
        raise invalid(
            f"'encoding_format' {request.encoding_format!r} is answered on POST /v1/embeddings "
            "only",
            "encoding_format",
        )
    facts = await checkpoint_facts(gw, request.input_type or request.task)
    inputs, options, encoding, kinds, keyed = request_plan(request, facts, gw.model_names)
    if gw.tracing is not None:
        gw.tracing.set_attributes(**{"qwen_embed.inputs": len(inputs)})
    if "chunk_size" in options or "chunk_spans" in options:
        return await _chunk_embeddings(gw, inputs, options, encoding)
    if request.late_chunking:
        vectors, tokens = await late_chunk_embeddings(gw, inputs, options, encoding)
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        return _embeddings_body(data, options.get("adapter", gw.model_name), tokens)
    if request.return_multivector:  # Jina's: each input's vectors, one per token
        vectors = await embed_tokens(gw, inputs, options, "input")
        data, tokens = multi_vector_data(vectors, encoding)
        return _embeddings_body(data, options.get("adapter", gw.model_name), tokens)
    images = videos = None
    if media is not None:
        inputs, images, videos = media
    elif has_parts(inputs):
        inputs, images, videos = await texts_and_media(inputs, "input", gw.remote_media)
    result = await embed(gw, inputs, options, kinds, "input", images=images, videos=videos)
    data = []
    for i in range(len(inputs)):
        entry = {"object": "embedding", "index": i}
        if keyed:
            entry["embeddings"] = {k: encoding(result.by_type[k][i]) for k in kinds}
        else:
            entry["embedding"] = encoding(result.embeddings[i])
        data.append(entry | text_usage(result, i))
    answer = _embeddings_body(data, options.get("adapter", gw.model_name), result.total_tokens)
    if request.binary:
        layout = {"embed_dtype": request.embed_dtype, "endianness": request.endianness}
        answer |= {"layout": layout, "format": request.encoding_format}
    return answer


async def _chunk_embeddings(gw, texts, options, encoding):
    """Late chunking: each data item lists its chunks (characters and vector)."""
    size, spans = options.pop("chunk_size", None), options.pop("chunk_spans", None)
    try:
        results = await gw.client.embed_chunks(
            texts, chunk_size=size, spans=spans, **options, headers=gw.outgoing()
        )
    except EmbeddingError as e:
        raise backend_error(e, ("dimensions", "chunk_size", "chunk_spans"), "input") from e
    data = [
        {
            "object": "embedding",
            "index": i,
            "chunks": [
                {"start": int(a), "end": int(b), "embedding": encoding(v)}
                for (a, b), v in zip(r.spans, r.embeddings, strict=True)
            ],
        }
        for i, r in enumerate(results)
    ]
    model = options.get("adapter", gw.model_name)
    return _embeddings_body(data, model, sum(r.token_count for r in results))


@router.post("/v1/rerank")
async def rerank(request: Request):
    return await rerank_response(*await routed(request))


async def rerank_response(gw, body: object) -> dict:
    """Cohere v1 / Jina shape: {model, query, documents, top_n, return_documents}; with
    `model` the embed model's name where it is a multi-vector retriever, its own ranking
    (late_interaction_ranking); a body with Voyage's `top_k` or `truncation` (what its SDK
    sends), in Voyage's shape."""
    if not (isinstance(body, dict) and body.keys() & {"top_k", "truncation"}):
        return await _ranking(gw, body)
    try:
        answer = await _ranking(gw, body)
    except APIError as e:  # named as the body named them
        fields = VOYAGE_RERANK_FIELDS.items()
        given = {ours: theirs for ours, theirs in fields if theirs in body and ours not in body}
        raise named_as_sent(e, given) from None
    return voyage_ranking(answer, body.get("return_documents") is True)


def voyage_ranking(answer: dict, with_documents: bool) -> dict:
    """Voyage AI's rerank response from ours: {object: "list", data: [{relevance_score,
    index, document (its text, where asked)}], model, usage: {total_tokens}}."""
    data = []
    for result in answer["results"]:
        item = {"relevance_score": result["relevance_score"], "index": result["index"]}
        if with_documents:
            item["document"] = result["document"]["text"]
        data.append(item)
    return {"object": "list", "data": data, "model": answer["model"], "usage": answer["usage"]}


async def _ranking(gw, body: object) -> dict:
    served, triton = gw.rerank_model_names, gw.triton_rerank_model
    model = body.get("model") if isinstance(body, dict) else None
    if model is not None and model in gw.model_names and (await gw.facts()).get("multi_vector"):
        return await late_interaction_ranking(gw, RerankRequest.parse(body))
    adapters = await model_adapters(gw, model, served, triton)
    request, options = parse_rerank_request(body, served, adapters)
    query, documents = request.inputs
    allow = gw.remote_media
    (query,), (query_images,), (query_videos,) = await texts_and_media([query], "query", allow)
    texts, images, videos = await texts_and_media(documents, "documents", allow)
    if query_images or any(images) or query_videos or any(videos):
        options |= {"query_images": query_images, "document_images": images}
        options |= {"query_videos": query_videos, "document_videos": videos}
    try:
        result = await gw.client.rerank(query, texts, **options, headers=gw.outgoing())
    except EmbeddingError as e:
        raise backend_error(e, ("instruction",), "documents") from e
    raw = await raw_scores(gw) if request.logits else float
    results = _ranked(request, documents, [(i, raw(score)) for i, score in result.ranking])
    return {
        "model": options.get("adapter", gw.rerank_model_name),
        "results": results,
        "usage": {"total_tokens": result.total_tokens},
    }


async def late_interaction_ranking(gw, request: RerankRequest) -> dict:
    """A multi-vector embed model's ranking, as vLLM ranks with one: each document's MaxSim
    with the query over their normalised token vectors (texts, or content parts with
    images), best first; `top_n` and `return_documents` as a reranker's, `instruction` for the
    query as the model takes it (a retriever refuses it; without one, a MultiVectorEncoder's
    query and document tasks), a pair's options refused."""
    for name in ("max_tokens_per_doc", "chat_template_kwargs"):
        if getattr(request, name):
            raise invalid(f"'{name}' applies to a reranker's pairs, not to late interaction", name)
    if request.top_n:  # vLLM's 0: every document
        rerank_checked(top_n=request.top_n)
    query, documents = request.inputs
    options = {"normalize": True} | request.given("priority")
    query_prompt, document_prompt = await late_interaction_prompts(gw, request.given("instruction"))
    query_options = options_checked(**options, **query_prompt)
    (query_vectors,) = await embed_tokens(gw, [query], query_options, "query")
    document_options = options_checked(**options, **document_prompt)
    vectors = await embed_tokens(gw, documents, document_options, "documents")
    scores = maxsim_scores(query_vectors, vectors)
    order = np.argsort(-scores, kind="stable")[: request.top_n or None]
    tokens = len(query_vectors) + sum(len(v) for v in vectors)
    return {
        "model": gw.model_name,
        "results": _ranked(request, documents, [(int(i), float(scores[i])) for i in order]),
        "usage": {"total_tokens": tokens},
    }


def _ranked(request: RerankRequest, documents: list, ranking: list[tuple[int, float]]) -> list:
    """The results of a ranking ((index, score) best first), each with its document as the
    body sent it where `return_documents` asks: its text, and its image and video parts
    (vLLM's multi_modal)."""
    results = []
    for index, score in ranking:
        item = {"index": index, "relevance_score": score}
        if request.return_documents:
            document = documents[index]
            if isinstance(document, str):
                item["document"] = {"text": document}
            else:
                text = "".join(p.text for p in document if isinstance(p, TextPart))
                item["document"] = {"text": text}
                parts = [p for p in document if isinstance(p, MEDIA_PARTS)]
                if parts:
                    item["document"]["multi_modal"] = [p.model_dump() for p in parts]
        results.append(item)
    return results
