"""What the APIs' handlers share (openai.py, tei.py, cohere.py, nim.py and the Batch API): the
model check, the call to the Triton client with the API's own errors, the prompt an API's input
type picks, truncation modes, a reranker's logit, and the encodings of a vector and of a text's
usage."""

from __future__ import annotations

import base64
import math
import sys
import time
import uuid
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..client import EmbeddingError, EmbeddingResult
from ..contract import ANSWER_TOO_LARGE, MAX_ANSWER_BYTES
from .errors import NOT_FOUND, APIError, Items, backend_error, chunk_refusal, invalid
from .media import has_parts, texts_and_media

# Perplexity's encodings of its models' unnormalised vectors (Encoding)
PERPLEXITY_FORMATS = ("base64_int8", "base64_binary")

# The truncation modes of Cohere's and NIM's bodies as request options: END cuts a text's end
# (the default), START its beginning, NONE refuses a text past the model's limit.
TRUNCATE_MODES = {
    "END": {},
    "START": {"truncation_direction": "left"},
    "NONE": {"truncate": False},
}

# Tasks given to a checkpoint's query prompt as its instruction where an API names a task
# rather than a side of retrieval (Cohere's input types, Jina's tasks, Gemini's task types), as
# MTEB's evaluations (Qwen3-Embedding's and E5's among them) instruct such tasks.
TASK_INSTRUCTIONS = {
    "classification": "Classify the given text",
    "clustering": "Identify the topic or theme of the given text",
    "similarity": "Retrieve semantically similar text",
    "question_answering": "Given a question, retrieve passages that answer the question",
    "fact_verification": "Given a claim, retrieve documents that support or refute the claim",
    "code_retrieval": "Given a question, retrieve code snippets that answer the question",
}

# A float32 P("yes") saturates at 0 and 1; its logit is taken at the nearest float32 values.
_SMALLEST_SCORE, _LARGEST_SCORE = 2.0**-149, 1.0 - 2.0**-24


def check_model(model: object, served: str | tuple[str, ...] | None) -> None:
    """`model` must be one of the served names, or absent (the served model, as vLLM and
    TEI take it); an endpoint serving none is off."""
    names = served_names(served)
    if model not in names and not (model is None and names):
        raise unknown_model(model, names)


def unknown_model(model: object, names: tuple[str, ...]) -> APIError:
    """The refusal of a `model` none of the `names` served is (none: the endpoint is off)."""
    serves = f"this endpoint serves {' or '.join(map(repr, names))}" if names else "it is off"
    return APIError(NOT_FOUND, f"The model '{model}' does not exist; {serves}", "model")


