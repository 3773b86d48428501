"""Qwen3-VL's vision tower: image and video patches -> the text model's visual tokens, and the
DeepStack features its first layers add at those tokens. Qwen2-VL's tower (VisionConfig.
generation "qwen2_vl") is the same without the position table and DeepStack, under its own
module names; Qwen2.5-VL's ("qwen2_5_vl") has RMSNorms, a gated MLP, and attends within
windows in most blocks (below).

Images are segments like texts: the patches of every image (and of every frame of a video) of
a batch travel as one flat stream, each frame attends to its own patches only (bidirectional,
through the engine's attention backends), and the 2x2 patch merger turns each block of four
patches into one token of the text model. Patches arrive as the checkpoint's processor lays
them out: [patches, channels x temporal_patch x patch x patch], the patches of each 2x2 merge
block consecutive.

Per frame of (h, w) patches: a learned position table (a square grid; Qwen3-VL) resampled
bilinearly to (h, w) with aligned corners; 2-D rotary on every block's attention (the first
half of the rotated dimensions turn with the patch's row, the second with its column); after
the blocks named by `deepstack_visual_indexes`, a merger of their own gives the DeepStack
features.

Qwen2.5-VL's windows: each frame's merge blocks are cut into squares of `window_size` pixels
(the last row and column of squares partial), the patches reordered window by window before
the blocks (rotary tables alike), each window attending to itself except in the blocks named
by `fullatt_block_indexes`, which attend to the whole frame; the merged tokens are put back in
the processor's order.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend, AttentionSpec, create_backend
from ..batch import to_device
from ..config import Grid, VisionConfig
from ..kernels import RowOps
from ..layers import ReplicatedLinear, replicated_loader
from ..segments import AttentionLayout

TOWER = "visual."  # the tower's modules and checkpoint tensors (the text model's beside it)

_ACTIVATIONS = {  # config.hidden_act -> the activation of (the route's row ops, x)
    "gelu_pytorch_tanh": lambda ops, x: ops.gelu_tanh(x),
    "gelu": lambda ops, x: F.gelu(x),
    "silu": lambda ops, x: F.silu(x),
    "quick_gelu": lambda ops, x: x * torch.sigmoid(1.702 * x),
}
# The checkpoint's names of (a block's MLP layers: in, out, or gate, up, down; the merger's
# norm and layers) per generation
_NAMES = {
    "qwen3_vl": (("linear_fc1", "linear_fc2"), ("norm", "linear_fc1", "linear_fc2")),
    "qwen2_vl": (("fc1", "fc2"), ("ln_q", "mlp.0", "mlp.2")),
    "qwen2_5_vl": (("gate_proj", "up_proj", "down_proj"), ("ln_q", "mlp.0", "mlp.2")),
}


class RMSNorm(nn.Module):
    """Qwen2.5-VL's tower norms, on the route's row ops."""

    def __init__(self, size: int, ops: RowOps, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.ops, self.eps = ops, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


def _norm(config: VisionConfig, size: int, ops: RowOps) -> nn.Module:
    if config.generation == "qwen2_5_vl":
        return RMSNorm(size, ops)
    return nn.LayerNorm(size, eps=1e-6)


def _named(parent: nn.Module, path: str, module: nn.Module) -> nn.Module:
    """`module` registered under the checkpoint's dotted `path` below `parent`."""
    *outer, last = path.split(".")
    for name in outer:
        if not hasattr(parent, name):
            parent.add_module(name, nn.Module())
        parent = getattr(parent, name)
    parent.add_module(last, module)
    return module


