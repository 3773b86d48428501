"""Cohere's v2 API: POST /v2/embed and /v2/rerank, what Cohere's SDK (`ClientV2(base_url=...)`)
and the RAG frameworks built on it speak. Errors are Cohere's {"id", "message"}.

`input_type` picks the checkpoint's prompt: a prompt named like the input type if the
checkpoint has one; else search_query -> the `query` prompt, search_document -> the `document`
prompt (no prompt if the checkpoint has none), classification and clustering -> the query
prompt with the task Qwen3-Embedding's evaluation uses for them (INPUT_TYPE_TASKS); without
`input_type`, the checkpoint's default prompt. Cohere's `priority` (0 first) maps 0 to the
interactive level and anything higher to bulk.

Extension: `text_tokens`, per text {tokens, input_tokens, truncated} (the SDK's models keep
unknown fields).
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..client import EmbeddingError
from ..contract import EMBEDDING_TYPES, MAX_INPUTS, at_least_one
from .common import check_model, embed, encode_value, rerank_inputs, text_usage
from .errors import (
    STATUS,
    APIError,
    backend_error,
    check_utf8,
    contract_field,
    distinct_choices,
    invalid,
    json_body,
    options_checked,
)
from .state import gateway, respond

router = APIRouter(tags=["cohere"])

INPUT_TYPES = ("search_query", "search_document", "classification", "clustering")
INPUT_TYPE_PROMPTS = {"search_query": "query", "search_document": "document"}
INPUT_TYPE_TASKS = {
    "classification": "Classify the given text",
    "clustering": "Identify the topic or theme of the given text",
}
TRUNCATE = {"END": {}, "START": {"truncation_direction": "left"}, "NONE": {"truncate": False}}
API_META = {"api_version": {"version": "2"}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse({"id": str(uuid.uuid4()), "message": e.message}, status_code=STATUS[e.kind])


def _object(value: object) -> dict:
    if not isinstance(value, dict):
        raise invalid("invalid request: body must be a JSON object")
    return value


def _texts(body: dict) -> list[str]:
    """`texts`, or `inputs` whose content is text parts only."""
    if ("texts" in body) == ("inputs" in body):
        raise invalid("invalid request: send one of 'texts' and 'inputs'", "texts")
    if "texts" in body:
        texts = body["texts"]
    else:
        texts = []
        for i, item in enumerate(body["inputs"] if isinstance(body["inputs"], list) else [None]):
            parts = item.get("content") if isinstance(item, dict) else None
            if not isinstance(parts, list) or not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in parts
            ):
                raise invalid(
                    f"invalid request: inputs[{i}].content must be a list of "
                    '{"type": "text", "text": ...} parts (images are not supported)',
                    "inputs",
                )
            texts.append("".join(p["text"] for p in parts))
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise invalid("invalid request: 'texts' must be a non-empty list of strings", "texts")
    if len(texts) > MAX_INPUTS:
        raise invalid(f"invalid request: {len(texts)} texts, more than the limit of {MAX_INPUTS}")
    check_utf8([(f"texts[{i}]", t) for i, t in enumerate(texts)])
    return texts


def prompt_options(input_type: object, prompt_names: list[str]) -> dict:
    """The request options that give `input_type` its prompt (module docstring)."""
    if input_type is None:
        return {}
    if input_type not in INPUT_TYPES:
        raise invalid(
            f"invalid request: input_type must be one of {list(INPUT_TYPES)}, got {input_type!r}",
            "input_type",
        )
    if input_type in prompt_names:
        return {"prompt_name": input_type}
    name = INPUT_TYPE_PROMPTS.get(input_type)
    if name is not None:
        return {"prompt_name": name} if name in prompt_names else {}
    return {"instruction": INPUT_TYPE_TASKS[input_type]}


def _priority(body: dict) -> dict:
    value = body.get("priority")
    if value is None:
        return {}
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid("invalid request: priority must be an integer >= 0", "priority")
    return {"priority": "interactive" if value == 0 else "bulk"}


def _embedding_types(body: dict) -> tuple[list[str], list[str]]:
    """(the types asked for, the server's types that give them: `base64`, the float vectors'
    bytes, comes from float)."""
    asked = distinct_choices(
        body.get("embedding_types", ["float"]),
        (*EMBEDDING_TYPES, "base64"),
        "invalid request: embedding_types must be distinct values from",
        "embedding_types",
    )
    server = {"float" if k == "base64" else k for k in asked}
    return asked, [k for k in EMBEDDING_TYPES if k in server]


@router.post("/v2/embed")
async def embed_v2(request: Request):
    gw = gateway(request)
    body = _object(await json_body(request))
    check_model(body.get("model"), gw.model_names)
    texts = _texts(body)
    truncate = body.get("truncate", "END")
    if truncate not in TRUNCATE:
        raise invalid("invalid request: truncate must be one of NONE, START, END", "truncate")
    options = {**TRUNCATE[truncate], **_priority(body)}
    if body.get("output_dimension") is not None:
        options["dimensions"] = body["output_dimension"]
    if body.get("max_tokens") is not None:
        options["max_tokens"] = body["max_tokens"]
    facts = await gw.facts()
    options |= prompt_options(body.get("input_type"), facts.get("prompt_names", []))
    asked, kinds = _embedding_types(body)
    try:
        options = options_checked(**options)
    except APIError as e:
        e.message = f"invalid request: {e.message}"
        raise
    result = await embed(gw, texts, options, kinds, ("dimensions", "max_tokens"))
    embeddings = {}
    for kind in asked:
        vectors = result.by_type["float" if kind == "base64" else kind]
        encoding = "base64" if kind == "base64" else "float"
        embeddings[kind] = [encode_value(v, encoding) for v in vectors]
    tokens = result.total_tokens
    answer = {
        "id": str(uuid.uuid4()),
        "embeddings": embeddings,
        "texts": texts,
        "meta": {
            **API_META,
            "billed_units": {"input_tokens": tokens},
            "tokens": {"input_tokens": tokens},
        },
        "response_type": "embeddings_by_type",
        "text_tokens": [text_usage(result, i) for i in range(len(texts))],
    }
    return await respond(gw, answer)


@router.post("/v2/rerank")
async def rerank_v2(request: Request):
    gw = gateway(request)
    body = _object(await json_body(request))
    check_model(body.get("model"), gw.rerank_model_name)
    query, documents = rerank_inputs(body, "documents", "invalid request: {}".format)
    options = _priority(body)
    for field, option in (("top_n", "top_n"), ("max_tokens_per_doc", "max_document_tokens")):
        if (value := contract_field(at_least_one, body, field)) is not None:
            options[option] = value
    try:
        result = await gw.client.rerank(query, documents, **options, headers=gw.outgoing())
    except EmbeddingError as e:
        raise backend_error(e, ("query", "documents")) from e
    return {
        "id": str(uuid.uuid4()),
        "results": [{"index": i, "relevance_score": s} for i, s in result.ranking],
        "meta": {**API_META, "billed_units": {"search_units": 1}},
    }
