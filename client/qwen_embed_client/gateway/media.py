"""Images and videos in request bodies, for a multimodal model: content parts as OpenAI's chat
API and vLLM's multimodal embeddings write them ({"type": "text", "text"}, {"type":
"image_url", "image_url": {"url"}} and vLLM's {"type": "video_url", "video_url": {"url"}}), as
Cohere v2's `inputs` do, and a video as its frames as Qwen's own API takes it ({"type": "video",
"video": [url of each frame's image, ...]}), or an input as Qwen3-VL-Embedding's own scripts
write it ({"text", "image", "video"}: QwenInput; Jina's API writes its inputs so too, an image
also as its file's bytes in base64), or an image as Jina's older inputs and LlamaIndex's
JinaEmbedding write one ({"url"} or {"bytes"}: JinaImage). Each input becomes one text (its
text parts joined), its images and its videos (a file's bytes, or a list of its frames'
files), which the server places before the text as the model's own script does.

A URL is a data URL (`data:image/png;base64,...`, `data:video/mp4;base64,...`), always taken; a
remote one (http/https) is fetched only where the gateway was started with
--allow-remote-images or --allowed-media-domains, as remote_media.RemoteMedia allows, within
MAX_IMAGE_BYTES (MAX_VIDEO_BYTES) and a timeout.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from ..contract import (
    MAX_IMAGE_BYTES,
    MAX_IMAGES_PER_TEXT,
    MAX_VIDEO_BYTES,
    MAX_VIDEO_FRAMES,
    MAX_VIDEOS_PER_TEXT,
)
from .bodies import Body, Text
from .errors import invalid
from .remote_media import NotAllowed, RemoteMedia

FETCH_TIMEOUT_S = 10.0
_DATA_URL = re.compile(
    r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*),(?P<data>.*)$", re.S
)
# A file's bytes in base64, as Jina's API takes an image (no URL, no path: '.' is not in it)
_BASE64 = re.compile(r"^[A-Za-z0-9+/\s]{16,}={0,2}$")


def _as_url(image: str) -> str:
    """An image as an input object gives it: a URL, or its bytes in base64 (a data URL)."""
    return f"data:;base64,{image}" if _BASE64.match(image) else image


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


class FramesPart(Body):
    """A video as its frames' image URLs, in order (the scripts' list of frames)."""

    type: Literal["video"]
    video: Annotated[list[str], Field(min_length=1, max_length=MAX_VIDEO_FRAMES)]


Part = Annotated[TextPart | ImagePart | VideoPart | FramesPart, Field(discriminator="type")]
MEDIA_PARTS = (ImagePart, VideoPart, FramesPart)
Parts = Annotated[list[Part], Field(min_length=1)]


# The scripts' per-input options -> the request option that holds each here.
REQUEST_OPTIONS = {
    "instruction": "instruction",
    "fps": "video_fps",
    "max_frames": "video_max_frames",
}


class ScriptInput(Body):
    """An input object that Qwen3-VL's scripts could have written (QwenInput, a rerank
    document): their per-input options are refused, naming the request's option."""

    instruction: object = None
    fps: object = None
    max_frames: object = None

    @model_validator(mode="after")
    def _no_input_options(self):
        for name, option in REQUEST_OPTIONS.items():
            if getattr(self, name) is not None:
                raise PydanticCustomError(
                    "qwen_input",
                    f"'{name}' is an option of the whole request here: send '{option}' beside "
                    "the inputs",
                )
        return self


class QwenInput(ScriptInput):
    """An input as Qwen3-VL-Embedding's scripts write one (format_model_input): `text`,
    `image` and `video`, each one or a list; a video is a file's URL or a list of its frames'
    image URLs, and a list whose first URL is an image's is one video's frames, as there. It
    stands for the same content parts (the server puts videos, then images, before the
    text, as the scripts do)."""

    model_config = ConfigDict(extra="forbid")  # a content part ({"type": ...}) is not one
    text: Text | list[Text] | None = None
    image: str | list[str] | None = None
    video: str | list[str | list[str]] | None = None

    @model_validator(mode="after")
    def _checked(self):
        if not (self.text or self.image or self.video):
            raise PydanticCustomError("qwen_input", "holds no 'text', 'image' or 'video'")
        return self

    def parts(self) -> list[TextPart | ImagePart | VideoPart | FramesPart]:
        videos = [] if self.video is None else _videos(self.video)
        parts = [
            FramesPart(type="video", video=v)
            if isinstance(v, list)
            else VideoPart(type="video_url", video_url=ImageURL(url=v))
            for v in videos
        ]
        images = [self.image] if isinstance(self.image, str) else self.image or []
        parts += [ImagePart(type="image_url", image_url=ImageURL(url=_as_url(u))) for u in images]
        texts = [self.text] if isinstance(self.text, str) else self.text or []
        return parts + [TextPart(type="text", text=t) for t in texts]


_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp", ".tiff", ".svg")


def _videos(video: str | list) -> list[str | list[str]]:
    """QwenInput's `video` -> its videos (a file's URL, or a list of frames' URLs)."""
    if isinstance(video, str):
        return [video]
    if video and isinstance(video[0], str) and _is_image(video[0]):
        if not all(isinstance(v, str) for v in video):
            raise PydanticCustomError("qwen_input", "'video' mixes frames and videos")
        return [video]  # one video, as its frames
    return video


