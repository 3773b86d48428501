"""What every front end of the gateway shares: one error record that each API renders in its
own shape (openai.py, tei.py, cohere.py), and the checks all of them make."""

from __future__ import annotations

import re
from collections.abc import Callable

from fastapi import Request

from ..client import DEADLINE_PASSED, EmbeddingError
from ..contract import (
    ITEM_INPUTS,
    EmbedOptions,
    RequestError,
    RerankOptions,
    at_least_one,
    parse_json,
)

# What went wrong, whatever the API: each API maps a kind to its own status and body.
INVALID = "invalid"  # a field breaks a rule (OpenAI 400, TEI 422, Cohere 400)
EMPTY = "empty"  # nothing to embed (TEI answers 400 "Empty")
NOT_FOUND = "not_found"  # a model this gateway does not serve
MISSING = "missing"  # a file or batch this gateway does not hold, or its Batch API is off
ROUTE = "route"  # a path no route serves
METHOD = "method"  # a route asked with a method it does not take
TOO_LARGE = "too_large"  # a body over the gateway's limit (413 in every API)
UNAUTHORIZED = "unauthorized"
OVERLOADED = "overloaded"  # the server's queue is full
RATE_LIMITED = "rate_limited"  # an API key's limit reached (per minute, or in flight)
UNAVAILABLE = "unavailable"  # the server or model is not there (after the client's retries)
BACKEND = "backend"  # any other failure of the server


# The HTTP status of each kind in OpenAI's and Cohere's APIs (TEI has its own: tei.py).
STATUS = {
    INVALID: 400,
    EMPTY: 400,
    NOT_FOUND: 404,
    MISSING: 404,
    ROUTE: 404,
    METHOD: 405,
    TOO_LARGE: 413,
    UNAUTHORIZED: 401,
    OVERLOADED: 429,
    RATE_LIMITED: 429,
    UNAVAILABLE: 503,
    BACKEND: 500,
}


