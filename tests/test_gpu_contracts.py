"""Our side of the GPU libraries' contracts, checked on CPU: NOT a GPU run.

The calls our GPU backends make (flash-attn's `flash_attn_varlen_func`, PyTorch's
`aten::_flash_attention_forward`, flashinfer's ragged prefill `plan`/`run`, torch's NCCL
process group) go to
stand-ins that enforce what those libraries check before they launch a kernel, and then compute
with a plain math path (attention bottom-right causal, as FlashAttention 2.1+ and flashinfer
align it; all-reduces over gloo). Each check cites the source line it comes from, at the
versions we pin: flash-attn v2.7.4 (`csrc/flash_attn/flash_api.cpp`, `flash_attn_interface.py`),
flashinfer v0.2.5 (`flashinfer/prefill.py`, `flashinfer/utils.py`), torch 2.13.0
(`torch/nn/attention/varlen.py` and `torch/include/torch/csrc/distributed/c10d/
ProcessGroupNCCL.hpp` as the wheel ships them; `ProcessGroupNCCL.cpp` ships in no wheel, so its
tensor checks are quoted by function and message).

They run for every layout the planner makes: plain varlen batches, shared prefixes (fewer
queries than keys), the pruned last layer (one query row per text), one-token texts, late
chunking's read-outs, GQA, head sizes 64 and 128 (flashinfer: 128), causal and bidirectional;
the outputs are compared with the torch backend's per-segment SDPA loop. The NCCL stand-in runs
a two-rank forward over the same kinds of batches and compares both ranks' collectives.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from qwen_embed import parallel
from qwen_embed.attention import AttentionSpec, create_backend
from qwen_embed.attention.base import AttentionBackend
from qwen_embed.attention.flash_attn import FlashAttention
from qwen_embed.attention.flashinfer import FlashInferAttention
from qwen_embed.attention.flashinfer_limits import FLASHINFER_HEAD_DIMS
from qwen_embed.batch import flatten
from qwen_embed.chunking import ChunkedText, ChunkForward
from qwen_embed.engine import TORCH_DTYPES, build_model
from qwen_embed.engine import plan as engine_plan
from qwen_embed.layers import TPGroup
from qwen_embed.parallel import RankSpec
from qwen_embed.segments import MIN_PREFIX_TOKENS, Planner
from qwen_embed.settings import EncoderSettings

from reference import random_sequences

HEADS, KV_HEADS = 8, 2


def _flash_preconditions(q, k, v, cu_q, cu_k, max_q, max_k) -> None:
    """What FlashAttention-2's varlen forward checks (flash_api.cpp `mha_varlen_fwd`, line 515;
    PyTorch's aten::_flash_attention_forward reaches the same checks in ATen's copy of it)."""
    # :545 TORCH_CHECK(q_dtype == torch::kFloat16 || q_dtype == torch::kBFloat16, ...)
    assert q.dtype in (torch.float16, torch.bfloat16), q.dtype
    # :547-548 TORCH_CHECK(k.dtype() == q_dtype, ...); TORCH_CHECK(v.dtype() == q_dtype, ...)
    assert k.dtype == q.dtype and v.dtype == q.dtype
    # :549-550 TORCH_CHECK(cu_seqlens_q.dtype() == torch::kInt32, "cu_seqlens_q must have ...")
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    # :552-554 CHECK_DEVICE(q); CHECK_DEVICE(k); CHECK_DEVICE(v); CHECK_DEVICE(cu_seqlens_q); ...
    assert len({t.device for t in (q, k, v, cu_q, cu_k)}) == 1, "offsets on the tensors' device"
    # :565-567 TORCH_CHECK(q.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    # :568-569 CHECK_CONTIGUOUS(cu_seqlens_q); CHECK_CONTIGUOUS(cu_seqlens_k);
    assert cu_q.is_contiguous() and cu_k.is_contiguous()
    # :611, :614-615 CHECK_SHAPE(q, total_q, num_heads, head_size); CHECK_SHAPE(k, total_k, ...)
    assert q.dim() == 3 and k.dim() == 3 and v.shape == k.shape and q.shape[2] == k.shape[2]
    # :604 TORCH_CHECK(head_size <= 256, "FlashAttention forward only supports head dimension at
    # most 256"); :605 head_size % 8 == 0 (flash_attn_interface.py:548-552 pads other sizes,
    # a copy: ours never are)
    assert q.shape[2] <= 256 and q.shape[2] % 8 == 0
    # :606 TORCH_CHECK(num_heads % num_heads_k == 0, "Number of heads in key/value must divide
    # number of heads in query")
    assert q.shape[1] % k.shape[1] == 0
    # :622-623 CHECK_SHAPE(cu_seqlens_q, batch_size + 1); CHECK_SHAPE(cu_seqlens_k, ...)
    assert cu_q.shape == cu_k.shape and cu_q.dim() == 1
    # :525-526 int max_seqlen_q, const int max_seqlen_k: host ints, at least every segment's
    # length (the kernels size their grids by them)
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
    """flash-attn 2.7.4's signature (flash_attn_interface.py:1375), keywords as our backend
    passes them: "If causal=True, the causal mask is aligned to the bottom right corner of the
    attention matrix" when seqlen_q != seqlen_k (its docstring, :1399)."""
    _flash_preconditions(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _math_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)