def _is_image(url: str) -> bool:
    """An image's URL: a data URL of an image/ type, or a path with an image's suffix."""
    data = _DATA_URL.match(url)
    if data is not None:
        return (data.group("type") or "").startswith("image/")
    return url.split("?")[0].lower().endswith(_IMAGE_SUFFIXES)


QwenParts = Annotated[QwenInput, AfterValidator(QwenInput.parts)]


class JinaImage(Body):
    """An image as Jina's older inputs and LlamaIndex's JinaEmbedding write one: {"url"} or
    {"bytes": its file in base64}."""

    model_config = ConfigDict(extra="forbid")
    url: str | None = None
    bytes: str | None = None

    @model_validator(mode="after")
    def _one(self):
        if (self.url is None) == (self.bytes is None):
            raise PydanticCustomError("jina_image", "send 'url' or 'bytes' (one of them)")
        return self

    def parts(self) -> list[ImagePart]:
        url = self.url if self.url is not None else f"data:;base64,{self.bytes}"
        return [ImagePart(type="image_url", image_url=ImageURL(url=url))]


JinaParts = Annotated[JinaImage, AfterValidator(JinaImage.parts)]


class Message(Body):
    """vLLM's chat form of an embeddings request: the system turn is the instruction, the
    user turn the input."""

    role: Literal["system", "user"]
    content: Text | Parts


def has_parts(items: list) -> bool:
    """Whether validated inputs hold content parts (else texts or token ids)."""
    return any(isinstance(item, list) and item and isinstance(item[0], Body) for item in items)


# Per kind: the files one input may hold, and each one's bytes.
MOST = {"image": MAX_IMAGES_PER_TEXT, "video": MAX_VIDEOS_PER_TEXT}
LARGEST = {"image": MAX_IMAGE_BYTES, "video": MAX_VIDEO_BYTES}


async def texts_and_media(
    items: list, name: str, remote: RemoteMedia | None
) -> tuple[list[str], list[list[bytes]], list[list[bytes | list[bytes]]]]:
    """Inputs (texts, or lists of content parts) -> (texts, each one's image files, each
    one's videos: a file, or the list of its frames' files); `remote`: which remote URLs are
    fetched (None: none)."""
    texts, images, videos = [], [], []
    for i, item in enumerate(items):
        if isinstance(item, str):
            texts.append(item)
            images.append([])
            videos.append([])
            continue
        where = f"{name}[{i}]"
        texts.append("".join(p.text for p in item if isinstance(p, TextPart)))
        found = {
            "image": [p for p in item if isinstance(p, ImagePart)],
            "video": [p for p in item if isinstance(p, VideoPart | FramesPart)],
        }
        for kind, parts in found.items():
            if len(parts) > MOST[kind]:
                raise invalid(
                    f"'{where}' holds {len(parts)} {kind}s, more than the limit of {MOST[kind]}",
                    name,
                )
        images.append(
            [await file_bytes(p.image_url.url, where, "image", remote) for p in found["image"]]
        )
        videos.append(
            [
                await frame_files(p.video, f"{where} video {j}", remote)
                if isinstance(p, FramesPart)
                else await file_bytes(p.video_url.url, where, "video", remote)
                for j, p in enumerate(found["video"])
            ]
        )
    return texts, images, videos


async def frame_files(urls: list[str], where: str, remote: RemoteMedia | None) -> list[bytes]:
    """A video's frames' image URLs -> their files, together within MAX_VIDEO_BYTES."""
    files, total = [], 0
    for k, url in enumerate(urls):
        files.append(await file_bytes(url, f"{where} frame {k}", "image", remote))
        total += len(files[-1])
        if total > MAX_VIDEO_BYTES:
            raise invalid(
                f"'{where}' frames are more than the limit of {MAX_VIDEO_BYTES} bytes together",
                where.split("[")[0],
            )
    return files


async def file_bytes(url: str, where: str, kind: str, remote: RemoteMedia | None) -> bytes:
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
    if remote is None:
        raise invalid(
            f"'{where}' remote {kind} URLs are not allowed here (the gateway's "
            f"--allow-remote-images or --allowed-media-domains); send the {kind} as a data URL",
            field,
        )
    try:
        raw = await asyncio.to_thread(remote.fetch, url, LARGEST[kind], FETCH_TIMEOUT_S)
    except NotAllowed as e:
        raise invalid(f"'{where}' {kind} URL is not fetched here: {e}", field) from None
    except OSError as e:
        raise invalid(f"'{where}' {kind} could not be fetched: {e}", field) from None
    return _within_limit(raw, where, kind)


def _within_limit(raw: bytes, where: str, kind: str) -> bytes:
    limit = LARGEST[kind]
    if len(raw) > limit:
        raise invalid(
            f"'{where}' {kind} is more than the limit of {limit} bytes", where.split("[")[0]
        )
    if not raw:
        raise invalid(f"'{where}' {kind} is empty", where.split("[")[0])
    return raw
