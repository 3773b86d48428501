"""Google's Gemini API embeddings, what the `google-genai` SDK's `models.embed_content` (the
Gemini Developer API: `genai.Client(api_key=KEY, http_options={"base_url": GATEWAY})`) and
LangChain's GoogleGenerativeAIEmbeddings send:

- POST /v1beta/models/{model}:batchEmbedContents (and /v1/...): {requests: [{model:
  "models/{model}", content: {parts: [...]}, taskType, title, outputDimensionality}]} ->
  {embeddings: [{values}], usageMetadata: {promptTokenCount, totalTokenCount}}.
- POST /v1beta/models/{model}:embedContent: one request's fields -> {embedding: {values},
  usageMetadata}.
- GET /v1beta/models and /v1beta/models/{model}: the served embedders as Gemini describes a
  model (`supportedGenerationMethods`, `inputTokenLimit`); also GET /v1/models... (the SDK's
  default version), OpenAI's routes, for a request from Google's clients (`from_google`).

The URL's model picks the served model (served.ServedModels, as Azure's deployment does); a
request naming another is refused. A content's `text` parts are joined; for a multimodal model
`inlineData` ({mimeType, data}: an image's or a video's file in base64) and `fileData`
({mimeType, fileUri}: an http(s) URL, fetched where the gateway allows it) are its images and
videos (media.py). `taskType` picks the checkpoint's prompt as Cohere's input types do
(common.prompt_options); `outputDimensionality` keeps the first dimensions (Matryoshka), of a
unit vector as every dimension count is here (Gemini leaves a shortened vector unnormalized:
cosines are the same). `title` is refused: no served model reads one (put it in the text). The
key comes in Google's `x-goog-api-key` header (state.py). Errors are Google's {"error": {code,
message, status}}.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, AliasChoices, Field, model_validator
from pydantic_core import PydanticCustomError

from ..contract import MAX_INPUTS
from . import keys
from .bodies import Body, Text
from .common import (
    TASK_INSTRUCTIONS,
    checkpoint_facts,
    embed,
    model_adapter,
    prompt_options,
    unknown_model,
)
from .errors import STATUS, APIError, invalid, named_as_sent, options_checked
from .media import ImagePart, ImageURL, TextPart, VideoPart, texts_and_media
from .state import respond, routed

router = APIRouter(tags=["gemini"])

# Google's status names of the HTTP statuses the gateway answers
STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}
TASK_TYPES = (
    "TASK_TYPE_UNSPECIFIED",
    "RETRIEVAL_QUERY",
    "RETRIEVAL_DOCUMENT",
    "SEMANTIC_SIMILARITY",
    "CLASSIFICATION",
    "CLUSTERING",
    "QUESTION_ANSWERING",
    "FACT_VERIFICATION",
    "CODE_RETRIEVAL_QUERY",
)
TASK_PROMPTS = {"RETRIEVAL_QUERY": "query", "RETRIEVAL_DOCUMENT": "document"}
TASKS = {
    "SEMANTIC_SIMILARITY": TASK_INSTRUCTIONS["similarity"],
    "CLASSIFICATION": TASK_INSTRUCTIONS["classification"],
    "CLUSTERING": TASK_INSTRUCTIONS["clustering"],
    "QUESTION_ANSWERING": TASK_INSTRUCTIONS["question_answering"],
    "FACT_VERIFICATION": TASK_INSTRUCTIONS["fact_verification"],
    "CODE_RETRIEVAL_QUERY": TASK_INSTRUCTIONS["code_retrieval"],
}


def error_response(e: APIError) -> JSONResponse:
    status = STATUS[e.kind]
    error = {"code": status, "message": e.message, "status": STATUS_NAMES.get(status, "UNKNOWN")}
    return JSONResponse({"error": error}, status_code=status)


def _camel(name: str, camel: str):
    """An optional field Google's JSON takes in either case (its SDKs send camelCase)."""
    return Field(default=None, validation_alias=AliasChoices(camel, name))


def _no_title(title: str) -> str:
    raise PydanticCustomError("title", "is read by no model served here: put it in the text")


class Blob(Body):
    mime_type: str = Field(validation_alias=AliasChoices("mimeType", "mime_type"))
    data: str


class FileData(Body):
    mime_type: str | None = _camel("mime_type", "mimeType")
    file_uri: str = Field(validation_alias=AliasChoices("fileUri", "file_uri"))


class Part(Body):
    text: Text | None = None
    inline_data: Blob | None = _camel("inline_data", "inlineData")
    file_data: FileData | None = _camel("file_data", "fileData")

    @model_validator(mode="after")
    def _one(self):
        if [self.text, self.inline_data, self.file_data].count(None) != 2:
            raise PydanticCustomError(
                "one_of", "must hold one of 'text', 'inlineData' and 'fileData'"
            )
        return self

    def content_part(self) -> TextPart | ImagePart | VideoPart:
        """The part as media.py's content parts: a file as a data URL, or its URL."""
        if self.text is not None:
            return TextPart(type="text", text=self.text)
        if self.inline_data is not None:
            blob = self.inline_data
            url, mime = f"data:{blob.mime_type};base64,{_standard(blob.data)}", blob.mime_type
        else:
            url, mime = self.file_data.file_uri, self.file_data.mime_type or ""
        if mime.startswith("video/"):
            return VideoPart(type="video_url", video_url=ImageURL(url=url))
        return ImagePart(type="image_url", image_url=ImageURL(url=url))


