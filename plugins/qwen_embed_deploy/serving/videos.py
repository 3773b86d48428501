"""Video bytes -> frames for the vision tower, as Qwen3-VL-Embedding's script prepares a video
file (its qwen-vl-utils, then Qwen3-VL's processor without resizing).

A file (MP4, WebM, MKV, ...: whatever FFmpeg reads, through PyAV) is read for its frame count
and rate; `fps` frames per second of it are kept (default `FPS`), at least `MIN_FRAMES`, at most
`max_frames` (default `MAX_FRAMES`), in whole temporal patches (`frame_count`), evenly spaced
(`frame_indices`); they are decoded to
RGB and resized together to one size of whole merge blocks (images.fit with a per-frame budget
of 128 to 768 text-model tokens, and less where many frames share `TOTAL_TOKENS`), bicubic with
antialiasing as torchvision resizes tensors. Each temporal patch (two frames) is one run of
placeholders after its timestamp, the mean of its frames' times (`placeholders`). The frames
travel to the encoder as uint8 like an image's, and are cut into patches there (`patchify`).

A video may also come as its frames (image files, contract.pack_frames), the scripts' list of
frames (`read_frames`): at most `max_frames` of them kept, evenly spaced (`sample_frames`), each
resized as an image of 4 to 16,384 tokens, an odd count made even with the last frame again,
then all resized together as a video's frames within the script's budget for such a list
(`FRAME_LIST_TOTAL_TOKENS`); the frames are half a second apart (qwen-vl-utils' sample_fps).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, replace

import numpy as np

from . import images
from .images import ImageSettings, fit

FPS = 1.0  # frames kept per second of video (the scripts' defaults; a request may ask others)
MIN_FRAMES, MAX_FRAMES = 4, 64
FRAME_MIN_TOKENS, FRAME_MAX_TOKENS = 128, 768  # per frame, before temporal merging
TOTAL_TOKENS = 115_200  # qwen-vl-utils' budget for a video's frames (0.9 x 128K)
# A list of frames: the embedding script's total_pixels (10 frames of 768 tokens), each frame
# first resized as an image of 4 to 16,384 tokens, FRAME_LIST_FPS frames a second.
FRAME_LIST_TOTAL_TOKENS = 10 * FRAME_MAX_TOKENS
FRAME_IMAGE_TOKENS = (4, 16_384)
FRAME_LIST_FPS = 2.0


@dataclass(frozen=True)
class Video:
    """A video's kept frames, resized: uint8 [frames, height, width, 3], and the time of each
    (seconds)."""

    frames: np.ndarray
    times: tuple[float, ...]


def frame_count(
    total: int, rate: float, temporal: int, fps: float = FPS, max_frames: int = MAX_FRAMES
) -> int:
    """Frames kept of a video of `total` frames at `rate` per second: `fps` per second, at most
    `max_frames` (qwen-vl-utils' smart_nframes)."""
    low = math.ceil(MIN_FRAMES / temporal) * temporal
    high = math.floor(max_frames / temporal) * temporal
    n = min(min(max(total / rate * fps, low), high), total)
    n = math.floor(n / temporal) * temporal
    if not temporal <= n <= total:
        raise ValueError(f"has {total} frames: a video needs at least {temporal}")
    return n


def frame_indices(total: int, count: int) -> list[int]:
    """`count` frames evenly spaced from the first to the last, as qwen-vl-utils picks them
    (torch's float32 linspace, rounded half to even)."""
    import torch

    return torch.linspace(0, total - 1, count).round().long().tolist()


def frame_size(
    height: int, width: int, count: int, settings: ImageSettings, total: int = TOTAL_TOKENS
) -> tuple[int, int]:
    """The size every kept frame is resized to, `total` tokens' pixels shared by the `count`
    frames (qwen-vl-utils' fetch_video)."""
    per_token = settings.factor**2
    low = FRAME_MIN_TOKENS * per_token
    high = max(min(FRAME_MAX_TOKENS * per_token, total * per_token / count * 2), low * 1.05)
    return fit(height, width, replace(settings, min_pixels=low, max_pixels=int(high)))


def read(
    data: bytes,
    settings: ImageSettings,
    max_frames: int,
    max_pixels: int,
    sampling: tuple[float | None, int | None] = (None, None),
) -> Video:
    """Video file bytes -> its kept frames (`sampling`: fps and the most frames kept, None for
    the defaults), resized; ValueError for what cannot be read, a video of more than
    `max_frames` frames or frames of more than `max_pixels` pixels."""
    fps, keep = sampling
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise ValueError("holds no video stream")
            stream = container.streams.video[0]
            height, width = stream.codec_context.height, stream.codec_context.width
            if height * width > max_pixels:
                raise ValueError(
                    f"is {width}x{height}, more than the limit of {max_pixels} pixels per frame"
                )
            rate = float(stream.average_rate or 0)
            total = stream.frames or sum(1 for _ in container.decode(stream))
            if total > max_frames:
                raise ValueError(f"has {total} frames, more than the limit of {max_frames}")
            if rate <= 0:
                raise ValueError("has no frame rate")
            temporal = settings.temporal_patch_size
            count = frame_count(total, rate, temporal, fps or FPS, keep or MAX_FRAMES)
            wanted = frame_indices(total, count)
            size = frame_size(height, width, count, settings)
            frames = _decode(container, stream, set(wanted), size)
    except (av.FFmpegError, OSError) as e:  # FFmpeg's errors; ours pass through
        raise ValueError(f"is not a readable video ({type(e).__name__}: {e})") from None
    if not frames or max(wanted) not in frames:
        raise ValueError(f"is not a readable video (frame {max(wanted)} of {total} not decoded)")
    return Video(np.stack([frames[i] for i in wanted]), tuple(i / rate for i in wanted))


def sample_frames(count: int, keep: int) -> list[int]:
    """The frames kept of a list of `count`: every one up to `keep`, else `keep` evenly spaced
    (the embedding script's sample_frames: numpy's linspace, truncated)."""
    if count <= keep:
        return list(range(count))
    return np.linspace(0, count - 1, keep, dtype=int).tolist()


def read_frames(
    files: list[bytes], settings: ImageSettings, max_pixels: int, keep: int | None = None
) -> Video:
    """A video given as its frames' image files -> its kept frames (at most `keep`, default
    MAX_FRAMES), resized; ValueError naming the frame that cannot be read or is over
    `max_pixels`, or frames of different sizes."""
    per_token = settings.factor**2
    low, high = FRAME_IMAGE_TOKENS
    as_image = replace(settings, min_pixels=low * per_token, max_pixels=high * per_token)
    kept = sample_frames(len(files), keep or MAX_FRAMES)
    count = len(kept) + -len(kept) % settings.temporal_patch_size  # the last again if odd
    frames, first = [], None
    for i in kept:
        try:
            frame = images.resized(images.decode(files[i], max_pixels), as_image)
        except ValueError as e:
            raise ValueError(f"frame {i} {e}") from None
        if first is None:
            first = frame.shape[:2]
            size = frame_size(*first, count, settings, FRAME_LIST_TOTAL_TOKENS)
        elif frame.shape[:2] != first:
            raise ValueError(
                f"frame {i} is {frame.shape[:2]} once resized, frame 0 {first}: one size"
            )
        frames.append(resized(frame[None], size)[0])  # as it comes: no full-size frames held
    frames += frames[-1:] * (count - len(frames))
    return Video(np.stack(frames), tuple(i / FRAME_LIST_FPS for i in range(count)))


def _decode(container, stream, wanted: set[int], size: tuple[int, int]) -> dict[int, np.ndarray]:
    """The wanted frames (by their index in decoding order) as RGB uint8 [size, 3], each
    resized as it is decoded: the kept frames are never all held at full size."""
    container.seek(0)
    out = {}
    for index, frame in enumerate(container.decode(stream)):
        if index in wanted:
            out[index] = resized(frame.to_ndarray(format="rgb24")[None], size)[0]
        if len(out) == len(wanted):
            break
    return out


def resized(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """uint8 [n, h, w, 3] -> uint8 [n, size, 3]: bicubic with antialiasing in float32, clamped
    and rounded (torchvision's resize of a uint8 tensor)."""
    import torch

    if frames.shape[1:3] == size:
        return np.ascontiguousarray(frames)
    # in float32 first: a new array, so frames read from a request's buffer may stay read-only
    x = torch.from_numpy(frames.astype(np.float32)).permute(0, 3, 1, 2)
    x = torch.nn.functional.interpolate(
        x, size=size, mode="bicubic", align_corners=False, antialias=True
    )
    x = x.clamp(0, 255).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).contiguous().numpy()


def timestamps(times: tuple[float, ...], temporal: int) -> list[float]:
    """Each temporal patch's time: the mean of its first and last frame's (Qwen3-VL's
    processor; a last patch short of frames repeats the last)."""
    t = list(times) + [times[-1]] * (-len(times) % temporal)
    return [(t[i] + t[i + temporal - 1]) / 2 for i in range(0, len(t), temporal)]


def placeholders(video: Video, settings: ImageSettings) -> str:
    """The video in a Qwen3-VL prompt: per temporal patch its timestamp, then its
    placeholders between <|vision_start|> and <|vision_end|> (Qwen3-VL's processor)."""
    _, h, w, _ = video.frames.shape
    pads = "<|video_pad|>" * (h * w // settings.factor**2)
    return "".join(
        f"<{t:.1f} seconds><|vision_start|>{pads}<|vision_end|>"
        for t in timestamps(video.times, settings.temporal_patch_size)
    )


def patchify(
    frames: np.ndarray, settings: ImageSettings
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Resized frames uint8 [n, height, width, 3] -> (pixels [patches, 3 x temporal_patch x
    patch x patch] float32, grid (temporal patches, rows, columns)): the encoder's part, as
    images.patchify with each patch's frames its own instead of one repeated."""
    t = settings.temporal_patch_size
    frames = np.concatenate([frames, np.repeat(frames[-1:], -len(frames) % t, axis=0)])
    p, m = settings.patch_size, settings.merge_size
    n, height, width, _ = frames.shape
    rows, cols = height // p, width // p
    if rows * p != height or cols * p != width or rows % m or cols % m:
        raise ValueError(f"frames of {(height, width)} pixels are not whole merge blocks")
    x = frames.astype(np.float32) / 255.0
    x = (x - np.asarray(settings.mean, np.float32)) / np.asarray(settings.std, np.float32)
    # [T, H, W, C] -> (time patch, block row, block column, row in block, column in block, C,
    # frame in patch, py, px)
    x = x.reshape(n // t, t, rows // m, m, p, cols // m, m, p, 3)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    grid = (n // t, rows, cols)
    return np.ascontiguousarray(x).reshape(grid[0] * rows * cols, 3 * t * p * p), grid
