"""What every front end of the gateway shares: one error record that each API renders in its
own shape (openai.py, tei.py, cohere.py), and the checks all of them make."""

from __future__ import annotations

from fastapi import Request

from ..client import EmbeddingError
from ..contract import EmbedOptions, RequestError

# What went wrong, whatever the API: each API maps a kind to its own status and body.
INVALID = "invalid"  # a field breaks a rule (OpenAI 400, TEI 422, Cohere 400)
EMPTY = "empty"  # nothing to embed (TEI answers 400 "Empty")
NOT_FOUND = "not_found"  # a model this gateway does not serve
UNAUTHORIZED = "unauthorized"
OVERLOADED = "overloaded"  # the server's queue is full
UNAVAILABLE = "unavailable"  # the server or model is not there (after the client's retries)
BACKEND = "backend"  # any other failure of the server


# The HTTP status of each kind in OpenAI's and Cohere's APIs (TEI has its own: tei.py).
STATUS = {
    INVALID: 400,
    EMPTY: 400,
    NOT_FOUND: 404,
    UNAUTHORIZED: 401,
    OVERLOADED: 429,
    UNAVAILABLE: 503,
    BACKEND: 500,
}


class APIError(Exception):
    """`api`: the API whose shape renders it, where not the route's own (tei.py's /rerank
    serves the Jina/Cohere v1 shape too)."""

    def __init__(self, kind: str, message: str, param: str | None = None, api: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.param, self.api = kind, message, param, api


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(INVALID, message, param)


def distinct_choices(value: object, allowed: tuple[str, ...], message: str, param: str) -> list:
    """`value` as a non-empty list of distinct strings from `allowed`, else `message`."""
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(k, str) and k in allowed for k in value)
        or len(set(value)) != len(value)
    ):
        raise invalid(f"{message} {list(allowed)}", param)
    return value


def options_checked(**options) -> dict:
    """Options checked by the request contract (what the server would refuse, refused here
    with the field named), passed on as given."""
    try:
        EmbedOptions(**{k: v for k, v in options.items() if k != "priority"})
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
    """The request body's field of a contract option: the late-chunking ones are `chunks`."""
    return "chunks" if option in ("chunk_size", "chunk_spans") else option


def check_utf8(named_texts: list[tuple[str, str]]) -> None:
    """JSON may escape a lone surrogate (\\ud800), which no UTF-8 text can hold."""
    for name, text in named_texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise invalid(
                f"'{name}' is not valid UTF-8 (a lone surrogate)", name.split("[")[0]
            ) from None


INT32 = 2**31


def token_id_lists(value: object, name: str) -> list[list[int]] | None:
    """A list of ints (one input) or a list of such lists -> the lists; None for anything
    else. Each list must be non-empty; ids past int32, which no vocabulary reaches and the
    wire cannot carry, are refused here (the server checks the vocabulary's range)."""

    def ids(x):
        return (
            isinstance(x, list)
            and len(x) > 0
            and all(isinstance(i, int) and not isinstance(i, bool) for i in x)
        )

    if ids(value):
        lists = [value]
    elif isinstance(value, list) and value and all(ids(x) for x in value):
        lists = value
    else:
        return None
    for i, ids_ in enumerate(lists):
        bad = next((t for t in ids_ if not -INT32 <= t < INT32), None)
        if bad is not None:
            raise invalid(f"'{name}[{i}]' holds token id {bad}, outside any vocabulary", name)
    return lists


def backend_error(e: EmbeddingError, params: tuple[str, ...]) -> APIError:
    """A failed Triton request as an APIError naming the request field it is about."""
    message = str(e)
    if "queue size" in message or "RESOURCE_EXHAUSTED" in str(e.status):
        return APIError(OVERLOADED, f"server overloaded: {message}")
    if e.retryable:
        return APIError(UNAVAILABLE, f"backend unavailable: {message}")
    if "unknown model" in message:  # Triton does not serve it (e.g. started with --no-rerank)
        return APIError(NOT_FOUND, f"the backend does not serve this model: {message}", "model")
    if "INVALID_ARG" in str(e.status) or e.status in ("400", "StatusCode.INVALID_ARGUMENT"):
        param = next((p for p in params if p.upper() in message.upper()), None)
        return invalid(message, body_field(param))
    return APIError(BACKEND, message)


async def json_body(request: Request) -> object:
    try:
        return await request.json()
    except ValueError:
        raise invalid("request body is not valid JSON") from None