def flash_attention_forward(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, dropout_p, is_causal, debug, **kw
):
    """PyTorch's `aten::_flash_attention_forward`: the call bound to this torch's own schema
    and its shapes checked by the operator's meta kernel (the real operator, on the meta
    device), then FlashAttention's checks, then the math path. torch 2.13's varlen_attn makes
    the same call (varlen.py:109): no dropout, no debug mask, causal as window (-1, 0); 8
    key/value heads beside 16 query heads are read as groups (seen on an H200 through 2.11's
    varlen_attn)."""
    meta = [t.to("meta") for t in (query, key, value, cu_seq_q, cu_seq_k)]
    out = torch.ops.aten._flash_attention_forward(
        *meta, max_q, max_k, dropout_p, is_causal, debug, **kw
    )[0]
    assert out.shape == query.shape and out.dtype == query.dtype
    assert dropout_p == 0.0 and not debug
    assert (kw["window_size_left"], kw["window_size_right"]) == (-1, 0 if is_causal else -1)
    _flash_preconditions(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    attended = _math_attention(query, key, value, cu_seq_q, cu_seq_k, is_causal, kw["scale"])
    return attended, None, None, None, None


class RaggedPrefillWrapper:
    """flashinfer 0.2.5's BatchPrefillWithRaggedKVCacheWrapper (prefill.py:1721): `plan`
    (:1947) once per batch with the indptrs and the problem's shape, then `run(q, k, v)`
    (:2227) per layer."""

    def __init__(self, device: torch.device):
        # :1831 its workspace "buffer should be the same as the device of the input tensors"
        self.device = device
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
        # :2057-2061 if len(kv_indptr) != batch_size + 1: raise ValueError("The kv_indptr
        # length should be equal to mask_indptr length.")
        assert len(qo_indptr) == len(kv_indptr)
        # :2073-2074 qo_indptr.to("cpu"), kv_indptr.to("cpu"): host indptrs cost no sync
        assert qo_indptr.device.type == "cpu" and kv_indptr.device.type == "cpu"
        assert qo_indptr.dtype == torch.int32 and kv_indptr.dtype == torch.int32
        # :2041 "The num_qo_heads must be a multiple of num_kv_heads"
        assert num_qo_heads % num_kv_heads == 0
        # setup.py:30 FLASHINFER_HEAD_DIMS "128,256": the prebuilt (AOT) kernels' head sizes
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
        # :2243-2247 q [qo_indptr[-1], num_qo_heads, head_dim_qk], k/v [kv_indptr[-1],
        # num_kv_heads, head_dim] ("NHD")
        assert q.shape == (int(qo[-1]), heads, head_dim)
        assert k.shape == v.shape == (int(kv[-1]), kv_heads, head_dim)
        # :2266 _check_cached_qkv_data_type (utils.py:196-206): q and k as planned
        assert q.dtype == dtype and k.dtype == dtype and v.dtype == dtype
        assert q.device == k.device == v.device == self.device
        # causal=True equals a custom mask torch.tril(..., diagonal=kv_len - qo_len) (its
        # docstring's example, :1776-1778): bottom-right aligned
        return _math_attention(q, k, v, qo, kv, causal, scale)


def _backends(spec: AttentionSpec) -> dict[str, AttentionBackend]:
    """Our GPU backends built on CPU with the stand-ins in place of their kernels."""
    flash = FlashAttention.__new__(FlashAttention)
    AttentionBackend.__init__(flash, spec)  # FlashAttention's own __init__ imports the wheel
    flash._kernel = flash_attn_varlen_func
    varlen = create_backend("torch", spec)
    varlen.use_varlen(flash_attention_forward)
    backends = {"flash_attn": flash, "torch varlen FlashAttention": varlen}
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
    window = {"scale": 0.125, "window_size_left": -1, "window_size_right": 0}
    flash_attention_forward(q, k, k, cu, cu, 4, 4, 0.0, True, False, **window)
    with pytest.raises(AssertionError):  # causal without its window
        flash_attention_forward(
            q, k, k, cu, cu, 4, 4, 0.0, True, False, **window | {"window_size_right": -1}
        )
    with pytest.raises((TypeError, RuntimeError)):  # a keyword the operator does not take
        flash_attention_forward(q, k, k, cu, cu, 4, 4, 0.0, True, False, window_size=(-1, 0))


# The types ProcessGroupNCCL.cpp's getNcclDataType maps to NCCL's (bool as uint8); any other
# is refused ("Unsupported data type for NCCL process group").
NCCL_DTYPES = (
    *(torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool),
    *(torch.float16, torch.bfloat16, torch.float32, torch.float64),
)


class NCCLOptions:
    """ProcessGroupNCCL.Options (hpp:512, `struct Options : Backend::Options`): its `timeout`
    (Backend.hpp:48) is bound to Python as `_timeout`, a timedelta."""

    def __init__(self):
        self._timeout = None


class ProcessGroupNCCL:
    """What torch's NCCL group takes and checks, reduced over gloo; the forward it serves runs
    on CPU in place of the device the group is bound to. Records every collective, so that
    the test can compare the ranks' sequences: NCCL itself checks nothing across ranks, and
    ranks that issue different collectives hang or reduce each other's garbage."""

    Options = NCCLOptions
    bound: dict[int, torch.device] = {}  # rank -> device, one group of this test at a time

    def __init__(self, store, rank, size, options):
        # hpp:762-766 ProcessGroupNCCL(c10::intrusive_ptr<Store> store, int rank, int size,
        # c10::intrusive_ptr<Options> options)
        assert isinstance(store, dist.Store)
        assert 0 <= rank < size
        assert isinstance(options, NCCLOptions) and isinstance(options._timeout, timedelta)
        self.store, self.rank, self.size, self.timeout = store, rank, size, options._timeout
        self.device, self._gloo = None, None
        self.calls: list[tuple[tuple[int, ...], torch.dtype]] = []

    def eager_connect_single_device(self, device):
        # hpp:987 eagerConnectSingleDevice(at::Device device): the communicator of this rank's
        # GPU; NCCL refuses two ranks of one communicator on one GPU (ncclInvalidUsage,
        # "Duplicate GPU detected")
        assert isinstance(device, torch.device) and device.type == "cuda"
        assert device.index is not None
        taken = {d for r, d in ProcessGroupNCCL.bound.items() if r != self.rank}
        assert device not in taken, f"{device} taken twice"
        ProcessGroupNCCL.bound[self.rank] = self.device = device

    def allreduce(self, tensors):
        # ours: the communicator exists at load, before the first forward
        assert self.device is not None, "no eager_connect_single_device before the forward"
        # hpp:842-844 allreduce(std::vector<at::Tensor>& tensors, ...); the .cpp's
        # check_gpu_single_tensor: one tensor, "Tensors must be CUDA and dense" (CPU here, in
        # place of the bound GPU), "Tensors must be contiguous"; reduced in place
        assert isinstance(tensors, list) and len(tensors) == 1
        (t,) = tensors
        assert t.layout == torch.strided and t.is_contiguous(), "dense and contiguous"
        assert t.dtype in NCCL_DTYPES, t.dtype
        call = (tuple(t.shape), t.dtype)
        self._same_on_every_rank(len(self.calls), repr(call))
        self.calls.append(call)
        if self._gloo is None:
            self._gloo = dist.ProcessGroupGloo(self.store, self.rank, self.size, self.timeout)
        return self._gloo.allreduce(tensors)

    def _same_on_every_rank(self, n: int, call: str) -> None:
        """The n-th collective of every rank is this one, checked before it runs: over gloo a
        mismatch aborts the process, over NCCL it hangs or mixes up data."""
        self.store.set(f"call/{n}/{self.rank}", call)
        for r in range(self.size):
            self.store.wait([f"call/{n}/{r}"], timedelta(seconds=60))
            theirs = self.store.get(f"call/{n}/{r}").decode()
            assert theirs == call, f"collective {n}: rank {self.rank} {call}, rank {r} {theirs}"


def _nccl_specs(model_dir, dtype: str) -> tuple[RankSpec, RankSpec]:
    """(the GPU spec `_make_groups` sees, the CPU spec the stand-in's forward runs): tp 2,
    prefix reuse and pruning on."""
    settings = EncoderSettings(
        tp_size=2, dtype=dtype, prefix_reuse="on", max_batch_tokens=512, device="cpu"
    )
    model_dir, _, route = engine_plan(model_dir, settings)
    cpu = RankSpec(str(model_dir), settings, route)
    return replace(cpu, route=replace(route, device="cuda:1")), cpu


def _nccl_batches() -> list[list[list[int]]]:
    prefix = random_sequences([MIN_PREFIX_TOKENS + 8], seed=51)[0]
    return [
        random_sequences([1, 9, 77, 200], seed=52),  # plain
        [prefix + t for t in random_sequences([1, 5, 30], seed=53)],  # computes the prefix
        [prefix + t for t in random_sequences([2, 1], seed=54)] + [[4, 5]],  # reuses it
    ]


def _chunked() -> list[ChunkedText]:
    bodies = random_sequences([40, 90], seed=55)
    spans = [np.array([(0, len(b)), (0, len(b) // 2)]) for b in bodies]
    return [ChunkedText(np.array(b + [7]), s, 1) for b, s in zip(bodies, spans, strict=True)]


def _run_rank(model, batches, chunks) -> list[torch.Tensor]:
    """What a rank runs per batch (parallel.serve_rank): plan, forward, commit."""
    outs = []
    planner = model.planner
    with torch.inference_mode():
        contexts = [lambda b=b: planner.plan(*flatten([np.asarray(t) for t in b])) for b in batches]
        contexts.append(
            lambda: ChunkForward(chunks, planner.readout, planner.prune, planner.device).context
        )
        for make in contexts:
            ctx = make()
            outs.append(model(ctx).float().clone())
            planner.commit(ctx)
        outs.append(torch.tensor(planner.cache.hits))
    return outs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tensor_parallel_keeps_nccls_contract(checkpoint, monkeypatch, dtype):
    """Two ranks' groups built as for GPUs (`parallel._make_groups`), then a forward over plain
    batches, a shared prefix computed and reused, pruned last layers and late chunking, with the
    stand-in as the data group: every collective is one dense contiguous tensor of an NCCL type,
    both ranks issue the same collectives in the same order, the control group stays gloo, and
    rank 0's output is the one-rank model's."""
    monkeypatch.setattr(parallel.dist, "ProcessGroupNCCL", ProcessGroupNCCL, raising=False)
    monkeypatch.setattr(ProcessGroupNCCL, "bound", {})
    gpu_spec, cpu_spec = _nccl_specs(checkpoint("qwen3"), dtype)
    assert cpu_spec.route.prefix_reuse and cpu_spec.route.prune
    store = dist.HashStore()
    batches, chunks = _nccl_batches(), _chunked()

    def rank(r: int):
        control, tp = parallel._make_groups(gpu_spec, r, store)
        assert isinstance(control, dist.ProcessGroupGloo)  # CPU tensors, idle waits
        assert isinstance(tp.group, ProcessGroupNCCL) and (tp.rank, tp.size) == (r, 2)
        model = build_model(cpu_spec, tp)
        return tp.group, _run_rank(model, batches, chunks)

    with ThreadPoolExecutor(2) as pool:
        (group0, outs0), (group1, outs1) = pool.map(rank, range(2))
    single = _run_rank(build_model(cpu_spec, TPGroup()), batches, chunks)

    assert torch.get_default_dtype() == torch.float32  # two models built at once restore it
    assert ProcessGroupNCCL.bound == {0: torch.device("cuda", 1), 1: torch.device("cuda", 2)}
    assert group0.calls == group1.calls  # warm-up and every forward alike
    assert {dt for _, dt in group0.calls} == {TORCH_DTYPES[dtype]}
    assert len({shape for shape, _ in group0.calls}) > 2  # full, pruned and chunked rows
    assert int(outs0[-1]) == int(outs1[-1]) > 0  # the prefix hit on both ranks
    tolerance = 1e-5 if dtype == "float32" else 3e-2
    for got, want in zip(outs0[:-1], single[:-1], strict=True):
        torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


def test_the_nccl_stand_in_refuses_what_nccl_refuses(monkeypatch):
    monkeypatch.setattr(ProcessGroupNCCL, "bound", {})
    options = NCCLOptions()
    options._timeout = timedelta(seconds=5)
    group = ProcessGroupNCCL(dist.HashStore(), 0, 1, options)
    with pytest.raises(AssertionError):  # before the communicator
        group.allreduce([torch.ones(4)])
    group.eager_connect_single_device(torch.device("cuda", 0))
    group.allreduce([torch.ones(4)]).wait()
    bad = [
        [torch.ones(4), torch.ones(4)],  # two tensors
        [torch.ones(4, 4).t()],  # not contiguous
        [torch.ones(4).to_sparse()],  # sparse
        [torch.ones(4, dtype=torch.complex64)],  # no NCCL type (torch's Python API splits it)
    ]
    for tensors in bad:
        with pytest.raises(AssertionError):
            group.allreduce(tensors)
    other = ProcessGroupNCCL(dist.HashStore(), 1, 2, options)
    with pytest.raises(AssertionError):  # one GPU for two ranks
        other.eager_connect_single_device(torch.device("cuda", 0))
    with pytest.raises(AssertionError):  # a CPU device
        other.eager_connect_single_device(torch.device("cpu"))
    with pytest.raises(AssertionError):  # options without a timeout
        ProcessGroupNCCL(dist.HashStore(), 0, 1, NCCLOptions())
