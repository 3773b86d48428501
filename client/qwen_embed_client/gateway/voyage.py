"""Voyage AI's multimodal and contextualized chunk embeddings. The multimodal API, what its
`voyageai` SDK's `multimodal_embed` posts:
POST /v1/multimodalembeddings, {inputs: [{content: [{type: "text", text} | {type: "image_url",
image_url} | {type: "image_base64", image_base64: a data URL}]}], model, input_type,
truncation, output_dtype, output_dimension, output_encoding} -> {object: "list", data:
[{object: "embedding", index, embedding}], model, usage: {text_tokens, image_pixels,
video_pixels, total_tokens}}.

Each input is one vector of a multimodal model, read as /v1/embeddings reads the same content
parts (its images before its text, as the model's own script places them), with the same
options: Voyage's fields there are openai.py's. `usage` counts in `total_tokens` and
`text_tokens` the tokens the model read, its images' among them (the server counts no share
apart), and in `image_pixels` the images' pixels as sent. Video parts are refused here
(their pixels are known only once the server has sampled them): /v1/embeddings takes them as
`video_url` parts. Errors in OpenAI's shape, naming `inputs`.

Its contextualized chunk embeddings, what `contextualized_embed` posts to Perplexity's route
(perplexity.py, which hands a body with `inputs` here): {inputs: [[chunk, ...], ...], model,
input_type, output_dtype, output_dimension, encoding_format} -> that route's answer, each
chunk's vector in the context of its document's other chunks (a model with a chunk separator,
as pplx-embed-context), normalised as Voyage's are; the codes made here of those vectors (the
server makes a contextual model's floats only). Server-side chunking
(`enable_auto_chunking`) is refused: the SDK's `chunk_fn` chunks on the client."""

from __future__ import annotations

import io
import re
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from PIL import Image
from pydantic import ConfigDict, Field

from ..contract import EMBEDDING_TYPES, MAX_CHUNKS, MAX_INPUTS, compact
from .bodies import Body, Chunk, Text, at_most
from .common import (
    Encoding,
    contextual_answer,
    contextual_chunks,
    model_adapter,
    prompt_options,
)
from .errors import APIError, invalid, named_as_sent, options_checked
from .media import ImagePart, ImageURL, TextPart, texts_and_media
from .openai import VOYAGE_FIELDS, embeddings_body
from .state import answered_adapter, respond, routed

DOCUMENTS_PER_REQUEST = 1000  # as Voyage's API takes them

router = APIRouter(tags=["openai"])


class _Segment(Body):
    model_config = ConfigDict(extra="forbid")  # as Voyage's SDK checks its segments


class TextSegment(_Segment):
    type: Literal["text"]
    text: Text


class ImageURLSegment(_Segment):
    type: Literal["image_url"]
    image_url: str


class ImageBase64Segment(_Segment):
    type: Literal["image_base64"]
    image_base64: str


class VideoSegment(_Segment):
    type: Literal["video_url", "video_base64"]
    video_url: str | None = None
    video_base64: str | None = None


Segment = Annotated[
    TextSegment | ImageURLSegment | ImageBase64Segment | VideoSegment,
    Field(discriminator="type"),
]


class MultimodalInput(Body):
    content: Annotated[list[Segment], Field(min_length=1)]


class MultimodalRequest(Body):
    inputs: Annotated[list[MultimodalInput], at_most(MAX_INPUTS)]
    model: str | None = None
    # the embeddings body's fields, checked there
    input_type: object = None
    truncation: object = None
    output_dtype: object = None
    output_dimension: object = None
    output_encoding: Literal["base64"] | None = None