def patch_coordinates(grid: Grid, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each patch of a frame, in the processor's order: 2x2 merge blocks row
    by row, the patches of a block row by row."""
    _, h, w = grid
    rows = np.arange(h).reshape(h // merge, merge, 1, 1)
    cols = np.arange(w).reshape(1, 1, w // merge, merge)
    rows, cols = np.broadcast_arrays(rows, cols)  # [h/m, m, w/m, m]
    order = (0, 2, 1, 3)  # block row, block column, row in block, column in block
    return rows.transpose(order).reshape(-1), cols.transpose(order).reshape(-1)


def window_order(grids: list[Grid], merge: int, window: int) -> tuple[np.ndarray, list[int]]:
    """Qwen2.5-VL's windows: the merge blocks of every frame, numbered in the processor's order,
    listed window by window (`window` x `window` blocks, row by row; within a window row by
    row), and each window's length in patches."""
    order, sizes, offset = [], [], 0
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        blocks = offset + np.arange(t * rows * cols).reshape(t, rows, cols)
        for frame in blocks:
            for top in range(0, rows, window):
                for left in range(0, cols, window):
                    square = frame[top : top + window, left : left + window]
                    order.append(square.reshape(-1))
                    sizes.append(square.size * merge * merge)
        offset += t * rows * cols
    return np.concatenate(order), sizes


def _unit_patches(order: np.ndarray, unit: int) -> np.ndarray:
    """The patches of merge blocks in `order` (each block's `unit` patches consecutive)."""
    return (order[:, None] * unit + np.arange(unit)).reshape(-1)


def _bilinear_taps(coord: np.ndarray, length: int, side: int):
    """Aligned-corner bilinear taps along one axis: `length` points over `side` table rows."""
    scale = (side - 1) / (length - 1) if length > 1 else 0.0
    x = coord * scale
    lo = np.floor(x).astype(np.int64)
    hi = np.minimum(lo + 1, side - 1)
    frac = x - lo
    return lo, hi, 1.0 - frac, frac


def _kernel_as_matrix(param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
    """A Conv3d kernel [out, channels, time, height, width] as [out, channels x time x
    height x width]: the order of a patch's pixels."""
    replicated_loader(param, full.reshape(len(full), -1))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, attention: AttentionBackend, ops: RowOps):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.norm1 = _norm(config, hidden, ops)
        self.norm2 = _norm(config, hidden, ops)
        self.attn = nn.Module()
        self.attn.qkv = ReplicatedLinear(hidden, 3 * hidden)
        self.attn.proj = ReplicatedLinear(hidden, hidden)
        self.mlp = nn.Module()
        *into, out = _NAMES[config.generation][0]  # (fc1 | gate, up), fc2 | down
        self.fc = [  # a list, not registered twice: the checkpoint names them under mlp.
            *(_named(self.mlp, name, ReplicatedLinear(hidden, inner)) for name in into),
            _named(self.mlp, out, ReplicatedLinear(inner, hidden)),
        ]
        self.act = _ACTIVATIONS[config.hidden_act]
        self.heads, self.head_dim = config.num_heads, config.head_dim
        self.attention = attention
        self.ops = ops

    def forward(self, x, cos, sin, layout: AttentionLayout):
        """cos/sin in fp32: the rotation in fp32, rounded once, as transformers' vision
        attention rotates."""
        q, k, v = self.attn.qkv(self.norm1(x)).view(len(x), 3, -1).unbind(1)
        q = self.ops.norm_rotary(q, cos, sin, self.head_dim, None, 0.0)
        k = self.ops.norm_rotary(k, cos, sin, self.head_dim, None, 0.0)
        v = v.reshape(len(x), self.heads, self.head_dim)
        attended = self.attention.forward(q, k, v, layout)
        x = x + self.attn.proj(attended.reshape(len(x), -1))
        return x + self._mlp(self.norm2(x))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.fc) == 3:  # gated
            gate, up, down = self.fc
            return down(self.act(self.ops, gate(x)) * up(x))
        fc1, fc2 = self.fc
        return fc2(self.act(self.ops, fc1(x)))


