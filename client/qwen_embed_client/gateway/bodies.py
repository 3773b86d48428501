"""Request bodies as pydantic models: each API's routes declare theirs beside them (openai.py,
tei.py, cohere.py, score.py), on the bases and field types here.

A model states a body's shape (its fields, their JSON types, the API's enumerations); the
request contract (contract.py) keeps every rule on the values and every limit: the models map
onto `EmbedOptions` / `RerankOptions` and take the contract's option fields by name
(`contract_options`), so an option is typed once. A refused body is one APIError naming the
field, in the API's own words (`Body.QUOTE`, `Body.PREFIX`).
"""

from __future__ import annotations

import typing
from typing import Annotated, ClassVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from ..contract import MAX_INPUTS, is_utf8
from .errors import EMPTY, INVALID, APIError

INT32 = 2**31


def described(kind, message: str):
    """`kind`, refused with `message` (a union's errors, member by member, say nothing)."""

    def check(value, handler):
        try:
            return handler(value)
        except ValidationError as e:
            # a text's or an id's own fault is told as it is, with the item named
            for error in e.errors():
                if error["type"] in _OWN:
                    where = "".join(f"[{p}]" for p in error["loc"] if isinstance(p, int))
                    item = {"item": where}
                    raise PydanticCustomError(error["type"], error["msg"], item) from None
            raise PydanticCustomError("described", message) from None

    return Annotated[kind, WrapValidator(check)]


def _utf8(text: str) -> str:
    if not is_utf8(text):
        raise PydanticCustomError("utf8", "is not valid UTF-8 (a lone surrogate)")
    return text


def _ids(ids: list[int]) -> list[int]:
    bad = next((t for t in ids if not -INT32 <= t < INT32), None)
    if bad is not None:  # no vocabulary reaches it, and the wire cannot carry it
        raise PydanticCustomError("token_id", f"holds token id {bad}, outside any vocabulary")
    return ids


_OWN = ("utf8", "token_id", "qwen_input", "blank")
Text = Annotated[str, AfterValidator(_utf8)]
TokenIds = Annotated[list[int], Field(min_length=1), AfterValidator(_ids)]


def at_most(limit: int):
    """A list of at most `limit` items, at least one (see `_message`)."""
    return Field(min_length=1, max_length=limit)


Texts = Annotated[list[Text], at_most(MAX_INPUTS)]
Chunk = Annotated[Text, Field(min_length=1)]  # one of a document's chunks, in order


# What an embeddings route embeds: a text, texts, the model's own token ids (as vLLM takes
# them), or lists of them.
def batch(value: str | list) -> list:
    """One input or a list of them -> the list, of 1 to MAX_INPUTS items."""
    items = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else value
    if not items:
        raise PydanticCustomError("too_short", "cannot be empty")
    if len(items) > MAX_INPUTS:
        raise PydanticCustomError(
            "too_long",
            "holds {actual_length} items, more than the limit of {max_length}",
            {"actual_length": len(items), "max_length": MAX_INPUTS},
        )
    return items


# What an embeddings route embeds: a text, texts, the model's own token ids (as vLLM takes
# them), or lists of them; always a list once validated.
Inputs = Annotated[
    described(
        Text | list[Text] | TokenIds | list[TokenIds],
        "must be a string, a list of strings, the model's token ids (a list of integers) or "
        "a list of such lists (not a mix of texts and ids)",
    ),
    AfterValidator(batch),
]


TextInputs = Annotated[
    described(Text | list[Text], "must be a string or a non-empty list of strings"),
    AfterValidator(batch),
]


def _nonblank(text: str) -> str:
    if not text.strip():
        raise PydanticCustomError("blank", "must be a non-empty string")
    return text


NonBlank = Annotated[Text, AfterValidator(_nonblank)]


def _distinct(items: list) -> list:
    if len(set(items)) != len(items):
        raise PydanticCustomError("distinct", "must hold distinct values")
    return items


def distinct(kind):
    """A non-empty list of distinct `kind` values (embedding types)."""
    return Annotated[list[kind], Field(min_length=1), AfterValidator(_distinct)]


def token_ids(items: list) -> bool:
    """Whether validated `Inputs` are token id lists."""
    return isinstance(items[0], list) and isinstance(items[0][0], int)


def contract_options(options: type, names: tuple[str, ...]) -> dict:
    """Body fields for the contract's options `names`, typed as the contract types them (the
    contract checks their values), each optional: absent, the contract's default holds."""
    hints = typing.get_type_hints(options)
    return {name: (hints[name] | None, None) for name in names}


def one_of(body: BaseModel, *names: str) -> None:
    """Exactly one of the fields `names` given (a model validator's check)."""
    if [getattr(body, n) for n in names].count(None) != len(names) - 1:
        quoted = ", ".join(f"'{n}'" for n in names[:-1]) + f" and '{names[-1]}'"
        raise PydanticCustomError("one_of", f"send one of {quoted}")


class Body(BaseModel):
    """A request body: JSON types as sent (no coercion: "8" is not a dimension), unknown
    fields ignored (as each API's own server does)."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)
    QUOTE: ClassVar[str] = "'{}'"  # how the API's messages name a field
    PREFIX: ClassVar[str] = ""  # and how they begin

    @classmethod
    def parse(cls, body: object):
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            raise cls._refusal(e.errors()[0]) from None

    @classmethod
    def _refusal(cls, error: dict) -> APIError:
        # a content part's tag ("text", "image_url") enters the path before its field of
        # the same name: said once
        loc = [str(p) for i, p in enumerate(error["loc"]) if i == 0 or p != error["loc"][i - 1]]
        if not loc:  # the body itself: not an object, or a rule across its fields (its
            # context may name the field the refusal is about: `param`)
            whole = error["type"] in ("model_type", "model_attributes_type", "dict_type")
            message = "request body must be a JSON object" if whole else error["msg"]
            return APIError(INVALID, cls.PREFIX + message, (error.get("ctx") or {}).get("param"))
        name = loc[0] + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc[1:])
        name += (error.get("ctx") or {}).get("item", "")
        # an empty list of what to embed or score (not of an item's parts): nothing to do
        empty = error["type"] == "too_short" and not any(p.isdigit() for p in loc)
        kind = EMPTY if empty else INVALID
        message = f"{cls.PREFIX}{cls.QUOTE.format(name)} {_message(error)}"
        return APIError(kind, message, loc[0])

    def given(self, *names: str) -> dict:
        """The fields among `names` the body gives (not null)."""
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


_TYPES = {
    "string_type": "a string",
    "int_type": "an integer",
    "bool_type": "a boolean",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
}


def _message(error: dict) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in _TYPES:
        return f"must be {_TYPES[kind]}"
    if kind == "literal_error":
        return f"must be one of [{ctx['expected'].replace(' or ', ', ')}]"
    if kind == "too_long":
        return f"holds {ctx['actual_length']} items, more than the limit of {ctx['max_length']}"
    if kind == "too_short":
        return "cannot be empty"
    if kind == "missing":
        return "is required"
    if kind in ("greater_than_equal", "greater_than"):
        return f"must be {'>=' if kind == 'greater_than_equal' else '>'} {next(iter(ctx.values()))}"
    return error["msg"]
