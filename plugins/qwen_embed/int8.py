"""The int8 linear route: weights per output channel at load, activations per token at run time.

`x @ W.T` becomes `(xs * ws) * (q(x) @ q(W).T)`, with q() symmetric int8 and the product
accumulated in int32. Each layer first rotates its input rows and its weight rows by the same
block Walsh-Hadamard transform H (`x @ W.T == (x @ H) @ (W @ H).T / block`): an outlier
spreads over its block, so the one scale per row or channel fits the other values better.
On CPUs with AVX512_VNNI the native operator does all of it (native/csrc/gemm/): weights
packed for it once here, each row rotated in registers and quantised, the integer GEMM on our
AMX int8 tile kernel where the CPU has the tiles (gemm/tiles_amx.cpp) and on our VNNI panel
kernel elsewhere (gemm/panels_vnni.cpp), the sums rescaled to the model dtype while they are in
cache, so no int32 matrix is written.
Without VNNI, on CPUs with AVX2, another native operator (native/csrc/gemm/pairs_avx2.cpp):
each row rotated in registers and quantised, the codes multiplied as int16 pairs on weights
packed once here (int8 in memory, widened as they are loaded), the rescale in torch's order, so
the torch route's bits. Elsewhere that torch route: the native rotation (any instruction set)
or the same butterflies in torch, torch's quantise pass, the integer products
(integer_products), then torch's rescale.
Integer sums are exact and the scales per row, so either way a text's vector does not depend
on its batch.

Embeddings, norms, attention, pooling, a vision tower (engine._convert_linears) and the layers
in FLOAT_LAYERS stay in floats: the attention's output projection and its values (the q|k|v
projection runs as q|k in int8 and v apart, FLOAT_SHARDS) lose the most to int8
(docs/tuning.md); so do a linear-attention layer's output projection and its queries and
keys, and its rates and decays (a few channels) cost nothing in floats.
"""

from __future__ import annotations

import torch
from torch import nn

from . import avx2_gemm, native
from .cpu import cpu_features

_QMAX = 127.0
# Of each packed projection, the shards cut off into a layer of their own, in floats: q|k|v's
# values; a linear-attention layer's (Qwen3.5's) rates b, decays a, and its queries and keys,
# whose directions the delta rule follows (L2-normalised: their error is not scaled down);
# its values and output gate v|z in int8.
FLOAT_SHARDS = {"qkv_proj": ("v",), "in_proj": ("b", "a", "q", "k")}
# module name endings kept in floats
FLOAT_LAYERS = (
    "self_attn.o_proj",
    "self_attn.v_proj",
    "linear_attn.baqk_proj",
    "linear_attn.out_proj",
)
GROUP = 4  # input values per int8 dot product (native.pack_panels)
TILE_STEP = 64  # input values per product of the AMX int8 tile kernel
PAIRS_PANEL = 16  # output channels per panel of the AVX2 operator's weights (csrc: kPairsPanel)
# The rotation's block: the largest power of two dividing the input width, up to 128 (8 of the
# native kernel's vectors, rotated in registers); none (1) below one vector of 16 values.
MAX_ROTATION, MIN_ROTATION = 128, 16
# torch_weight_codes rotates and quantises a block of rows at a time, this many values (8 MB of
# float64): smaller blocks stay in cache but make many short parallel ops, which two encoders
# loading at once on the same cores (OpenMP threads oversubscribed) made several times slower
WEIGHT_VALUES_AT_ONCE = 2**20


def quantizes(module_name: str) -> bool:
    return not module_name.endswith(FLOAT_LAYERS)


def rotation_block(in_features: int) -> int:
    block = min(in_features & -in_features, MAX_ROTATION)
    return block if block >= MIN_ROTATION else 1


def hadamard_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [rows, k] times the unnormalised block Walsh-Hadamard matrix (entries +-1; H @ H.T ==
    block * I), in fp32 (float64 stays float64), as butterflies (a + b, a - b) on pairs h
    apart, h = 1, 2, 4, ...: the native kernels' order, so the same floats. Native where built."""
    if native.handles(x):
        return torch.ops.qwen_embed.hadamard_rows(x, block)
    return torch_hadamard_rows(x.float() if x.dtype != torch.float64 else x, block)


def torch_hadamard_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    rows, k = x.shape
    x = x.clone(memory_format=torch.contiguous_format)  # butterflies in place on a copy
    for h in (1 << i for i in range(block.bit_length() - 1)):
        pairs = x.view(rows, k // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        first = a.clone()
        a.add_(b)
        torch.sub(first, b, out=b)
    return x


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q int8 [rows, k], scale fp32 [rows, 1]) with x ~= q * scale.
    The values are multiplied by the scale's reciprocal (the native kernel's arithmetic)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / _QMAX
    codes = torch.round(x.float() * scale.reciprocal())
    return codes.clamp(-_QMAX, _QMAX).to(torch.int8), scale