class PatchMerger(nn.Module):
    """Each merge block's patches side by side -> one text-model token. The main merger
    normalises each patch first; DeepStack's mergers normalise the block (`after_shuffle`)."""

    def __init__(self, config: VisionConfig, after_shuffle: bool, ops: RowOps):
        super().__init__()
        width = config.hidden_size * config.merge_unit
        self.width, self.after_shuffle = width, after_shuffle
        norm, fc1, fc2 = _NAMES[config.generation][1]
        self.layers = [
            _named(self, norm, _norm(config, width if after_shuffle else config.hidden_size, ops)),
            _named(self, fc1, ReplicatedLinear(width, width)),
            _named(self, fc2, ReplicatedLinear(width, config.out_hidden_size)),
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm, fc1, fc2 = self.layers
        x = norm(x.view(-1, self.width)) if self.after_shuffle else norm(x)
        return fc2(F.gelu(fc1(x.view(-1, self.width))))


class VisionTower(nn.Module):
    """Checkpoint names under `visual.` (Qwen3-VL's `model.visual.*`, Qwen2-VL's `visual.*`)."""

    def __init__(self, config: VisionConfig, attn_backend: str, device, dtype, ops: RowOps):
        super().__init__()
        self.config = config
        attention = create_backend(
            attn_backend,
            AttentionSpec(
                num_heads=config.num_heads,
                num_kv_heads=config.num_heads,
                head_dim=config.head_dim,
                causal=False,
                device=torch.device(device),
                dtype=dtype,
            ),
        )
        self.attention = attention
        self.adapters = None  # lora.AdapterSwitch over patches where a request names adapters
        self.patch_embed = nn.Module()
        # The checkpoint's Conv3d strides by its kernel: a linear layer over each patch's pixels
        bias = config.generation == "qwen3_vl"  # Qwen2(.5)-VL's patch kernel has none
        self.patch_embed.proj = ReplicatedLinear(config.patch_dim, config.hidden_size, bias)
        self.pos_embed = (
            nn.Embedding(config.num_position_embeddings, config.hidden_size)
            if config.num_position_embeddings
            else None
        )
        self.blocks = nn.ModuleList(
            VisionBlock(config, attention, ops) for _ in range(config.depth)
        )
        self.merger = PatchMerger(config, after_shuffle=False, ops=ops)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, after_shuffle=True, ops=ops)
            for _ in config.deepstack_visual_indexes
        )
        for param in self.parameters():  # every rank holds the whole tower
            param.requires_grad_(False)
            param.weight_loader = replicated_loader
        self.patch_embed.proj.weight.weight_loader = _kernel_as_matrix
        head_quarter = config.head_dim // 4  # frequencies per axis
        exponents = torch.arange(0, 2 * head_quarter, 2, dtype=torch.float32) / (2 * head_quarter)
        self.register_buffer("inv_freq", 1.0 / config.rope_theta**exponents, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0].norm1.weight.dtype  # a norm: linear weights may be repacked

    def forward(
        self, pixels: torch.Tensor, grids: list[Grid]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixels [patches, patch_dim] of `grids` in order -> (tokens [patches / merge_unit,
        out_hidden_size], one DeepStack feature of the same shape per deepstack index)."""
        config, device = self.config, self.blocks[0].norm1.weight.device
        expected = sum(t * h * w for t, h, w in grids)
        if pixels.shape != (expected, config.patch_dim):
            raise ValueError(
                f"pixels must be [{expected}, {config.patch_dim}] for grids {grids}, "
                f"got {list(pixels.shape)}"
            )
        x = self.patch_embed.proj(pixels.to(device, self.dtype))
        rows, cols = (to_device(t, device) for t in self._coordinates(grids))
        if self.pos_embed is not None:
            taps, tap_weights = (to_device(t, device) for t in self._taps(grids))
            table = self.pos_embed(taps).float()  # [patches, 4, hidden]
            x = x + (table * tap_weights[:, :, None]).sum(1).to(x.dtype)
        # [patches, head_dim // 2]: the first half of the frequencies turn with the row
        angles = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], -1)
        cos, sin = angles.cos(), angles.sin()
        frames = self._layout([h * w for t, h, w in grids for _ in range(t)])
        windows = None
        if config.window_size:  # patches window by window; each block its layout
            order, sizes = window_order(grids, config.spatial_merge_size, config.window_units)
            unit = config.merge_unit
            patches = to_device(torch.from_numpy(_unit_patches(order, unit)), device)
            x, cos, sin = x[patches], cos[patches], sin[patches]
            windows = self._layout(sizes)
        features = []
        for i, block in enumerate(self.blocks):
            full = windows is None or i in config.fullatt_block_indexes
            x = block(x, cos, sin, frames if full else windows)
            if i in config.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[config.deepstack_visual_indexes.index(i)]
                features.append(merger(x))
        tokens = self.merger(x)
        if windows is not None:  # back in the processor's order
            tokens = tokens[to_device(torch.from_numpy(np.argsort(order)), device)]
        return tokens, features

    def _layout(self, lengths: list[int]) -> AttentionLayout:
        """Segments of these lengths attending to themselves, prepared on the backend."""
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
        cu_device = to_device(cu, self.blocks[0].norm1.weight.device)
        layout = AttentionLayout(tuple(lengths), tuple(lengths), cu_device, cu_device, cu, cu, None)
        self.attention.prepare(layout)
        return layout

    def _coordinates(self, grids: list[Grid]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's row and column (fp32), frame after frame."""
        merge = self.config.spatial_merge_size
        rows, cols = [], []
        for grid in grids:
            r, c = patch_coordinates(grid, merge)
            rows.append(np.tile(r, grid[0]))
            cols.append(np.tile(c, grid[0]))
        return (
            torch.from_numpy(np.concatenate(rows)).float(),
            torch.from_numpy(np.concatenate(cols)).float(),
        )

    def _taps(self, grids: list[Grid]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's four taps into the position table and their weights."""
        merge, side = self.config.spatial_merge_size, int(self.config.num_position_embeddings**0.5)
        taps, weights = [], []
        for grid in grids:
            t, h, w = grid
            r, c = patch_coordinates(grid, merge)
            r0, r1, rw0, rw1 = _bilinear_taps(r, h, side)
            c0, c1, cw0, cw1 = _bilinear_taps(c, w, side)
            frame_taps = np.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1])
            frame_weights = np.stack([rw0 * cw0, rw0 * cw1, rw1 * cw0, rw1 * cw1])
            taps.append(np.tile(frame_taps.T, (t, 1)))
            weights.append(np.tile(frame_weights.T, (t, 1)))
        return (
            torch.from_numpy(np.concatenate(taps)),
            torch.from_numpy(np.concatenate(weights)).float(),
        )
