"""The OpenAI API: POST /v1/embeddings (texts, or the model's own token ids), GET /v1/models,
and the Jina/Cohere v1 rerank shape on POST /v1/rerank (also /rerank, shared with TEI's).

Extension fields (the OpenAI SDK keeps unknown fields, pydantic `extra="allow"`): each data
item's `tokens`, `input_tokens` and `truncated`; in the request, `embedding_type` /
`embedding_types`, `priority`, `chunks` and the contract's EXTENSION_OPTIONS (docs/api.md).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..client import EmbeddingError
from ..contract import (
    EMBEDDING_TYPES,
    MAX_INPUTS,
    EmbedOptions,
    at_least_one,
    priority_level,
)
from .common import check_model, embed, encode_value, rerank_inputs, text_usage
from .errors import (
    BACKEND,
    NOT_FOUND,
    OVERLOADED,
    STATUS,
    UNAUTHORIZED,
    UNAVAILABLE,
    APIError,
    backend_error,
    check_utf8,
    contract_field,
    distinct_choices,
    invalid,
    json_body,
    options_checked,
    token_id_lists,
)
from .state import gateway, respond

# Request options of the contract taken as extension fields of the body (docs/api.md).
EXTENSION_OPTIONS = (
    "prompt_name",
    "instruction",
    "prompt",
    "normalize",
    "truncate",
    "truncation_direction",
    "max_tokens",
)

router = APIRouter(tags=["openai"])

_CODES = {NOT_FOUND: "model_not_found", UNAUTHORIZED: "invalid_api_key"}


def error_response(e: APIError) -> JSONResponse:
    server = e.kind in (OVERLOADED, UNAVAILABLE, BACKEND)
    body = {
        "message": e.message,
        "type": "server_error" if server else "invalid_request_error",
        "param": e.param,
        "code": _CODES.get(e.kind),
    }
    return JSONResponse({"error": body}, status_code=STATUS[e.kind])


def parse_request(
    body: object, served_model: str | tuple[str, ...]
) -> tuple[list, dict, str, list[str], bool]:
    """Validate an OpenAI embeddings request body -> (texts or token id lists, client
    options, encoding, the embedding types to return, whether the response keys them by
    name)."""
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    inputs = body.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    options = {}
    ids = token_id_lists(inputs, "input")
    if ids is not None:  # the model's own token ids, as vLLM takes them
        inputs, options["token_ids"] = ids, True
    elif not isinstance(inputs, list) or not inputs or not all(isinstance(t, str) for t in inputs):
        raise invalid(
            "'input' must be a string, a non-empty list of strings, or the model's token ids "
            "(a list of integers or a list of such lists)",
            "input",
        )
    if len(inputs) > MAX_INPUTS:
        raise invalid(
            f"'input' holds {len(inputs)} items, more than the limit of {MAX_INPUTS}", "input"
        )
    if ids is None:
        check_utf8([(f"input[{i}]", t) for i, t in enumerate(inputs)])
    check_model(body.get("model"), served_model)
    options |= {k: body[k] for k in ("dimensions", *EXTENSION_OPTIONS) if body.get(k) is not None}
    options.update(priority(body))
    encoding, kinds, keyed = _embedding_types(body)
    if "chunks" in body:
        if kinds != [EmbedOptions.embedding_type] or keyed:
            raise invalid("'chunks' come as float vectors: send no embedding type", "chunks")
        options.update(_chunks(body["chunks"]))
    return inputs, options_checked(**options), encoding, kinds, keyed


def _chunks(value: object) -> dict:
    """The late-chunking extension: {"size": tokens} or {"spans": [[start, end], ...]} over
    each text's own tokens (the contract checks their form, the server their ranges)."""
    if isinstance(value, dict) and set(value) in ({"size"}, {"spans"}):
        key, given = next(iter(value.items()))
        return {"chunk_size" if key == "size" else "chunk_spans": given}
    raise invalid('\'chunks\' must be {"size": tokens} or {"spans": [[start, end], ...]}', "chunks")


def priority(body: dict) -> dict:
    """`priority`: "interactive" (default) or "bulk" (Triton's levels 1 and 2; vLLM's
    integer form is accepted as those levels)."""
    if "priority" not in body:
        return {}
    try:
        priority_level(body["priority"])
    except ValueError as e:
        raise invalid(f"'priority' {e.args[0].removeprefix('priority ')}", "priority") from None
    return {"priority": body["priority"]}


def _embedding_types(body: dict) -> tuple[str, list[str], bool]:
    """(encoding, embedding types, keyed by name) from `encoding_format` (OpenAI: float or
    base64; a compact type's name as in vLLM and NIM), `embedding_type` (ours) or
    `embedding_types` (Cohere: a list, answered keyed by type)."""
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64", *EMBEDDING_TYPES):
        raise invalid(
            f"'encoding_format' must be 'float', 'base64' or one of {list(EMBEDDING_TYPES)}",
            "encoding_format",
        )
    asked = [key for key in ("embedding_type", "embedding_types") if key in body]
    if encoding not in ("float", "base64"):
        asked.append("encoding_format")
    if len(asked) > 1:
        raise invalid(f"send one of {asked}, not several", asked[1])
    if "embedding_types" in body:
        kinds = distinct_choices(
            body["embedding_types"],
            EMBEDDING_TYPES,
            "'embedding_types' must be a list of distinct values from",
            "embedding_types",
        )
        return encoding, kinds, True
    if encoding not in ("float", "base64"):
        return "float", [encoding], False
    kind = body.get("embedding_type", EmbedOptions.embedding_type)
    if kind not in EMBEDDING_TYPES:
        raise invalid(f"'embedding_type' must be one of {list(EMBEDDING_TYPES)}", "embedding_type")
    return encoding, [kind], False


