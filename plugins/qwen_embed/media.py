"""Images and video in a text model's forward (Qwen3-VL): the texts' placeholder tokens become
the vision tower's tokens, rotary turns with time, rows and columns, and the DeepStack
features are added to the first layers' outputs at those tokens.

A `MediaText` is a text's token ids with its visuals in the order of their placeholders: an
image's run of `image_token_id`s, or for a video one run of `video_token_id`s per temporal
patch (the processor writes a timestamp between them). A forward over such texts
(`MediaForward`) runs the vision tower once over every visual of the batch, as one flat stream
of frames.

Multimodal rotary (`mrope_positions`, turned into cos/sin by layers.rotary_cos_sin): text
tokens take one position on all three axes, counting on from the last; a placeholder run of
(h, w) merged patches starting at p takes (p, p + row, p + column), and the text after it
continues at p + max(h, w). For text alone the three axes agree and the rotary is the ordinary
one. GME's script numbers every token, an image's too, in sequence (`sequential_positions`):
the ordinary rotary throughout.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from .batch import to_device
from .config import Grid, MediaConfig
from .layers import TPGroup


@dataclass(frozen=True)
class Visual:
    """One image or video as the checkpoint's processor gives it: pixels [t * h * w,
    channels x temporal_patch x patch x patch], the patches of each merge block consecutive."""

    pixels: np.ndarray
    grid: Grid
    video: bool = False


@dataclass(frozen=True)
class MediaText:
    ids: np.ndarray
    visuals: tuple[Visual, ...] = ()
    # (start, end, merged rows, merged columns) of each placeholder run: set by
    # `checked`, which every text passes before a forward
    blocks: tuple[tuple[int, int, int, int], ...] | None = None

    def checked(self, config: MediaConfig) -> MediaText:
        """This text with its blocks (`visual_blocks`; ValueError naming what is wrong)."""
        return MediaText(self.ids, tuple(self.visuals), tuple(visual_blocks(self, config)))


def placeholder_runs(ids: np.ndarray, config: MediaConfig) -> list[tuple[int, int, int]]:
    """(start, end, token id) of each run of image or video placeholders."""
    marks = np.isin(ids, (config.image_token_id, config.video_token_id))
    edges = np.flatnonzero(np.diff(np.concatenate([[0], marks.astype(np.int8), [0]])))
    return [(int(a), int(b), int(ids[a])) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def visual_blocks(text: MediaText, config: MediaConfig) -> list[tuple[int, int, int, int]]:
    """(start, end, merged rows, merged columns) of each placeholder run, checked against the
    text's visuals (ValueError naming what does not match)."""
    merge = config.vision.spatial_merge_size
    expected = []
    for i, visual in enumerate(text.visuals):
        t, h, w = visual.grid
        if h % merge or w % merge or t < 1:
            raise ValueError(f"visual {i}: grid {visual.grid} is not whole merge blocks of {merge}")
        token = config.video_token_id if visual.video else config.image_token_id
        if visual.video and not config.reads_video:
            raise ValueError(f"visual {i}: this checkpoint's videos are not read (Qwen2-VL)")
        if not visual.video and t != 1:
            raise ValueError(f"visual {i}: an image has one temporal patch, got grid {visual.grid}")
        want = (t * h * w, config.vision.patch_dim)
        if np.shape(visual.pixels) != want:
            raise ValueError(
                f"visual {i}: pixels must be {list(want)} for grid {visual.grid}, "
                f"got {list(np.shape(visual.pixels))}"
            )
        expected += [(token, h // merge, w // merge)] * t
    runs = placeholder_runs(text.ids, config)
    if len(runs) != len(expected):
        raise ValueError(
            f"the text holds {len(runs)} runs of image/video tokens for {len(expected)} "
            "image blocks and video frames"
        )
    blocks = []
    for (start, end, token), (want, rows, cols) in zip(runs, expected, strict=True):
        if token != want or end - start != rows * cols:
            raise ValueError(
                f"the placeholder run at token {start} has {end - start} tokens; its visual "
                f"needs {rows * cols}"
            )
        blocks.append((start, end, rows, cols))
    return blocks


def visual_spans(ids: list[np.ndarray], config: MediaConfig) -> np.ndarray:
    """The rows [start, end) of the flat batch of texts `ids` that jina-embeddings-v4 means
    (config.VISUAL_SPAN_MEAN): a text's first vision start token through the first vision end
    token after it (both in), a text without an image all of its own."""
    spans, offset = [], 0
    for text in ids:
        span = (0, len(text))
        starts = np.flatnonzero(text == config.vision_start_token_id)
        if len(starts):
            ends = np.flatnonzero(text[starts[0] :] == config.vision_end_token_id)
            span = (int(starts[0]), int(starts[0] + ends[0]) + 1 if len(ends) else len(text))
        spans.append((offset + span[0], offset + span[1]))
        offset += len(text)
    return np.array(spans, dtype=np.int64).reshape(-1, 2)


def mrope_positions(length: int, blocks: list[tuple[int, int, int, int]]) -> np.ndarray:
    """Positions [length, 3] (time, row, column) of a text with these placeholder blocks."""
    out = np.empty((length, 3), dtype=np.int64)
    cursor, at = 0, 0
    for start, end, rows, cols in [*blocks, (length, length, 0, 0)]:
        out[at:start] = (cursor + np.arange(start - at))[:, None]
        cursor += start - at
        if end > start:
            r, c = np.divmod(np.arange(rows * cols), cols)
            out[start:end, 0] = cursor
            out[start:end, 1] = cursor + r
            out[start:end, 2] = cursor + c
            cursor += max(rows, cols)
        at = end
    return out


class MediaForward:
    """A forward batch's visuals: where their tokens go in the flat batch, the batch's
    positions on three axes, and (once the tower has run, `embed`) the tokens and DeepStack
    features. Under tensor parallelism rank 0 holds the visuals and the tower; the other ranks
    know the layout (`of_flat_ids`) and receive the tokens from it."""

    def __init__(self, config: MediaConfig, rows: np.ndarray, positions: np.ndarray, device):
        self.config = config
        self.visuals: list[Visual] = []
        self.positions_host = positions  # [T, 3], what rank 0 sends to the other ranks
        self.rows_host = rows
        self.count = len(rows)
        self.device = device
        self.deepstack: list[torch.Tensor] = []
        self.adapters: np.ndarray | None = None  # each visual's text's (lora.py), or None

    # On the device when the forward first reads them: a batch a segment plan lays out again
    # (`computed`) never copies its own.
    @functools.cached_property
    def rows(self) -> torch.Tensor:
        return to_device(torch.from_numpy(self.rows_host), self.device)

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        return to_device(torch.from_numpy(self.positions_host), self.device)

    @classmethod
    def of_texts(
        cls, texts: list[MediaText], config: MediaConfig, device, adapters: np.ndarray | None = None
    ) -> MediaForward:
        """The batch of `texts` that passed `MediaText.checked`, in order; `adapters`: each
        text's (lora.py), which its visuals go through the tower with."""
        rows, positions, offset = [], [], 0
        for text in texts:
            # in sequence: every token numbered as text is
            blocks = () if config.sequential_positions else text.blocks
            positions.append(mrope_positions(len(text.ids), blocks))
            rows += [np.arange(offset + a, offset + b) for a, b, _, _ in text.blocks]
            offset += len(text.ids)
        flat_rows = np.concatenate([np.zeros(0, np.int64), *rows])
        media = cls(config, flat_rows, np.concatenate(positions), device)
        media.visuals = [v for text in texts for v in text.visuals]
        if adapters is not None:
            media.adapters = np.repeat(adapters, [len(t.visuals) for t in texts])
        return media

    @classmethod
    def of_flat_ids(
        cls, ids: np.ndarray, positions: np.ndarray, config: MediaConfig, device
    ) -> MediaForward:
        """A rank without the visuals: their rows are the placeholders in the flat ids (every
        run is one visual block, as `checked` made sure on rank 0)."""
        rows = np.flatnonzero(np.isin(ids, (config.image_token_id, config.video_token_id)))
        return cls(config, rows, positions, device)

    def visual_starts(self, bounds: list[int]) -> list[int]:
        """Each text's first visual token, counted in the text (its length where it has none),
        of the flat batch whose texts start and end at `bounds`."""
        firsts = np.searchsorted(self.rows_host, bounds[:-1])
        return [
            int(self.rows_host[k]) - a if k < self.count and self.rows_host[k] < b else b - a
            for k, a, b in zip(firsts, bounds[:-1], bounds[1:], strict=True)
        ]

    def computed(self, source: np.ndarray) -> MediaForward:
        """This batch's visuals in the rows a segment plan computes (`source`: each one's row in
        the flat batch; a shared prefix holds no visual token, so each of them is computed
        once)."""
        at = np.full(len(self.positions_host), -1, dtype=np.int64)
        at[source] = np.arange(len(source))
        rows, positions = at[self.rows_host], self.positions_host[source]
        media = MediaForward(self.config, rows, positions, self.device)
        media.visuals, media.adapters = self.visuals, self.adapters
        return media

    def embed(self, tower, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        """The text embeddings x [T, hidden] with the visuals' tokens at their placeholders:
        from `tower` where this rank holds it, else broadcast by rank 0."""
        if not self.count:
            return x
        if tower is not None:
            features = [t.to(x.dtype).contiguous() for t in self._through(tower)]
        else:
            levels = 1 + len(self.config.vision.deepstack_visual_indexes)
            features = [x.new_empty(self.count, x.shape[1]) for _ in range(levels)]
        for t in features:
            tp.broadcast(t)
        self.deepstack = features[1:]
        return x.index_copy(0, self.rows, features[0])

    def _through(self, tower) -> list[torch.Tensor]:
        """The visuals' tokens, then each DeepStack level's features [count, hidden]. The
        tower runs once per distinct visual (and adapter): a rerank query's image comes with
        every pair."""
        merge = self.config.vision.spatial_merge_size
        adapters = self.adapters
        keys = np.zeros(len(self.visuals), np.int64) if adapters is None else adapters
        distinct, copies = distinct_visuals(self.visuals, merge, keys)
        if tower.adapters is not None:  # each visual's patches and tokens add its adapter
            patches = [int(np.prod(self.visuals[i].grid)) for i in distinct]
            chosen = None if adapters is None else adapters[distinct]
            tower.adapters.select_visuals(chosen, patches, merge**2)
        distinct = [self.visuals[i] for i in distinct]
        pixels = torch.from_numpy(np.concatenate([v.pixels for v in distinct]))
        tokens, deepstack = tower(to_device(pixels, self.device), [v.grid for v in distinct])
        if copies is None:
            return [tokens, *deepstack]
        index = to_device(torch.from_numpy(copies), self.device)
        return [t.index_select(0, index) for t in (tokens, *deepstack)]

    def after_layer(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """DeepStack: the layer's output at the visual tokens plus that level's features."""
        if layer >= len(self.deepstack):
            return x
        return x.index_add(0, self.rows, self.deepstack[layer])


def distinct_visuals(
    visuals: list[Visual], merge: int, adapters: np.ndarray
) -> tuple[list[int], np.ndarray | None]:
    """The indices of the distinct visuals (same grid, kind, pixels and adapter: one) and,
    where some repeat, for each visual's tokens in turn the row of the distinct visuals'
    tokens that gives it (None: all distinct)."""
    found: dict[tuple, int] = {}
    distinct, which = [], []
    for i, v in enumerate(visuals):
        pixels = hashlib.blake2b(np.ascontiguousarray(v.pixels)).digest()
        key = (v.grid, v.video, pixels, int(adapters[i]))
        if key not in found:
            found[key] = len(distinct)
            distinct.append(i)
        which.append(found[key])
    if len(distinct) == len(visuals):
        return distinct, None
    sizes = [int(np.prod(visuals[i].grid)) // merge**2 for i in distinct]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    rows = [np.arange(starts[i], starts[i] + sizes[i]) for i in which]
    return distinct, np.concatenate(rows)