def weight_rows_at_once(in_features: int) -> int:
    return max(1, WEIGHT_VALUES_AT_ONCE // in_features)


def weight_codes(w: torch.Tensor, rotation: int) -> tuple[torch.Tensor, ...]:
    """(int8 codes [out, in], fp32 scales [out, 1], int32 sums of each row's codes [out], which
    pack needs): quantize_rows of w's rows rotated in float64 (the 1 / rotation goes into the
    scales: exact). Native where built: one call per weight, where the torch ops are many short
    parallel ones, which two encoders loading at once on the same cores slow several times;
    the same bits (torch_weight_codes)."""
    if native.handles(w):
        return torch.ops.qwen_embed.weight_codes(w, rotation)
    return torch_weight_codes(w, rotation)


def torch_weight_codes(w: torch.Tensor, rotation: int) -> tuple[torch.Tensor, ...]:
    """weight_codes in torch ops, a block of rows at a time: every step is per row, and the
    float64 temporaries of a whole 8B-model weight would take gigabytes at load."""
    codes = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scales = torch.empty(w.shape[0], 1, device=w.device)
    step = weight_rows_at_once(w.shape[1])
    for start in range(0, w.shape[0], step):
        rows = w[start : start + step]
        if rotation > 1:
            rows = hadamard_rows(rows.double(), rotation)
        q, scale = quantize_rows(rows)
        codes[start : start + len(q)] = q
        scales[start : start + len(q)] = scale / rotation
    return codes, scales, codes.sum(dim=1, dtype=torch.int32)


def native_kernel() -> bool:
    """Whether the native int8 operator runs here (built, an AVX512_VNNI CPU)."""
    return native.isa() is not None and torch.ops.qwen_embed.int8_supported()


def avx2_kernel() -> bool:
    """Whether the native AVX2 int8 GEMM runs here (built, a CPU with AVX2); the layers take it
    where the native int8 operator does not run."""
    return avx2_gemm.runs()


def integer_products(xq: torch.Tensor, qweight: torch.Tensor, vnni: bool) -> torch.Tensor:
    """xq [rows, k] @ qweight [n, k].T of int8 codes, as exact integer sums: torch's int8 GEMM
    (oneDNN) where the CPU has VNNI. Without VNNI that GEMM runs far slower than a float64 one,
    whose sums of int8 products are exact too (below 2**53)."""
    if vnni:
        return torch._int_mm(xq, qweight.t())
    return xq.double() @ qweight.double().t()


def _rescale(
    acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    return (acc.float() * x_scale * w_scale).to(dtype)


def pack(
    q: torch.Tensor, scale: torch.Tensor, sums: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """int8 weights [n, k], their scales [n, 1] (and each row's sum, where counted already) in
    the native operator's layout: (packed int8 [n_pad / panel, k_pad / 4, panel, 4], offset
    int32 [n_pad] = 128 x each channel's sum, which undoes the kernel's uint8 activation codes,
    scale fp32 [n_pad]); padding is zeros.
    For our AMX tile kernel (native.int8_panel) panels of 16 channels and k_pad a multiple of
    its 64-value steps, so that it runs at every width (padding codes stand for 0)."""
    n, k = q.shape
    panel = native.int8_panel()
    if panel != native.PANEL and k % TILE_STEP:
        q = torch.nn.functional.pad(q, (0, TILE_STEP - k % TILE_STEP))
    packed = native.pack_panels(q, GROUP, panel)
    n_pad = packed.shape[0] * panel
    offset = torch.zeros(n_pad, dtype=torch.int32)
    offset[:n] = (q.sum(dim=1, dtype=torch.int32) if sums is None else sums) * 128
    padded_scale = torch.zeros(n_pad)
    padded_scale[:n] = scale.view(-1)
    return packed, offset, padded_scale


def pack_pairs(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights [n, k] and their scales [n, 1] in the AVX2 operator's layout: (int8
    [n_pad / 16, k_pad / 2, 16, 2], vpmaddwd's pairs of input values once widened; scale fp32
    [n_pad]), padding zeros."""
    packed = native.pack_panels(q, 2, PAIRS_PANEL)
    padded_scale = torch.zeros(packed.shape[0] * PAIRS_PANEL)
    padded_scale[: q.shape[0]] = scale.view(-1)
    return packed, padded_scale


class Int8Weight(nn.Module):
    """A linear layer's weight, rotated (rotation_block), as int8 [out, in] plus one fp32 scale
    per output channel, packed for the native operator where it runs (in pairs for the AVX2
    one)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.rotation = rotation_block(weight.shape[1])
        q, scale, sums = weight_codes(weight.detach(), self.rotation)
        self.out_features = q.shape[0]
        cpu = weight.device.type == "cpu"
        self.native = native_kernel() and cpu
        self.avx2 = not self.native and avx2_kernel() and cpu
        self.gates = False  # silu_gated: on the native operator
        if self.native:
            packed, offset, scale = pack(q, scale, sums)
            self.register_buffer("packed", packed)
            self.register_buffer("offset", offset)
            self.register_buffer("scale", scale)
            self.gates = native.gates(packed.shape[2], self.out_features)
        elif self.avx2:
            packed, scale = pack_pairs(q, scale)
            self.register_buffer("packed", packed)
            self.register_buffer("scale", scale)
        else:
            self.register_buffer("qweight", q)
            self.register_buffer("scale", scale.view(1, -1))
            self.vnni = cpu_features().vnni

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.native:
            bias = None if bias is None else bias.float()
            out = torch.ops.qwen_embed.int8_linear(
                x2, self.packed, self.offset, self.scale, bias, self.out_features, self.rotation
            )
        else:
            if self.avx2:  # the torch route's bits below, up to its cast and bias
                out = torch.ops.qwen_embed.int8_linear_avx2(
                    x2, self.packed, self.scale, self.out_features, self.rotation
                ).to(x.dtype)
            else:
                rotated = hadamard_rows(x2, self.rotation) if self.rotation > 1 else x2
                xq, x_scale = quantize_rows(rotated)
                products = integer_products(xq, self.qweight, self.vnni)
                out = _rescale(products, x_scale, self.scale, x.dtype)
            if bias is not None:
                out.add_(bias.to(out.dtype))
        return out.view(*shape[:-1], self.out_features)

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a gate|up projection (forward's halves), in the GEMM's store
        where `gates`: the bits of the row ops' silu_mul on forward's output."""
        return torch.ops.qwen_embed.int8_linear(
            x,
            self.packed,
            self.offset,
            self.scale,
            None,
            self.out_features,
            self.rotation,
            gated=True,
        )