def parse_rerank_request(body: object, served_model: str | None) -> tuple[str, list[str], dict]:
    """Validate a Cohere/Jina-style rerank body -> (query, documents, options)."""
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    check_model(body.get("model"), served_model)
    query, texts = rerank_inputs(body, "documents", "'{}'".format, objects=True)
    options = {"top_n": contract_field(at_least_one, body, "top_n")}
    instruction = body.get("instruction")
    if instruction is not None:
        if not isinstance(instruction, str) or not instruction.strip():
            raise invalid("'instruction' must be a non-empty string", "instruction")
        options["instruction"] = instruction
    return_documents = body.get("return_documents", True)
    if not isinstance(return_documents, bool):
        raise invalid("'return_documents' must be a boolean", "return_documents")
    options["return_documents"] = return_documents
    options.update(priority(body))
    return query, texts, options


def _embeddings_body(data: list, model_name: str, tokens: int) -> dict:
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model_name, "usage": usage}


@router.get("/v1/models")
async def models(request: Request):
    gw = gateway(request)
    facts = await gw.facts()  # published by the tokenizer and encoder models
    embed_facts = {}
    if "prompt_names" in facts:
        embed_facts.update(
            prompt_names=facts["prompt_names"], default_prompt_name=facts["default_prompt_name"]
        )
    if facts.get("fingerprint"):
        embed_facts["fingerprint"] = facts["fingerprint"]
    served = [{"id": name, **embed_facts} for name in gw.model_names]
    if gw.rerank_model_name and await gw.client.model_ready(gw.triton_rerank_model):
        served.append({"id": gw.rerank_model_name})
    return {
        "object": "list",
        "data": [
            {**entry, "object": "model", "created": gw.created, "owned_by": "qwen-embed"}
            for entry in served
        ],
    }


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    gw = gateway(request)
    return await respond(gw, await embeddings_body(gw, await json_body(request)))


async def embeddings_body(gw, body: object) -> dict:
    """The answer to an embeddings request body (the route's, and a batch line's)."""
    inputs, options, encoding, kinds, keyed = parse_request(body, gw.model_names)
    if gw.tracing is not None:
        gw.tracing.set_attributes(**{"qwen_embed.inputs": len(inputs)})
    if "chunk_size" in options or "chunk_spans" in options:
        return await _chunk_embeddings(gw, inputs, options, encoding)
    result = await embed(gw, inputs, options, kinds)
    data = []
    for i in range(len(inputs)):
        entry = {"object": "embedding", "index": i}
        if keyed:
            entry["embeddings"] = {k: encode_value(result.by_type[k][i], encoding) for k in kinds}
        else:
            entry["embedding"] = encode_value(result.embeddings[i], encoding)
        data.append(entry | text_usage(result, i))
    return _embeddings_body(data, gw.model_name, result.total_tokens)


async def _chunk_embeddings(gw, texts, options, encoding):
    """Late chunking: each data item lists its chunks (characters and vector)."""
    size, spans = options.pop("chunk_size", None), options.pop("chunk_spans", None)
    try:
        results = await gw.client.embed_chunks(
            texts, chunk_size=size, spans=spans, **options, headers=gw.outgoing()
        )
    except EmbeddingError as e:
        raise backend_error(e, ("dimensions", "chunk_size", "chunk_spans")) from e
    data = [
        {
            "object": "embedding",
            "index": i,
            "chunks": [
                {"start": int(a), "end": int(b), "embedding": encode_value(v, encoding)}
                for (a, b), v in zip(r.spans, r.embeddings, strict=True)
            ],
        }
        for i, r in enumerate(results)
    ]
    return _embeddings_body(data, gw.model_name, sum(r.token_count for r in results))


@router.post("/v1/rerank")
async def rerank(request: Request):
    return await rerank_response(gateway(request), await json_body(request))


async def rerank_response(gw, body: object) -> dict:
    """Cohere v1 / Jina shape: {model, query, documents, top_n, return_documents}."""
    query, documents, options = parse_rerank_request(body, gw.rerank_model_name)
    return_documents = options.pop("return_documents")
    try:
        result = await gw.client.rerank(query, documents, **options, headers=gw.outgoing())
    except EmbeddingError as e:
        raise backend_error(e, ("query", "documents", "instruction")) from e
    results = []
    for index, score in result.ranking:
        item = {"index": index, "relevance_score": score}
        if return_documents:
            item["document"] = {"text": documents[index]}
        results.append(item)
    return {
        "model": gw.rerank_model_name,
        "results": results,
        "usage": {"total_tokens": result.total_tokens},
    }