@router.post("/v1/multimodalembeddings")
async def multimodal_embeddings(request: Request):
    gw, body = await routed(request)
    asked = MultimodalRequest.parse(body)
    inputs = []
    for i, item in enumerate(asked.inputs):
        if any(isinstance(segment, VideoSegment) for segment in item.content):
            raise invalid(
                f"'inputs[{i}]' holds a video: videos are taken as 'video_url' content parts "
                "of POST /v1/embeddings",
                "inputs",
            )
        inputs.append([_part(segment) for segment in item.content])
    # the files read once, here: their pixels counted, then embedded as they are
    media = await texts_and_media(inputs, "inputs", gw.remote_media)
    pixels = sum(_pixels(image) for images in media[1] for image in images)
    body = asked.given("model", "input_type", "truncation", "output_dtype", "output_dimension")
    parts = [[part.model_dump() for part in item] for item in inputs]
    body |= {"input": parts, "encoding_format": asked.output_encoding or "float"}
    try:
        answer = await embeddings_body(gw, body, media=media)
    except APIError as e:
        raise APIError(e.kind, _as_inputs(e.message), _as_inputs(e.param), e.api) from None
    tokens = answer["usage"]["total_tokens"]
    answer["data"] = [{k: d[k] for k in ("object", "index", "embedding")} for d in answer["data"]]
    answer["usage"] = {
        "text_tokens": tokens,
        "image_pixels": pixels,
        "video_pixels": 0,
        "total_tokens": tokens,
    }
    return await respond(gw, answer, adapter=answered_adapter(gw, answer))


def _part(segment: _Segment) -> TextPart | ImagePart:
    """A text or image segment as the content part /v1/embeddings reads."""
    if isinstance(segment, TextSegment):
        return TextPart(type="text", text=segment.text)
    return ImagePart(type="image_url", image_url=ImageURL(url=getattr(segment, segment.type)))


def _pixels(image: bytes) -> int:
    """An image's pixels from its header (the server reads and refuses what cannot be read:
    such an image counts none here)."""
    try:
        with Image.open(io.BytesIO(image)) as opened:
            return opened.width * opened.height
    except (OSError, ValueError, Image.DecompressionBombError):
        return 0


def _as_inputs(words: str | None) -> str | None:
    """A message or param naming the embeddings body's `input` ('input[2]'), naming this
    body's `inputs` instead."""
    if words == "input":
        return "inputs"
    return None if words is None else re.sub(r"'input(?=['\[])", "'inputs", words)


class ContextualizedRequest(Body):
    inputs: Annotated[
        list[Annotated[list[Chunk], at_most(MAX_CHUNKS)]], at_most(DOCUMENTS_PER_REQUEST)
    ]
    model: str | None = None
    input_type: Literal["query", "document"] | None = None
    output_dtype: Literal[EMBEDDING_TYPES] | None = None
    output_dimension: int | None = None
    encoding_format: Literal["base64"] | None = None
    enable_auto_chunking: bool = False
    chunk_size: object = None
    chunk_overlap: object = None


async def contextualized_embeddings(gw, body: dict) -> dict:
    """POST /v1/contextualizedembeddings in Voyage's form (perplexity.py's route)."""
    asked = ContextualizedRequest.parse(body)
    chunking = ("enable_auto_chunking", "chunk_size", "chunk_overlap")
    auto = [k for k in chunking if getattr(asked, k) not in (None, False)]
    if auto:
        raise invalid(
            f"'{auto[0]}' is not served: send each document as its chunks (the SDK's chunk_fn "
            "chunks on the client)",
            auto[0],
        )
    adapter = await model_adapter(gw, asked.model, gw.model_names)
    options = {"adapter": adapter} if adapter else {}
    if asked.input_type is not None:
        facts = await gw.facts()
        options |= prompt_options(asked.input_type, facts.get("prompt_names", []), {})
    if asked.output_dimension is not None:
        options["dimensions"] = asked.output_dimension
    named = {k: v for k, v in VOYAGE_FIELDS.items() if k in options}
    try:
        options = options_checked(**options)
        results = await contextual_chunks(gw, asked.inputs, options, asked.model, "inputs")
    except APIError as e:
        raise named_as_sent(e, named) from None
    encode = Encoding(asked.encoding_format or "float")
    kind = asked.output_dtype or "float"
    vectors = [[encode(v) for v in compact(r.embeddings, kind)] for r in results]
    return contextual_answer(vectors, results, adapter or gw.model_name)
