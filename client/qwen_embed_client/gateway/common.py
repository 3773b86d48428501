"""What the APIs' handlers share (openai.py, tei.py, cohere.py and the Batch API): the model
check, the call to the Triton client with the API's own errors, and the encodings of a
vector and of a text's usage."""

from __future__ import annotations

import base64

from ..client import EmbeddingError, EmbeddingResult
from .errors import NOT_FOUND, APIError, backend_error


def check_model(model: object, served_model: str | None) -> None:
    if not served_model or model != served_model:
        serves = f"this endpoint serves '{served_model}'" if served_model else "it is off here"
        raise APIError(NOT_FOUND, f"The model '{model}' does not exist; {serves}", "model")


async def embed(gw, inputs: list, options: dict, kinds: list[str], params=("dimensions",)):
    """Every type asked for from one computation of the vectors, in one Triton request per
    chunk of the inputs (the client splits), with the API's own errors."""
    try:
        return await gw.client.embed_with_usage(
            inputs, **options, embedding_type=",".join(kinds), headers=gw.outgoing()
        )
    except EmbeddingError as e:
        raise backend_error(e, params) from e


def encode_value(vector, encoding: str):
    if encoding == "base64":  # the vector's bytes: little-endian float32, or the codes
        return base64.b64encode(vector.astype(vector.dtype.newbyteorder("<")).tobytes()).decode()
    return vector.tolist()


def text_usage(result: EmbeddingResult, i: int) -> dict:
    """One text's tokens: used, before truncation, and whether it was cut (an extension)."""
    used, given = int(result.token_counts[i]), int(result.input_tokens[i])
    return {"tokens": used, "input_tokens": given, "truncated": given > used}