def _standard(data: str) -> str:
    """Bytes in base64 as Google's JSON takes them (proto3's: standard or URL-safe, padded or
    not; its Python SDK sends URL-safe) -> standard base64, padded."""
    data = data.replace("-", "+").replace("_", "/")
    return data + "=" * (-len(data) % 4)


class Content(Body):
    parts: Annotated[list[Part], Field(min_length=1)]
    role: str | None = None


class EmbedContentRequest(Body):
    model: str | None = None
    content: Content
    task_type: Literal[TASK_TYPES] | None = _camel("task_type", "taskType")
    title: Annotated[str, AfterValidator(_no_title)] | None = None
    output_dimensionality: int | None = _camel("output_dimensionality", "outputDimensionality")


class BatchEmbedContentsRequest(Body):
    requests: Annotated[list[EmbedContentRequest], Field(min_length=1, max_length=MAX_INPUTS)]


@router.post("/v1beta/models/{model:path}:batchEmbedContents")
@router.post("/v1/models/{model:path}:batchEmbedContents")
async def batch_embed_contents(request: Request, model: str):
    gw, body = await routed(request, model=model)
    asked = BatchEmbedContentsRequest.parse(body)
    answer, adapter = await _embeddings(gw, model, asked.requests, "requests")
    return await respond(gw, answer, adapter=adapter)


@router.post("/v1beta/models/{model:path}:embedContent")
@router.post("/v1/models/{model:path}:embedContent")
async def embed_content(request: Request, model: str):
    gw, body = await routed(request, model=model)
    asked = EmbedContentRequest.parse(body)
    answer, adapter = await _embeddings(gw, model, [asked], "content")
    body = {"embedding": answer["embeddings"][0], "usageMetadata": answer["usageMetadata"]}
    return await respond(gw, body, adapter=adapter)


async def _embeddings(gw, model: str, requests: list, field: str) -> tuple[dict, str | None]:
    """({embeddings, usageMetadata}, the adapter answering) of `requests` (`field`: the body's
    field of them): one embedding call per set of options among them (a task type, a
    dimension count)."""
    adapter = await model_adapter(gw, model, gw.model_names)
    for i, one in enumerate(requests):
        if one.model is not None and one.model.removeprefix("models/") != model:
            where = f"requests[{i}].model" if field == "requests" else "model"
            raise invalid(f"'{where}' names {one.model!r}, not the URL's 'models/{model}'", field)
    inputs = [[p.content_part() for p in one.content.parts] for one in requests]
    texts, images, videos = await texts_and_media(inputs, field, gw.remote_media)
    groups: dict[tuple, list[int]] = {}
    for i, one in enumerate(requests):
        groups.setdefault((one.task_type, one.output_dimensionality), []).append(i)

    async def embedded(task_type, dimensions, indices):
        options = {"adapter": adapter} if adapter else {}
        if dimensions is not None:
            options["dimensions"] = dimensions
        prompt_names = (await checkpoint_facts(gw, task_type)).get("prompt_names", [])
        options |= prompt_options(task_type, prompt_names, TASK_PROMPTS, TASKS)
        media = {
            "images": [images[i] for i in indices] if any(images) else None,
            "videos": [videos[i] for i in indices] if any(videos) else None,
        }
        whole = indices == list(range(len(requests)))  # one set of options: the usual batch
        item = field if whole else (lambda k: f"{field}[{indices[k]}]")
        try:
            options = options_checked(**options)
            picked = [texts[i] for i in indices]
            return await embed(gw, picked, options, ["float"], item, ("dimensions",), **media)
        except APIError as e:
            raise named_as_sent(e, {"dimensions": "outputDimensionality"}) from None

    results = await asyncio.gather(*(embedded(*key, ix) for key, ix in groups.items()))
    values: list = [None] * len(requests)
    tokens = 0
    for indices, result in zip(groups.values(), results, strict=True):
        tokens += result.total_tokens
        for i, vector in zip(indices, result.embeddings, strict=True):
            values[i] = {"values": vector}
    usage = {"promptTokenCount": tokens, "totalTokenCount": tokens}
    return {"embeddings": values, "usageMetadata": usage}, adapter


def from_google(request: Request) -> bool:
    """A request from Google's clients (their SDKs send x-goog-api-client, Google's documented
    calls x-goog-api-key), which GET /v1/models answers in Gemini's shape, not OpenAI's."""
    return "x-goog-api-client" in request.headers or "x-goog-api-key" in request.headers


@router.get("/v1beta/models")
async def list_models(request: Request):
    return {"models": [m for gw in keys.embedders(request) for m in await _described(gw)]}


@router.get("/v1beta/models/{model:path}")
async def get_model(request: Request, model: str):
    served = {}
    for gw in keys.embedders(request):
        served |= {m["name"].removeprefix("models/"): m for m in await _described(gw)}
    if model not in served:
        refused = unknown_model(model, tuple(served))
        refused.api = "gemini"  # in Google's shape on OpenAI's GET /v1/models/{model} too
        raise refused
    return served[model]


async def _described(gw) -> list[dict]:
    """An embedder's names (and its adapters') as Gemini's models.list describes a model."""
    facts = await gw.facts()
    adapters = facts.get("route", {}).get("lora_names", [])
    return [
        {
            "name": f"models/{name}",
            "baseModelId": gw.model_name,
            "version": "1",
            "displayName": name,
            "description": "an embedding model served by qwen-embed",
            "inputTokenLimit": facts.get("tokens_per_text"),
            "outputTokenLimit": 1,
            "supportedGenerationMethods": ["embedContent", "batchEmbedContents"],
        }
        for name in [*gw.model_names, *adapters]
    ]