def served_names(served: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """An endpoint's served name or names as a tuple (none: off)."""
    return (served,) if isinstance(served, str) else tuple(served or ())


async def model_adapters(
    gw, model: object, served: str | tuple[str, ...] | None, triton_model: str | None = None
) -> tuple[str, ...]:
    """The LoRA adapters the served model keeps beside its weights (its encoder's
    lora_modules), which a request's `model` names as it names vLLM's LoRA models; read only
    for a `model` that is none of the `served` names (a Triton read before a request's
    first)."""
    names = served_names(served)
    if model is None or model in names or not names:
        return ()
    facts = await gw.client.served_facts(triton_model)
    return tuple(facts.get("route", {}).get("lora_names", ()))


async def model_adapter(
    gw, model: object, served: str | tuple[str, ...] | None, triton_model: str | None = None
) -> str | None:
    """check_model, a served model's adapters counted among its names: the adapter `model`
    names, or None for the served model itself."""
    adapters = await model_adapters(gw, model, served, triton_model)
    check_model(model, (*served_names(served), *adapters))
    return model if model in adapters else None


def prompt_options(
    input_type: str | None,
    prompt_names: list[str],
    prompts: dict[str, str],
    tasks: dict[str, str] | None = None,
) -> dict:
    """The request options that give an API's `input_type` its checkpoint's prompt: the
    prompt named like the input type where the checkpoint has one, else the one `prompts`
    names for it (none where the checkpoint lacks it), else the query prompt with the task
    `tasks` gives it; else the checkpoint's default."""
    if input_type is None:
        return {}
    if input_type in prompt_names:
        return {"prompt_name": input_type}
    name = prompts.get(input_type)
    if name is not None:
        return {"prompt_name": name} if name in prompt_names else {}
    if input_type in (tasks or {}):
        return {"instruction": tasks[input_type]}
    return {}


async def checkpoint_facts(gw, input_type: str | None) -> dict:
    """The served checkpoint's facts (its prompt names, its route) where an API's
    `input_type` picks a prompt (prompt_options), else none: reading them is a config read
    before the request's Triton call, made only where it decides something."""
    if input_type is None:
        return {}
    return await gw.facts()


async def raw_scores(gw):
    """score -> the reranker's raw score, what `raw_scores`, `use_activation: false` and NIM's
    `logit` ask for: a P(relevant)'s logit (log_odds); a logit or a listwise reranker's cosine
    as it is."""
    return log_odds if await gw.client.score_kind() == "probability" else float


def log_odds(score: float) -> float:
    """A yes/no reranker's logit, log(p / (1 - p)), from its float32 P("yes") `score`; a
    saturated score (0 or 1) gives the logit of the nearest float32 inside, so logits keep
    the scores' order and stay finite."""
    p = min(max(float(score), _SMALLEST_SCORE), _LARGEST_SCORE)
    return math.log(p) - math.log1p(-p)


async def embed(
    gw,
    inputs: list,
    options: dict,
    kinds: list[str],
    items: Items,
    params=("dimensions",),
    images=None,
    videos=None,
):
    """Every type asked for from one computation of the vectors, in one Triton request per
    chunk of the inputs (the client splits), with the API's own errors (`items`: the body's
    field of the inputs, backend_error); `images`, `videos`: each input's image and video
    files (a multimodal model)."""
    try:
        return await gw.client.embed_with_usage(
            inputs,
            **options,
            embedding_type=",".join(kinds),
            headers=gw.outgoing(),
            images=images,
            videos=videos,
        )
    except EmbeddingError as e:
        raise backend_error(e, params, items) from e


async def contextual_chunks(gw, documents: list, options: dict, model, items: str) -> list:
    """Each document's chunk vectors, in the context of its other chunks (the client's
    `embed_contextual`), with the API's own errors (`items`: the body's field of the
    documents; `model`: the name the body asked for); a model without a chunk separator is
    refused."""
    separator = (await gw.client.served_facts()).get("chunk_separator")
    if separator is None:
        raise invalid(
            f"model '{model or gw.model_name}' embeds no contextualized chunks: it has no chunk "
            "separator (a contextual checkpoint's, as pplx-embed-context's)",
            "model",
        )
    try:
        return await gw.client.embed_contextual(documents, **options, headers=gw.outgoing())
    except EmbeddingError as e:
        raise backend_error(e, ("dimensions",), items) from e
    except ValueError as e:  # a chunk holding the separator (client.joined_documents)
        raise chunk_refusal(e, "documents", items) from e


def contextual_answer(vectors: list[list], results: list, model: str) -> dict:
    """/v1/contextualizedembeddings' answer: each document's encoded chunk `vectors`, the
    `results`' tokens, `model` the name it gives."""
    data = [
        {
            "object": "list",
            "index": i,
            "data": [
                {"object": "embedding", "index": j, "embedding": v} for j, v in enumerate(chunks)
            ],
        }
        for i, chunks in enumerate(vectors)
    ]
    tokens = sum(r.token_count for r in results)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


async def embed_tokens(gw, inputs: list, options: dict, items: str) -> list:
    """Every token's vector of each input (the client's `embed_tokens`; an input is a text or,
    for a multimodal model, a list of content parts with its images and videos), with the
    API's own errors (`items`: the body's field of the inputs). The encoder bounds each Triton
    request's answer; the inputs of one HTTP request travel in several, so their sum is
    bounded here: before any forward from the token counts at the served dimension (a lower
    bound: a projecting checkpoint's token vectors are wider; inputs with images or videos
    are counted once they are back, their tokens known only once resized), and exactly once
    the vectors are back. Counting tokenizes the texts a second time, but an accepted request
    holds at most 64 MiB / (4 x width) tokens, a small share of its forwards."""
    media = {}
    if has_parts(inputs):
        inputs, images, videos = await texts_and_media(inputs, items, gw.remote_media)
        media = {"images": images, "videos": videos}
    try:
        if not media:  # the tokenizer alone: no priority level to keep
            counting = {k: v for k, v in options.items() if k != "priority"}
            counts = await gw.client.count_tokens(inputs, **counting, headers=gw.outgoing())
            width = options.get("dimensions") or (await gw.facts()).get("dimension") or 0
            _check_token_bytes(len(inputs), int(counts.sum()) * width * 4, "at least ")
        vectors = await gw.client.embed_tokens(inputs, **options, **media, headers=gw.outgoing())
    except EmbeddingError as e:
        raise backend_error(e, ("dimensions",), items) from e
    _check_token_bytes(len(inputs), sum(v.nbytes for v in vectors))
    return vectors


def multi_vector_data(vectors: list, encode) -> tuple[list[dict], int]:
    """Jina's per-token answer (its /v1/multi-vector, its v4 API's `return_multivector`): one
    {"object": "embeddings", index, embeddings: [`encode`d vector per token]} per input, and
    the tokens they hold."""
    data = [
        {"object": "embeddings", "index": i, "embeddings": [encode(t) for t in tokens]}
        for i, tokens in enumerate(vectors)
    ]
    return data, sum(len(v) for v in vectors)


async def late_interaction_prompts(gw, asked: dict) -> tuple[dict, dict]:
    """(the queries', the documents') prompt options where the embed model's token vectors
    score queries against documents (/v1/score, a ranking): the request's prompt for the
    queries; where it names none, a multi-vector model's `query` and `document` prompts
    (a MultiVectorEncoder's tasks, which every such model serves), else none."""
    if asked:
        return asked, {}
    facts = await gw.facts()
    if facts.get("multi_vector") and {"query", "document"} <= set(facts.get("prompt_names", ())):
        return {"prompt_name": "query"}, {"prompt_name": "document"}
    return {}, {}


def _check_token_bytes(inputs: int, size: int, bound: str = "") -> None:
    if size > MAX_ANSWER_BYTES:
        raise invalid(
            f"per-token vectors of {inputs} inputs are {bound}{size / 2**20:.1f} MiB of float32, "
            f"more than the {MAX_ANSWER_BYTES // 2**20} MiB {ANSWER_TOO_LARGE}; "
            "send fewer or shorter inputs, or fewer dimensions"
        )


# vLLM's `embed_dtype`: the type a float vector's bytes take in base64.
EMBED_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
}
# e4m3 has no infinity: torch's cast (vLLM's) saturates at its largest value, not NaN
_E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


