"""Images in request bodies, for a multimodal model: content parts as OpenAI's chat API and
vLLM's multimodal embeddings write them ({"type": "text", "text"} and {"type": "image_url",
"image_url": {"url"}}), as Cohere v2's `inputs` do. Each input becomes one text (its text parts
joined) and its images, which the server places before the text as the model's own script
does.

An image URL is a data URL (`data:image/png;base64,...`), always taken; a remote one
(http/https) is fetched only where the gateway was started with --allow-remote-images, within
MAX_IMAGE_BYTES and a timeout.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
import urllib.request
from typing import Annotated, Literal

from pydantic import Field

from ..contract import MAX_IMAGE_BYTES, MAX_IMAGES_PER_TEXT
from .bodies import Body, Text
from .errors import invalid

FETCH_TIMEOUT_S = 10.0
_DATA_URL = re.compile(
    r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*),(?P<data>.*)$", re.S
)


class ImageURL(Body):
    url: str


class TextPart(Body):
    type: Literal["text"]
    text: Text


class ImagePart(Body):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]
Parts = Annotated[list[Part], Field(min_length=1)]


class Message(Body):
    """vLLM's chat form of an embeddings request: the system turn is the instruction, the
    user turn the input."""

    role: Literal["system", "user"]
    content: Text | Parts


def has_parts(items: list) -> bool:
    """Whether validated inputs hold content parts (else texts or token ids)."""
    return any(isinstance(item, list) and item and isinstance(item[0], Body) for item in items)


async def texts_and_images(
    items: list, name: str, allow_remote: bool
) -> tuple[list[str], list[list[bytes]]]:
    """Inputs (texts, or lists of content parts) -> (texts, each one's image files)."""
    texts, images = [], []
    for i, item in enumerate(items):
        if isinstance(item, str):
            texts.append(item)
            images.append([])
            continue
        urls = [p.image_url.url for p in item if isinstance(p, ImagePart)]
        if len(urls) > MAX_IMAGES_PER_TEXT:
            raise invalid(
                f"'{name}[{i}]' holds {len(urls)} images, more than the limit of "
                f"{MAX_IMAGES_PER_TEXT}",
                name,
            )
        texts.append("".join(p.text for p in item if isinstance(p, TextPart)))
        images.append([await image_bytes(u, f"{name}[{i}]", allow_remote) for u in urls])
    return texts, images


async def image_bytes(url: str, where: str, allow_remote: bool) -> bytes:
    """An image URL's file: a data URL's bytes, or a remote file where that is allowed."""
    data = _DATA_URL.match(url)
    if data is not None:
        if ";base64" not in data.group("params"):
            raise invalid(f"'{where}' image data URL must be base64", where.split("[")[0])
        try:
            raw = base64.b64decode(data.group("data"), validate=True)
        except (binascii.Error, ValueError):
            message = f"'{where}' image data URL is not valid base64"
            raise invalid(message, where.split("[")[0]) from None
        return _within_limit(raw, where)
    if not url.startswith(("http://", "https://")):
        raise invalid(
            f"'{where}' image URL must be a data URL (data:image/...;base64,...) or http(s)",
            where.split("[")[0],
        )
    if not allow_remote:
        raise invalid(
            f"'{where}' remote image URLs are not allowed here (the gateway's "
            "--allow-remote-images); send the image as a data URL",
            where.split("[")[0],
        )
    try:
        raw = await asyncio.to_thread(_fetch, url)
    except OSError as e:
        raise invalid(f"'{where}' image could not be fetched: {e}", where.split("[")[0]) from None
    return _within_limit(raw, where)


def _fetch(url: str) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": "qwen-embed-gateway"})
    with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as response:
        return response.read(MAX_IMAGE_BYTES + 1)


def _within_limit(raw: bytes, where: str) -> bytes:
    if len(raw) > MAX_IMAGE_BYTES:
        raise invalid(
            f"'{where}' image is more than the limit of {MAX_IMAGE_BYTES} bytes",
            where.split("[")[0],
        )
    if not raw:
        raise invalid(f"'{where}' image is empty", where.split("[")[0])
    return raw
