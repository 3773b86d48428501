"""Images and videos in request bodies, for a multimodal model: content parts as OpenAI's chat
API and vLLM's multimodal embeddings write them ({"type": "text", "text"}, {"type":
"image_url", "image_url": {"url"}} and vLLM's {"type": "video_url", "video_url": {"url"}}), as
Cohere v2's `inputs` do. Each input becomes one text (its text parts joined), its images and its
videos, which the server places before the text as the model's own script does.

A URL is a data URL (`data:image/png;base64,...`, `data:video/mp4;base64,...`), always taken; a
remote one (http/https) is fetched only where the gateway was started with
--allow-remote-images, within MAX_IMAGE_BYTES (MAX_VIDEO_BYTES) and a timeout.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
import urllib.request
from typing import Annotated, Literal

from pydantic import Field

from ..contract import MAX_IMAGE_BYTES, MAX_IMAGES_PER_TEXT, MAX_VIDEO_BYTES, MAX_VIDEOS_PER_TEXT
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


class VideoPart(Body):
    type: Literal["video_url"]
    video_url: ImageURL


Part = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]
Parts = Annotated[list[Part], Field(min_length=1)]


class Message(Body):
    """vLLM's chat form of an embeddings request: the system turn is the instruction, the
    user turn the input."""

    role: Literal["system", "user"]
    content: Text | Parts


def has_parts(items: list) -> bool:
    """Whether validated inputs hold content parts (else texts or token ids)."""
    return any(isinstance(item, list) and item and isinstance(item[0], Body) for item in items)


# Per kind: its part's class and URL field, the files one input may hold, each one's bytes.
KINDS = {
    "image": (ImagePart, "image_url", MAX_IMAGES_PER_TEXT, MAX_IMAGE_BYTES),
    "video": (VideoPart, "video_url", MAX_VIDEOS_PER_TEXT, MAX_VIDEO_BYTES),
}


async def texts_and_media(
    items: list, name: str, allow_remote: bool
) -> tuple[list[str], list[list[bytes]], list[list[bytes]]]:
    """Inputs (texts, or lists of content parts) -> (texts, each one's image files, each
    one's video files)."""
    texts, files = [], {kind: [] for kind in KINDS}
    for i, item in enumerate(items):
        if isinstance(item, str):
            texts.append(item)
            for found in files.values():
                found.append([])
            continue
        texts.append("".join(p.text for p in item if isinstance(p, TextPart)))
        for kind, (part, field, most, _) in KINDS.items():
            urls = [getattr(p, field).url for p in item if isinstance(p, part)]
            if len(urls) > most:
                raise invalid(
                    f"'{name}[{i}]' holds {len(urls)} {kind}s, more than the limit of {most}",
                    name,
                )
            where = f"{name}[{i}]"
            files[kind].append([await file_bytes(u, where, kind, allow_remote) for u in urls])
    return texts, files["image"], files["video"]


async def file_bytes(url: str, where: str, kind: str, allow_remote: bool) -> bytes:
    """An image's or video's URL -> its file: a data URL's bytes, or a remote file where that
    is allowed."""
    field = where.split("[")[0]
    data = _DATA_URL.match(url)
    if data is not None:
        if ";base64" not in data.group("params"):
            raise invalid(f"'{where}' {kind} data URL must be base64", field)
        try:
            raw = base64.b64decode(data.group("data"), validate=True)
        except (binascii.Error, ValueError):
            raise invalid(f"'{where}' {kind} data URL is not valid base64", field) from None
        return _within_limit(raw, where, kind)
    if not url.startswith(("http://", "https://")):
        raise invalid(
            f"'{where}' {kind} URL must be a data URL (data:{kind}/...;base64,...) or http(s)",
            field,
        )
    if not allow_remote:
        raise invalid(
            f"'{where}' remote {kind} URLs are not allowed here (the gateway's "
            f"--allow-remote-images); send the {kind} as a data URL",
            field,
        )
    try:
        raw = await asyncio.to_thread(_fetch, url, KINDS[kind][3])
    except OSError as e:
        raise invalid(f"'{where}' {kind} could not be fetched: {e}", field) from None
    return _within_limit(raw, where, kind)


def _fetch(url: str, limit: int) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": "qwen-embed-gateway"})
    with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as response:
        return response.read(limit + 1)


def _within_limit(raw: bytes, where: str, kind: str) -> bytes:
    limit = KINDS[kind][3]
    if len(raw) > limit:
        raise invalid(
            f"'{where}' {kind} is more than the limit of {limit} bytes", where.split("[")[0]
        )
    if not raw:
        raise invalid(f"'{where}' {kind} is empty", where.split("[")[0])
    return raw
