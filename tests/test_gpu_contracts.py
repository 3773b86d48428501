"""Our side of the GPU attention kernels' contracts, checked on CPU: NOT a GPU run.

The calls our GPU backends make (flash-attn's `flash_attn_varlen_func`, PyTorch's
`varlen_attn`, flashinfer's ragged prefill `plan`/`run`) go to stand-ins that enforce what those
libraries check before they launch a kernel, each check quoting the source line it comes from,
and then compute the attention with a plain math path (bottom-right causal, as FlashAttention
2.1+ and flashinfer align it). They run for every layout the planner makes: plain varlen
batches, shared prefixes (fewer queries than keys), the pruned last layer (one query row per
text), one-token texts, GQA, head sizes 64 and 128 (flashinfer: 128), causal and bidirectional.
The backends' outputs are compared with the torch backend's per-segment SDPA loop on the same
inputs. NCCL groups are not covered here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwen_embed.attention import AttentionSpec, create_backend
from qwen_embed.attention.base import AttentionBackend
from qwen_embed.attention.flash_attn import FlashAttention
from qwen_embed.attention.flashinfer import FlashInferAttention
from qwen_embed.attention.flashinfer_limits import FLASHINFER_HEAD_DIMS
from qwen_embed.batch import flatten
from qwen_embed.chunking import ChunkedText, ChunkForward
from qwen_embed.segments import Planner

from reference import random_sequences

HEADS, KV_HEADS = 8, 2


def _flash_preconditions(q, k, v, cu_q, cu_k, max_q, max_k) -> None:
    """What FlashAttention-2's varlen forward checks (flash-attn csrc/flash_attn/flash_api.cpp,
    mha_varlen_fwd; PyTorch's varlen_attn reaches the same checks in ATen's copy of it)."""
    # TORCH_CHECK(q_dtype == torch::kFloat16 || q_dtype == torch::kBFloat16, ...)
    assert q.dtype in (torch.float16, torch.bfloat16), q.dtype
    # TORCH_CHECK(k.dtype() == q_dtype, ...); TORCH_CHECK(v.dtype() == q_dtype, ...)
    assert k.dtype == q.dtype and v.dtype == q.dtype
    # TORCH_CHECK(cu_seqlens_q.dtype() == torch::kInt32, "cu_seqlens_q must have dtype int32")
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    # CHECK_DEVICE(q); CHECK_DEVICE(k); CHECK_DEVICE(v); CHECK_DEVICE(cu_seqlens_q); ...
    assert len({t.device for t in (q, k, v, cu_q, cu_k)}) == 1, "offsets on the tensors' device"
    # TORCH_CHECK(q.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    # CHECK_CONTIGUOUS(cu_seqlens_q); CHECK_CONTIGUOUS(cu_seqlens_k);
    assert cu_q.is_contiguous() and cu_k.is_contiguous()
    # CHECK_SHAPE(q, total_q, num_heads, head_size_og); CHECK_SHAPE(k, total_k, num_heads_k, ...)
    assert q.dim() == 3 and k.dim() == 3 and v.shape == k.shape and q.shape[2] == k.shape[2]
    # TORCH_CHECK(head_size_og <= 256, "FlashAttention forward only supports head dimension at
    # most 256"); head sizes not a multiple of 8 are padded (a copy): ours never are.
    assert q.shape[2] <= 256 and q.shape[2] % 8 == 0
    # TORCH_CHECK(num_heads % num_heads_k == 0, "Number of heads in key/value must divide ...")
    assert q.shape[1] % k.shape[1] == 0
    # CHECK_SHAPE(cu_seqlens_q, batch_size + 1); CHECK_SHAPE(cu_seqlens_k, batch_size + 1);
    assert cu_q.shape == cu_k.shape and cu_q.dim() == 1
    # int max_seqlen_q, const int max_seqlen_k: host ints, at least every segment's length
    assert type(max_q) is int and type(max_k) is int
    lens_q, lens_k = cu_q.diff(), cu_k.diff()
    assert int(cu_q[-1]) == q.shape[0] and int(cu_k[-1]) == k.shape[0]
    assert max_q >= int(lens_q.max()) and max_k >= int(lens_k.max())
    # A query sits at its segment's last positions: never more queries than keys (bottom-right
    # alignment would leave the first queries without keys).
    assert bool((lens_q <= lens_k).all())


def _math_attention(q, k, v, cu_q, cu_k, causal: bool, scale: float) -> torch.Tensor:
    """Per segment in fp32, GQA by repeating kv heads, causal aligned bottom-right."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:], strict=True):
        qs = q[q0:q1].float().transpose(0, 1)
        ks = k[k0:k1].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[k0:k1].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * scale
        if causal:
            n_q, n_k = int(q1 - q0), int(k1 - k0)
            allowed = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
            scores = scores.masked_fill(~allowed, float("-inf"))
        out[q0:q1] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal
):
    """flash-attn 2.7's signature (flash_attn_interface.py), keywords as our backend passes them:
    "If causal=True, the causal mask is aligned to the bottom right corner of the attention
    matrix" when seqlen_q != seqlen_k (its docstring, 2.1 and later)."""
    _flash_preconditions(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _math_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)