@dataclass(frozen=True)
class Encoding:
    """How a vector goes into JSON: "float", its numbers (the array as it is: state.dumps
    writes it), or "base64", its bytes: a float vector cast to `dtype` (rounded to nearest
    even, as torch casts), the compact types' codes as they are, in the byte order `byteorder`
    ("little" or "big"); or "bytes", those bytes as they are (vLLM's binary responses); or
    Perplexity's (PERPLEXITY_FORMATS), a float vector's int8 codes round(127 x) or its signs
    (1: x >= 0), one bit a dimension, least significant bit first, in base64."""

    format: str = "float"
    dtype: str = "float32"
    byteorder: str = "little"

    def __call__(self, vector: np.ndarray):
        if self.format == "float":
            return vector
        if self.format == "base64_int8":
            codes = np.clip(np.rint(vector * 127), -128, 127).astype(np.int8)
            return base64.b64encode(codes).decode()
        if self.format == "base64_binary":
            return base64.b64encode(np.packbits(vector >= 0, bitorder="little")).decode()
        if vector.dtype == np.float32 and self.dtype != "float32":
            if self.dtype == "fp8_e4m3":
                vector = np.clip(vector, -_E4M3_MAX, _E4M3_MAX)
            with np.errstate(over="ignore"):  # past a type's range: infinity, as torch casts
                vector = vector.astype(EMBED_DTYPES[self.dtype])
        raw = vector.view(f"u{vector.itemsize}")
        if self.byteorder != sys.byteorder:
            raw = raw.byteswap()
        if self.format == "bytes":
            return raw.tobytes()
        return base64.b64encode(raw.tobytes()).decode()


def vllm_list(gw, kind: str, items: list, tokens: int, adapter: str | None = None) -> dict:
    """vLLM's list response around `items` (its score, pooling and classify APIs)."""
    return {
        "id": f"{kind}-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": adapter or gw.model_name,
        "data": items,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def text_usage(result: EmbeddingResult, i: int) -> dict:
    """One text's tokens: used, before truncation, and whether it was cut (an extension)."""
    used, given = int(result.token_counts[i]), int(result.input_tokens[i])
    return {"tokens": used, "input_tokens": given, "truncated": given > used}