class APIError(Exception):
    """`api`: the API whose shape renders it, where not the route's own (tei.py's /rerank
    serves the Jina/Cohere v1 shape too)."""

    def __init__(
        self,
        kind: str,
        message: str,
        param: str | None = None,
        api: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        # A message may quote what the client sent (a model's name), which JSON can carry with
        # a lone surrogate that no UTF-8 response can: such a character is quoted escaped.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.kind, self.message, self.param, self.api = kind, message, param, api
        self.headers = headers or {}  # a 429's Retry-After


def in_body_words(message: str, fields: dict[str, str]) -> str:
    """The message with the contract's option names (`'dimensions'`) written as the API's
    body fields (Cohere's `'output_dimension'`)."""
    for option, field in fields.items():
        message = message.replace(f"'{option}'", f"'{field}'")
    return message


def named_as_sent(e: APIError, names: dict[str, str]) -> APIError:
    """`e` with the contract's option names (the keys of `names`) written as the body's fields
    that gave them (its values), in its message and its `param`."""
    if not names:
        return e
    return APIError(e.kind, in_body_words(e.message, names), names.get(e.param, e.param), e.api)


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(INVALID, message, param)


def chunk_refusal(e: ValueError, document: str, field: str = "input") -> APIError:
    """A chunk the client refused before sending (client.joined_documents: "documents[i][j]
    ..."), named as the body's `field` item: `document` is the client's name for the body's
    documents ("documents": input[i][j]; "documents[0]": one document's chunks, input[j])."""
    return invalid(re.sub(rf"^{re.escape(document)}(\S+)", rf"'{field}\1'", str(e)), field)


def options_checked(**options) -> dict:
    """Embed options checked by the request contract (what the server would refuse, refused
    here with the field named), passed on as given."""
    return _checked(EmbedOptions, options)


def rerank_checked(**options) -> dict:
    """Rerank options checked by the contract (RerankOptions, and `top_n` >= 1)."""
    contract_field(at_least_one, options, "top_n")
    return _checked(RerankOptions, options)


def _checked(contract: type, options: dict) -> dict:
    try:
        contract(**{k: v for k, v in options.items() if k not in ("priority", "top_n")})
    except RequestError as e:
        raise _refused(e, body_field(e.field)) from None
    return options


def contract_field(check, body: dict, field: str):
    """`check(field, body[field])` of the contract (None where the field is absent), its
    refusal answered naming the field."""
    try:
        return check(field, body.get(field))
    except RequestError as e:
        raise _refused(e, field) from None


def _refused(e: RequestError, field: str | None) -> APIError:
    """A contract refusal as the API's 400, the body field named (the message without the
    contract's "parameter " prefix)."""
    return invalid(str(e).replace("parameter ", "", 1), field)


def body_field(option: str | None) -> str | None:
    """The request body's field of a contract option or Triton input: the late-chunking
    options are `chunks`, the documents' images and videos are in `documents`."""
    fields = {"chunk_size": "chunks", "chunk_spans": "chunks"}
    fields |= {"document_images": "documents", "document_videos": "documents"}
    return fields.get(option, option)


# A Triton input the server's message names ("input 'TEXT[3]'", "'QUERY'"), and Triton's
# prefix for an error in an ensemble's step.
_INPUT = re.compile(rf"(?:input )?'(QUERY|{'|'.join(ITEM_INPUTS)})(?:\[(\d+)\])?'")
_ENSEMBLE = re.compile(r"^in ensemble '[^']*', ")

# The body field of a request's items: one name ("input" -> 'input[3]'), or per item index
# its whole path.
Items = str | Callable[[int], str]


def backend_error(
    e: EmbeddingError, params: tuple[str, ...] = (), items: Items | None = None, query="query"
) -> APIError:
    """A failed Triton request as an APIError naming the request field it is about: one of
    `params` its message names as a parameter, else the body's item (`items`) or `query`
    where it names a Triton input, else one of `params` it mentions."""
    message = _ENSEMBLE.sub("", str(e))
    if "queue size" in message or "RESOURCE_EXHAUSTED" in str(e.status):
        return APIError(OVERLOADED, f"server overloaded: {message}")
    if e.retryable or e.status == DEADLINE_PASSED:
        return APIError(UNAVAILABLE, f"backend unavailable: {message}")
    if "unknown model" in message:  # Triton does not serve it (e.g. started with --no-rerank)
        return APIError(NOT_FOUND, f"the backend does not serve this model: {message}", "model")
    if "INVALID_ARG" in str(e.status) or e.status in ("400", "StatusCode.INVALID_ARGUMENT"):
        message, field = _body_inputs(message, items, query)
        named = [p for p in params if f"parameter '{p}'" in message]
        loose = [p for p in params if p.upper() in message.upper()]
        param = next(iter(named + ([field] if field else []) + loose), None)
        return invalid(message, body_field(param))
    return APIError(BACKEND, message)


def _body_inputs(message: str, items: Items | None, query: str) -> tuple[str, str | None]:
    """The message with the Triton inputs it names written as the body's fields, and the
    first of those fields (without its index)."""
    named = []

    def field(m: re.Match) -> str:
        name, index = m[1], m[2]
        if name == "QUERY":
            path = query
        elif items is None:
            return m[0]
        elif isinstance(items, str):
            path = items if index is None else f"{items}[{index}]"
        elif index is None:
            return m[0]
        else:
            path = items(int(index))
        named.append(re.split(r"[.\[]", path)[0])
        return f"'{path}'"

    return _INPUT.sub(field, message), next(iter(named), None)


async def json_body(request: Request) -> object:
    """The request's JSON, read only while within the gateway's `max_body_bytes`: parsed,
    a body holds several times its size in memory, and one client must not take the
    gateway's from every other."""
    limit = request.app.state.gateway.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    try:
        return parse_json(body)
    except ValueError:
        raise invalid("request body is not valid JSON") from None


def _too_large(limit: int) -> APIError:
    return APIError(
        TOO_LARGE, f"the request body is larger than the limit of {limit} bytes (--max-body-mb)"
    )