def varlen_attn(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, enable_gqa
):
    """torch 2.13's torch/nn/attention/varlen.py `varlen_attn`."""
    # if not enable_gqa and num_heads_q != num_heads_k: raise ValueError(...)
    # if enable_gqa and num_heads_q % num_heads_k != 0: raise ValueError(...)
    assert enable_gqa == (query.shape[1] != key.shape[1])
    # is_causal = window_size == (-1, 0); other windows are sliding windows
    assert window_size in ((-1, 0), (-1, -1)), window_size
    _flash_preconditions(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    return _math_attention(query, key, value, cu_seq_q, cu_seq_k, window_size == (-1, 0), scale)


class RaggedPrefillWrapper:
    """flashinfer 0.2's BatchPrefillWithRaggedKVCacheWrapper (flashinfer/prefill.py): `plan`
    once per batch with the indptrs and the problem's shape, then `run(q, k, v)` per layer."""

    def __init__(self, device: torch.device):
        self.device = device  # its workspace's: "the same as the device of the input tensors"
        self.planned = None

    def plan(
        self,
        qo_indptr,
        kv_indptr,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        *,
        causal,
        sm_scale,
        q_data_type,
    ):
        # _compute_mask_indptr / plan: if len(qo_indptr) != len(kv_indptr): raise ValueError(
        # "The length of qo_indptr and kv_indptr should be the same.")
        assert len(qo_indptr) == len(kv_indptr)
        # plan copies the indptrs to the host (qo_indptr.to("cpu")): host ones cost no sync
        assert qo_indptr.device.type == "cpu" and kv_indptr.device.type == "cpu"
        assert qo_indptr.dtype == torch.int32 and kv_indptr.dtype == torch.int32
        # the kernels take whole groups of query heads per kv head (GQA group size)
        assert num_qo_heads % num_kv_heads == 0
        # prebuilt (AOT) kernels exist for these head sizes only (flashinfer_limits.py)
        assert head_dim in FLASHINFER_HEAD_DIMS
        assert bool(((qo_indptr.diff()) <= kv_indptr.diff()).all())
        self.planned = (
            qo_indptr,
            kv_indptr,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            causal,
            sm_scale,
            q_data_type,
        )

    def run(self, q, k, v):
        assert self.planned is not None, "run before plan"
        qo, kv, heads, kv_heads, head_dim, causal, scale, dtype = self.planned
        # q [nnz_qo, num_qo_heads, head_dim], k/v [nnz_kv, num_kv_heads, head_dim] ("NHD")
        assert q.shape == (int(qo[-1]), heads, head_dim)
        assert k.shape == v.shape == (int(kv[-1]), kv_heads, head_dim)
        assert q.dtype == dtype and k.dtype == dtype and v.dtype == dtype
        assert q.device == k.device == v.device == self.device
        # causal=True equals a custom mask torch.tril(..., diagonal=kv_len - qo_len) (its
        # docstring's example): bottom-right aligned
        return _math_attention(q, k, v, qo, kv, causal, scale)


def _backends(spec: AttentionSpec) -> dict[str, AttentionBackend]:
    """Our GPU backends built on CPU with the stand-ins in place of their kernels."""
    flash = FlashAttention.__new__(FlashAttention)
    AttentionBackend.__init__(flash, spec)  # FlashAttention's own __init__ imports the wheel
    flash._kernel = flash_attn_varlen_func
    varlen = create_backend("torch", spec)
    varlen._varlen = varlen_attn
    backends = {"flash_attn": flash, "torch varlen_attn": varlen}
    if spec.head_dim in FLASHINFER_HEAD_DIMS:
        flashinfer = FlashInferAttention.__new__(FlashInferAttention)
        AttentionBackend.__init__(flashinfer, spec)  # its __init__ imports the wheel
        flashinfer._wrappers = [RaggedPrefillWrapper(spec.device) for _ in range(2)]
        flashinfer._next = 0
        backends["flashinfer"] = flashinfer
    return backends


def _layouts(prefix_reuse: bool, causal: bool):
    """(name, layout) for what the planner makes of texts that share a prefix and one-token
    texts, and (causal) of late chunking's texts (read-out segments): the forward's layout and
    the pruned last layer's."""
    planner = Planner(
        prefix_reuse=prefix_reuse,
        prune=True,
        readout=True,
        cache_bytes=2**24,
        bytes_per_token=1024,
        num_layers=2,
        device=torch.device("cpu"),
    )
    prefix = random_sequences([40], seed=41)[0]
    texts = [prefix + t for t in random_sequences([1, 9, 30], seed=42)]
    texts += random_sequences([1, 1, 17, 300], seed=43)
    ctx = planner.plan(*flatten([np.asarray(t) for t in texts]))
    shared = " (shared prefix)" if ctx.plan is not None else ""
    layouts = [(f"forward{shared}", ctx.layout), (f"pruned last layer{shared}", ctx.last)]
    if not causal:
        return layouts
    bodies = random_sequences([1, 60, 200], seed=44)
    chunked = [
        ChunkedText(np.array(b + [7]), np.array([(0, 1), (0, len(b)), (0, (len(b) + 1) // 2)]), 1)
        for b in bodies
    ]
    chunks = ChunkForward(chunked, readout=True, prune=True, device=torch.device("cpu")).context
    return [
        *layouts,
        ("late chunking", chunks.layout),
        ("late chunking, pruned last layer", chunks.last),
    ]


@pytest.mark.parametrize("prefix_reuse", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_backends_keep_the_kernels_contracts(prefix_reuse, head_dim, causal):
    if not causal and prefix_reuse:
        pytest.skip("prefix reuse needs causal attention")
    spec = AttentionSpec(HEADS, KV_HEADS, head_dim, causal, torch.device("cpu"), torch.bfloat16)
    reference = create_backend("torch", spec)  # the per-segment SDPA loop
    g = torch.Generator().manual_seed(head_dim)
    layouts = _layouts(prefix_reuse, causal)
    assert any(min(layout.q_lens) == 1 for _, layout in layouts)  # one-query rows
    if causal:  # read-out segments: fewer queries than keys, bottom-right
        assert any(
            q < k
            for _, layout in layouts
            for q, k in zip(layout.q_lens, layout.k_lens, strict=True)
        )
    if prefix_reuse:
        assert any(
            q < k
            for _, layout in layouts
            for q, k in zip(layout.q_lens, layout.k_lens, strict=True)
        )
    for name, layout in layouts:
        q = torch.randn(sum(layout.q_lens), HEADS, head_dim, generator=g).bfloat16()
        k, v = (
            torch.randn(sum(layout.k_lens), KV_HEADS, head_dim, generator=g).bfloat16()
            for _ in range(2)
        )
        reference.prepare(layout)
        expected = reference.forward(q, k, v, layout).float()
        for backend_name, backend in _backends(spec).items():
            backend.prepare(layout)
            out = backend.forward(q, k, v, layout).float()
            assert out.shape == expected.shape, (backend_name, name)
            torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


def test_the_stand_ins_refuse_what_the_kernels_refuse():
    """The checks can fail: the stand-ins are not a formality."""
    q = torch.randn(6, 4, 64).bfloat16()
    k = torch.randn(6, 2, 64).bfloat16()
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    flash_attn_varlen_func(q, k, k, cu, cu, 4, 4, 0.125, True)
    wide = torch.randn(6, 2, 264).bfloat16()
    bad = [
        (q.float(), k.float(), k.float(), cu, cu, 4, 4),  # fp32
        (q, k, k, cu.long(), cu, 4, 4),  # int64 offsets
        (q, k, k, cu, cu, torch.tensor(4), 4),  # a max length as a tensor
        (q, k, k, cu, cu, 3, 4),  # max_seqlen_q below a segment's length
        (torch.randn(6, 4, 128).bfloat16()[..., ::2], k, k, cu, cu, 4, 4),  # strided last dim
        (torch.randn(6, 3, 64).bfloat16(), k, k, cu, cu, 4, 4),  # 3 heads over 2 kv heads
        (torch.randn(6, 4, 264).bfloat16(), wide, wide, cu, cu, 4, 4),  # head size 264
        (q, k, k, cu, torch.tensor([0, 1, 6], dtype=torch.int32), 4, 4),  # 2 queries, 1 key
    ]
    for args in bad:
        with pytest.raises(AssertionError):
            flash_attn_varlen_func(*args, 0.125, True)
    with pytest.raises(AssertionError):  # heads differ without enable_gqa
        varlen_attn(q, k, k, cu, cu, 4, 4, scale=0.125, window_size=(-1, 0), enable_gqa=False)
