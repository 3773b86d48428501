"""The public engine: `Encoder.from_pretrained(...)`, then `encoder.embed(token_id_lists)` or,
for a reranker (`task="rerank"`), `encoder.score(token_id_lists)`."""

from __future__ import annotations

import logging
import threading
import weakref
from collections import Counter
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from . import int8, kernels
from .adapters import lora_deltas
from .attention import AttentionSpec, choose_backend, create_backend
from .attention_pooling import build_pooler
from .avx2_gemm import Avx2F32Weight
from .batch import HostResult, HostRows, finish, flatten, plan_batches, pool, pool_spans
from .chunking import ChunkedText, ChunkForward, check_chunks, pack_texts
from .config import MULTI_VECTOR_ONLY, ModelConfig
from .cpu import HeapTrimmer, cpu_features, keep_freed_memory
from .cuda_graphs import TokenGraphs, buckets_up_to, cuda_capture
from .fp8 import Fp8Weight
from .heads import build_head, build_token_head, listwise_scores
from .hub import resolve_checkpoint
from .int8 import Int8Weight
from .layers import TPGroup, _Linear, linear_weight_dtype
from .loader import check_files, checkpoint_dtypes, checkpoint_names, layer_tensors, load_weights
from .lora import adapter_folders, attach
from .media import MediaForward, MediaText, visual_spans
from .models import model_class
from .models.vision import TOWER, VisionTower
from .onednn import NativeBf16Weight, PackedWeight
from .onednn import available as onednn_available
from .parallel import RankSpec, TPLauncher, wait_for_device
from .route import Gemm, Linear, Route, choose_route
from .segments import BASE, MIN_PREFIX_TOKENS, ForwardContext, Planner, PrefixCache
from .settings import EncoderSettings

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
log = logging.getLogger(__name__)
# A call's adapters (lora.py): one name for all its texts, or one per text; None: the base.
Adapters = str | Sequence[str | None] | None
# Activation-sized rows one forward holds per token, in units of hidden_size, beside the MLP's
# gate|up output and its product (3 x intermediate_size): residual, norms, q|k|v, attention
# output, rotary copies and the allocator's slack. Sizes the freed memory a CPU rank keeps.
HIDDEN_ROWS_PER_TOKEN = 20


def plan(model_dir: str | Path, settings: EncoderSettings) -> tuple[Path, ModelConfig, Route]:
    """(local checkpoint directory, its config, the route) an encoder with these settings
    takes on this machine, without loading weights (their files checked whole)."""
    model_dir = resolve_checkpoint(model_dir)
    config = ModelConfig.from_dir(model_dir)
    check_files(model_dir)
    device = resolve_device(settings.device, settings.tp_size)
    return (
        model_dir,
        config,
        choose_route(settings, config, device, cpu_features(), onednn_available()),
    )


class HostWeights(NamedTuple):
    """host_weights': the decoder layers' elements, and the bytes they take at least."""

    elements: int
    bytes: int


def host_weights(model_dir: str | Path, config: ModelConfig, route: Route) -> HostWeights:
    """At least what one encoder on this route holds in host memory for its weights once
    loaded: its decoder layers' tensors, each element at the bytes the route keeps it in (1
    where it quantises; 4 where it holds 16-bit weights in fp32 or computes in fp32, except on
    a GEMM that packs 16-bit weights itself (`_takes_16_bit`: bf16 values stay bf16): there the
    narrower of the stored and the route's width; else the route's dtype's), which the loader
    copies into the process's own memory. Nothing (0, 0) on a GPU (they live there) and for a
    GGUF checkpoint (not counted). The rest (the embedding table, mapped from its file and
    shared; norms, heads, a vision tower; the forward's activations) is left out: a floor, not
    an estimate."""
    tensors = layer_tensors(model_dir, config.num_layers) if route.device == "cpu" else None
    if tensors is None:
        return HostWeights(0, 0)
    elements = sum(n for n, _ in tensors)
    if route.linear in (Linear.INT8, Linear.FP8):
        return HostWeights(elements, elements)
    held = 4 if route.linear is Linear.FP32_GEMM else TORCH_DTYPES[route.dtype].itemsize
    if not _takes_16_bit(FLOAT_GEMMS[route.gemm]):
        return HostWeights(elements, elements * held)
    return HostWeights(elements, sum(n * min(held, stored // max(n, 1)) for n, stored in tensors))


class EncoderBroken(RuntimeError):
    """A tensor-parallel forward failed on some rank: the group's collectives can no longer
    pair up, so the workers are stopped and the encoder answers only this error until it is
    loaded again (the Triton model exits its stub for the launcher's watchdog to reload it)."""


def check_gpu_group(index: int, tp_size: int, device_count: int) -> None:
    """A TP group starting at cuda:index needs GPUs index .. index + tp_size - 1."""
    if index + tp_size > device_count:
        raise ValueError(
            f"tp_size={tp_size} from cuda:{index} needs GPUs {index}..{index + tp_size - 1}, "
            f"but this machine has {device_count}"
        )


def resolve_device(setting: str, tp_size: int) -> str:
    """settings.device as a concrete device: "auto" is cuda:0 where CUDA is present."""
    device = torch.device(
        setting if setting != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        check_gpu_group(device.index, tp_size, torch.cuda.device_count())
    return str(device)


def build_model(spec: RankSpec, tp: TPGroup) -> nn.Module:
    """This rank's shard of the model on its device, weights loaded, warmed up."""
    config = ModelConfig.from_dir(spec.model_dir)
    route, device = spec.route, spec.device_for(tp.rank)
    _prepare_device(device)
    deltas = lora_deltas(spec.model_dir, route.adapter)
    model = _instantiate(config, spec, tp, device, deltas)
    # A rank without the vision tower (_instantiate) leaves its weights unread.
    skip = (TOWER,) if config.media is not None and model.visual is None else ()
    if not deltas and route.dtype == "float32" and _takes_16_bit(FLOAT_GEMMS[route.gemm]):
        _linears_as_stored(model, spec.model_dir)
    if route.lora_names:  # by shape, before the q|k|v split and repacking, which carry them
        folders = adapter_folders(spec.settings.lora_modules, Path(spec.model_dir))
        dtype = linear_weight_dtype(TORCH_DTYPES[route.dtype], device)
        model.adapters = attach(model, folders, dtype, device)
    keep = forward_bytes(config, spec.settings.max_batch_tokens, route.dtype, tp.size)
    layers = _LayerByLayer(model, route, device, keep)
    load_weights(model, spec.model_dir, deltas, skip, loaded=layers.loaded)
    layers.convert_rest()
    model.eval()
    _warm_up(model)
    if route.cuda_graph_tokens:
        buckets = buckets_up_to(route.cuda_graph_tokens)
        model.graphs = TokenGraphs(model, buckets, cuda_capture(device))
    if device.type == "cpu":  # after loading: what it freed goes back first
        model.register_forward_hook(HeapTrimmer(keep))
    return model


def _linears_as_stored(model: nn.Module, model_dir: str) -> None:
    """Before loading, for an fp32 model on our AVX2 GEMM (which keeps bf16 values in bf16:
    avx2_gemm.pack; the int8 route quantises them as it would their fp32 copies): each linear
    weight whose checkpoint tensors are all bf16 gets bf16 storage, so the load never holds
    the fp32 model (the fp32 storage it replaces was never touched). A layer fed by any other
    dtype, or changed by merged adapters (not called then), loads in fp32 as before."""
    stored = checkpoint_dtypes(model_dir)
    sources: dict[int, list] = {}
    for name, targets in checkpoint_names(model).items():
        for param, _ in targets:
            sources.setdefault(id(param), []).append(stored.get(name))
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, _Linear) and weight is not None:
            dtypes = sources.get(id(weight), [])
            if dtypes and all(d == torch.bfloat16 for d in dtypes):
                weight.data = torch.empty(weight.shape, dtype=torch.bfloat16)


def _prepare_device(device: torch.device) -> None:
    if device.type == "cpu":
        keep_freed_memory()
    else:  # every rank, 0 included: kernels without a device guard launch on the current one
        torch.cuda.set_device(device)


_DEFAULT_DTYPE = threading.Lock()


def _instantiate(
    config: ModelConfig, spec: RankSpec, tp: TPGroup, device: torch.device, deltas
) -> nn.Module:
    """The empty model with its attention backend, planner and (rank 0) task heads, the
    projections among them changed by the merged adapter's `deltas`."""
    route, settings = spec.route, spec.settings
    dtype = TORCH_DTYPES[route.dtype]
    kv_heads = max(1, config.num_kv_heads // tp.size)
    backend = create_backend(
        route.attn_backend,
        AttentionSpec(
            num_heads=config.num_heads // tp.size,
            num_kv_heads=kv_heads,
            head_dim=config.head_dim,
            causal=config.is_causal,
            device=device,
            dtype=dtype,
        ),
    )
    # Keys and values of one token in every full-attention layer of this shard, and a
    # linear-attention layer's state and last inputs: the prefix cache's units.
    hybrid = config.linear_attention
    linear = sum(hybrid.layers) if hybrid else 0
    bytes_per_token = (config.num_layers - linear) * 2 * kv_heads * config.head_dim * dtype.itemsize
    bytes_per_entry = 0
    if hybrid:
        state = hybrid.value_heads // tp.size * hybrid.key_head_dim * hybrid.value_head_dim * 4
        channels = (2 * hybrid.key_dim + hybrid.value_dim) // tp.size  # the convolution's
        bytes_per_entry = linear * (state + (hybrid.conv_kernel - 1) * channels * dtype.itemsize)
    planner = Planner(
        prefix_reuse=route.prefix_reuse,
        prune=route.prune,
        readout=config.is_causal and route.pooling == "last",
        cache_bytes=int(settings.prefix_cache_mb * 2**20),
        bytes_per_token=bytes_per_token,
        num_layers=config.num_layers,
        device=device,
        bytes_per_entry=bytes_per_entry,
    )
    head = token_head = pooler = None
    if tp.rank == 0:  # only rank 0 reads the final hidden states
        head = build_head(route.task, config, spec.model_dir, deltas)
        head = head.to(device) if head is not None else None
        pooler = build_pooler(config, route)
        pooler = pooler.to(device) if pooler is not None else None
        if route.task == "embed":
            token_head = head if config.multi_vector else build_token_head(config, deltas)
            token_head = token_head.to(device) if token_head is not None else None
    # The default dtype is the process's: models built in several threads at once (ranks of a
    # test, encoders loaded side by side) must not restore each other's.
    with _DEFAULT_DTYPE:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                ops = kernels.load(route.elementwise)
                model = model_class(config.family)(config, tp, backend, planner, head, ops)
                model.token_head = token_head
                model.pooler = pooler
                # rank 0 runs the tower (media.MediaForward.embed sends its tokens on)
                if config.media is not None and tp.rank == 0:
                    vision = config.media.vision
                    name, _ = choose_backend(str(device), vision.head_dim, dtype=route.dtype)
                    model.visual = VisionTower(vision, name, device, dtype, ops)
                return model
        finally:
            torch.set_default_dtype(previous)


# The float linear layers' kernel for each Gemm; None: F.linear on the weight as held.
FLOAT_GEMMS = {
    Gemm.TORCH: None,
    Gemm.ONEDNN: PackedWeight,
    Gemm.NATIVE_BF16: NativeBf16Weight,
    Gemm.NATIVE_F32: Avx2F32Weight,
}


def _takes_16_bit(kernel: type[nn.Module] | None) -> bool:
    """A float GEMM that packs 16-bit weights itself (avx2_gemm.Avx2F32Weight), where the
    others need the fp32 copies linear_weight_dtype asks for."""
    return getattr(kernel, "takes_16_bit_weights", False)


class _LayerByLayer:
    """Each decoder layer cut (split_qkv) and its linear layers converted (_convert_linears).
    A quantising route (int8, fp8) does it as soon as the last of the layer's weights is
    loaded (load_weights' `loaded`), so that the load holds one layer in the checkpoint's
    floats beside the quantised others, never the whole float model; on CPU the freed heap
    beyond `keep_bytes` (one full-budget forward's activations, what serving may hold) goes
    back after each layer. A float route's packing (the same bytes) waits for the whole load
    (packed as they are read, the copies landed apart from the freed ones: docs/tuning.md),
    then goes a layer at a time (`convert_rest`), on CPU handing every freed page back after
    each, so that the peak is the loaded model's size whatever the heap's history. `convert_rest`
    also converts the linear layers outside the decoder layers (the vision tower's)."""

    def __init__(self, model: nn.Module, route: Route, device: torch.device, keep_bytes: int):
        self.model, self.route, self.device = model, route, device
        quantizes = route.linear in (Linear.INT8, Linear.FP8)
        self.apart = int8.FLOAT_SHARDS if quantizes else {}
        self.trimmer = HeapTrimmer(keep_bytes) if quantizes and device.type == "cpu" else None
        self.layer_of: dict[int, int] = {}  # a parameter the checkpoint feeds -> its layer
        if quantizes:
            layers = {id(p): i for i, layer in enumerate(model.layers) for p in layer.parameters()}
            for targets in checkpoint_names(model).values():
                self.layer_of.update((id(p), layers[id(p)]) for p, _ in targets if id(p) in layers)
        self.unread = Counter(self.layer_of.values())  # parameters left to read, per layer
        self.converted: set[int] = set()

    def loaded(self, param: nn.Parameter) -> None:
        index = self.layer_of.get(id(param))
        if index is None:
            return
        self.unread[index] -= 1
        if not self.unread[index]:
            self.model.split_qkv(index, self.apart, self.route.prune)
            self._convert(self.model.layers[index], f"layers.{index}.")
            self.converted.add(index)
            if self.trimmer is not None:  # its float copies and the conversion's temporaries
                self.trimmer()

    def convert_rest(self) -> None:
        # A float route's packed copies stay, and no forward has run whose activations a kept
        # heap would serve: every freed page goes back after each layer.
        trimmer = HeapTrimmer(0) if self.device.type == "cpu" else None
        for index, layer in enumerate(self.model.layers):
            if index not in self.converted:
                self.model.split_qkv(index, self.apart, self.route.prune)
                self._convert(layer, f"layers.{index}.")
                self.converted.add(index)
                if trimmer is not None:
                    trimmer()
        self._convert(self.model, "", skip=tuple(f"layers.{i}." for i in self.converted))

    def _convert(self, module: nn.Module, prefix: str, skip: tuple[str, ...] = ()) -> None:
        linears = {
            prefix + name: m
            for name, m in module.named_modules()
            if isinstance(m, _Linear) and not name.startswith(skip)
        }
        _convert_linears(linears, self.route, TORCH_DTYPES[self.route.dtype], self.device)


def _convert_linears(
    linears: dict[str, _Linear], route: Route, dtype: torch.dtype, device: torch.device
) -> None:
    """The linear layers' weights (by their names in the model) in the form the route
    multiplies them in, converted and packed a layer at a time: a 16-bit model whose layers a
    packing GEMM holds for fp32 math (linear_weight_dtype) never holds every layer's fp32 copy
    at once, and a GEMM that packs 16-bit weights itself gets them before the widening, which
    then reaches the bias alone. The vision tower's take the route's float GEMM as the text
    model's float layers do, and stay in floats under int8 and fp8 (their accuracy there is
    unmeasured)."""
    tower = {n: linears.pop(n) for n in list(linears) if n.startswith(TOWER)}
    quantized = {
        Linear.INT8: Int8Weight,
        Linear.FP8: partial(Fp8Weight, ops=kernels.load(route.elementwise)),
    }.get(route.linear)
    if quantized is not None:
        for name in [n for n in linears if int8.quantizes(n)]:
            linears.pop(name).repack(quantized)
    kernel = FLOAT_GEMMS[route.gemm]
    weight_dtype = linear_weight_dtype(dtype, device)
    for module in [*linears.values(), *tower.values()]:
        if _takes_16_bit(kernel):
            module.repack(kernel)
        if weight_dtype != dtype:
            module.to(weight_dtype)  # the weight where not packed yet, and the bias
        if kernel is not None and module.weight is not None:
            module.repack(kernel)


def forward_bytes(config: ModelConfig, max_batch_tokens: int, dtype: str, tp_size: int) -> int:
    """About what one full-budget forward allocates on a rank: what HeapTrimmer keeps."""
    per_token = 3 * config.intermediate_size // tp_size + HIDDEN_ROWS_PER_TOKEN * config.hidden_size
    return max_batch_tokens * per_token * TORCH_DTYPES[dtype].itemsize


def _warm_up(model: nn.Module) -> None:
    """Tiny forwards with every shape class a real one meets (many rows and one row, in the
    pruned last layer too, and in the shared-prefix paths), so that one-time work (kernel
    plans, allocations, lazy initialisation) happens at load and ready means a forward ran.
    Prefixes go to a throwaway cache. Every TP rank runs the same forwards unconditionally, so
    their all-reduces pair up."""
    batches = [[[0, 1, 2], [3]], [[4]], [[5, 6, 7]]]
    planner = model.planner
    if planner.prefix_reuse:  # shared prefixes: computed in the batch, then from the cache
        prefix = list(range(10, 10 + MIN_PREFIX_TOKENS + 2))
        batches += [
            [prefix + [30, 31], prefix + [32]],
            [prefix + [33]],
            [prefix + [34, 35], prefix + [36, 37, 38]],
            [prefix + [39], [40, 41, 42]],
        ]
    kept, planner.cache = planner.cache, PrefixCache(2**30, 0, planner.cache.num_layers)
    try:
        for sequences in batches:
            ctx = planner.plan(*flatten([np.array(s) for s in sequences]))
            model(ctx)
            planner.commit(ctx)  # into the warm-up's own cache, dropped below
    finally:
        planner.cache = kept


class Encoder:
    """Embeds (or, with task "rerank", scores) lists of token ids with a (possibly
    tensor-parallel) Qwen2/Qwen3 model.

    Thread-safe: concurrent calls are serialised (one forward at a time per encoder).
    """

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        settings: EncoderSettings,
        route: Route,
        launcher: TPLauncher | None,
    ):
        self.model = model
        self.config = config
        self.settings = settings
        self.route = route
        self.task = route.task
        self.device = torch.device(route.device)
        self.max_batch_tokens = settings.max_batch_tokens
        self._launcher = launcher
        self._broken: str | None = None  # why a TP forward failed; then every call fails
        self._lock = threading.Lock()
        # Tokens sent in vs tokens the forward computed (fewer when prefixes are shared).
        self.stats = {"received_tokens": 0, "computed_tokens": 0, "forwards": 0}
        # Workers are stopped even if the caller forgets close().
        self._finalizer = weakref.finalize(self, launcher.close) if launcher else None

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, settings: EncoderSettings | None = None, **changes
    ) -> Encoder:
        """Load a checkpoint: a local directory or a Hugging Face model id (from the local
        cache, else downloaded; qwen_embed.hub). `settings` (default: EncoderSettings()) with
        any field replaced by a keyword, e.g. `from_pretrained(d, dtype="float32")`; what
        follows from them, the checkpoint and the machine is `encoder.route`, logged here."""
        settings = (settings or EncoderSettings()).replace(**changes)
        model_dir, config, route = plan(model_dir, settings)
        log.info("qwen_embed route for %s: %s", model_dir, route.describe())
        spec = RankSpec(str(model_dir), settings, route)
        if settings.tp_size == 1:
            return cls(build_model(spec, TPGroup()), config, settings, route, None)
        launcher = TPLauncher(spec)
        try:
            tp = launcher.join_groups()
            model = build_model(launcher.args, tp)
            launcher.wait_for("ready")
        except BaseException:
            launcher.close()
            raise
        return cls(model, config, settings, route, launcher)

    @property
    def embedding_size(self) -> int:
        """The width of the vectors `embed` returns without `dimensions`."""
        return self.config.embedding_size

    @property
    def max_input_tokens(self) -> int:
        return self.config.max_position_embeddings

    def embed(
        self,
        token_id_lists: Sequence[Sequence[int]],
        *,
        normalize: bool = True,
        dimensions: int | None = None,
        adapter: Adapters = None,
    ) -> np.ndarray:
        """Embed each token id list; returns float32 [n, dimensions or embedding_size] in input
        order. `adapter`: one of `adapters`, added to the base weights (lora.py), or one per
        list (None: the base); a forward takes texts of several adapters."""
        self._check_dimensions(dimensions)
        sequences = self.check_sequences(token_id_lists)
        pooled = torch.from_numpy(self.pool_checked(sequences, adapter))
        return finish(pooled, normalize=normalize, dimensions=dimensions).contiguous().numpy()

    def _check_dimensions(self, dimensions, limit: int | None = None) -> None:
        """`dimensions` within `limit` (default: the pooled vectors' width)."""
        self._require("embed")
        limit = limit or self.embedding_size
        if dimensions is not None and (
            isinstance(dimensions, bool)
            or not isinstance(dimensions, (int, np.integer))
            or not 1 <= dimensions <= limit
        ):
            raise ValueError(f"dimensions must be an integer in 1..{limit}, got {dimensions!r}")

    @property
    def adapters(self) -> tuple[str, ...]:
        """The adapters a call may name (settings.lora_modules)."""
        return self.route.lora_names

    def adapter_index(self, adapter: str | None) -> int:
        """`adapter` as the layers' index, segments.BASE for None (ValueError naming the
        ones served)."""
        if adapter is None:
            return BASE
        if adapter not in self.route.lora_names:
            served = list(self.route.lora_names) or "none: set lora_modules"
            raise ValueError(f"adapter {adapter!r} is not served here (adapters: {served})")
        return self.route.lora_names.index(adapter)

    def adapter_indices(self, adapter: Adapters, n: int) -> np.ndarray | None:
        """Each of `n` sequences' adapter index (`adapter`: one name for all, or one per
        sequence); None where none names one."""
        if adapter is None:
            return None
        if isinstance(adapter, str):
            return np.full(n, self.adapter_index(adapter), dtype=np.int64)
        names = list(adapter)
        if len(names) != n:
            raise ValueError(f"adapter: {len(names)} names for {n} texts (one, or one per text)")
        index = {name: self.adapter_index(name) for name in dict.fromkeys(names)}  # once each
        indices = np.array([index[name] for name in names], dtype=np.int64)
        return None if (indices == BASE).all() else indices

    def _planned(self, lengths: list[int], adapter: Adapters) -> list:
        """`_batches` of sequences of `lengths`, `adapter` as the caller was given it."""
        return list(self._batches(lengths, self.adapter_indices(adapter, len(lengths))))

    def _batches(self, lengths: list[int], adapters: np.ndarray | None):
        """(indices, their adapters or None) of each forward planned by the token budget
        (`adapters`: each sequence's index, `adapter_indices`), each adapter's sequences one
        run of rows (lora.py)."""
        for indices in plan_batches(lengths, self.max_batch_tokens):
            if adapters is None:
                yield indices, None
            else:
                indices = sorted(indices, key=lambda i: adapters[i])
                yield indices, adapters[indices]

    def pool_checked(self, sequences: list[np.ndarray], adapter: Adapters = None) -> np.ndarray:
        """Pooled (and projected: heads.py) vectors float32 [n, embedding_size], not truncated,
        not normalised (`finish` does that per request), of sequences that already passed
        `check_sequence`: callers that validate per request (the Triton encoder) do not pay
        for it twice."""
        self._require_pooled()
        return self.launch_checked(sequences, adapter).result()

    def launch_checked(self, sequences: list[np.ndarray], adapter: Adapters = None) -> HostRows:
        """The loaded task's rows for sequences that passed `check_sequence`
        (`pool_checked`'s vectors, `score_checked`'s scores, `classify_checked`'s logits),
        their forwards queued and the last one not waited for: `result()` waits. A server
        plans its next batch while a GPU runs this one (the Triton encoder's execute)."""
        n = len(sequences)
        if self.task == "rerank":
            if self.config.listwise:
                raise ValueError("a listwise reranker scores a query's blocks: use rank_blocks")
            out, head = np.empty(n, dtype=np.float32), self.model.head
        elif self.task == "classify":
            out = np.empty((n, self.config.num_labels), dtype=np.float32)
            head = self.model.head
        else:
            self._require_pooled()
            out = np.empty((n, self.embedding_size), dtype=np.float32)
            head = self._embedding_head
        return self._launch(sequences, out, head, adapter)

    def _embedding_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled if self.model.head is None else self.model.head(pooled)

    def embed_chunks(
        self,
        texts: Sequence[ChunkedText],
        *,
        normalize: bool = True,
        dimensions: int | None = None,
        adapter: Adapters = None,
    ) -> list[np.ndarray]:
        """Late chunking (chunking.py): for each text, float32 [chunks, dimensions or
        embedding_size], every chunk pooled in the context of its whole text. `adapter` as
        `embed`'s."""
        self._check_dimensions(dimensions)
        checked = [
            check_chunks(i, self.check_sequence(i, t.ids), t.spans, t.tail)
            for i, t in enumerate(texts)
        ]
        return [
            finish(torch.from_numpy(p), normalize=normalize, dimensions=dimensions).numpy()
            for p in self.pool_chunks_checked(checked, adapter)
        ]

    def pool_chunks_checked(
        self, texts: Sequence[ChunkedText], adapter: Adapters = None
    ) -> list[np.ndarray]:
        """`embed_chunks` before truncation and normalisation, for texts that passed
        `check_chunks`: forwards planned by the token budget (chunking.ChunkedText.cost), a
        text split into pieces of its chunks where it alone would gather too many keys."""
        self._require_pooled()
        return self._pool_chunks(texts, self._embedding_head, self.embedding_size, adapter)

    def _pool_chunks(
        self, texts: Sequence[ChunkedText], head, width: int, adapter: Adapters = None
    ) -> list[np.ndarray]:
        planner = self.model.planner
        readout = planner.readout
        pieces = [
            (i, piece, chunks)
            for i, text in enumerate(texts)
            for piece, chunks in text.pieces(readout, self.max_batch_tokens)
        ]
        adapters = self.adapter_indices(adapter, len(texts))
        if adapters is not None:  # each piece its text's
            adapters = adapters[[i for i, _, _ in pieces]]
        out = [np.empty((len(t.spans), width), np.float32) for t in texts]
        costs = [piece.cost(readout) for _, piece, _ in pieces]
        batches = list(self._batches(costs, adapters))
        with self._lock:
            for group, group_adapters in batches:
                chosen = [pieces[g][1] for g in group]
                forward = ChunkForward(chosen, readout, planner.prune, self.device, group_adapters)
                send = None
                if self._launcher is not None:
                    packed = pack_texts(chosen)
                    send = partial(self._launcher.send_chunks, packed, group_adapters)
                pool = partial(forward.pool, head=head, pooler=self.model.pooler)
                pooled = self._forward_context(forward.context, pool, send)
                for g, vectors in zip(group, pooled, strict=True):
                    i, _, chunks = pieces[g]
                    out[i][chunks] = vectors
        return out

    def embed_tokens(
        self,
        texts: Sequence[Sequence[int] | MediaText],
        *,
        normalize: bool = True,
        dimensions: int | None = None,
        skiplist: bool = False,
        adapter: Adapters = None,
    ) -> list[np.ndarray]:
        """One vector per token (late interaction, custom pooling): for each token id list
        (or text with images and video, media.py), its final hidden states float32 [tokens,
        dimensions or token_size], after the final norm and before pooling and the
        checkpoint's projections of pooled vectors (a multi-vector retriever's projection of
        every token applied); truncated and normalised per token. With `skiplist`, a
        MultiVectorEncoder's skiplist tokens' vectors left out (`without_skiplist`; its
        documents' reading). `adapter` as `embed`'s."""
        self._check_dimensions(dimensions, self.config.token_size)
        if any(isinstance(t, MediaText) for t in texts):
            as_media = [t if isinstance(t, MediaText) else MediaText(np.asarray(t)) for t in texts]
            checked = self.check_media(as_media)
        else:
            checked = self.check_sequences(texts)
        states = self.token_states_checked(checked, adapter)
        if skiplist:
            states = self.without_skiplist(states, checked)
        return [
            finish(torch.from_numpy(s), normalize=normalize, dimensions=dimensions).numpy()
            for s in states
        ]

    def without_skiplist(self, states: list[np.ndarray], texts: list) -> list[np.ndarray]:
        """Each text's token states (`token_states_checked`'s) but those of a
        MultiVectorEncoder's skiplist tokens, what it scores where its skiplist applies."""
        skiplist = self.config.sentence.skiplist
        ids = [getattr(t, "ids", t) for t in texts]
        return [s[~np.isin(i, skiplist)] for s, i in zip(states, ids, strict=True)]

    def token_states_checked(
        self, texts: list[np.ndarray | MediaText], adapter: Adapters = None
    ) -> list[np.ndarray]:
        """`embed_tokens` before truncation and normalisation, for sequences that passed
        `check_sequence` (or texts that passed `check_media`): forwards planned by the token
        budget that compute every row (no shared prefix, no pruned last layer)."""
        self._require("embed")
        media_texts = any(isinstance(t, MediaText) for t in texts)
        if media_texts:  # one batch may hold both: a plain text is one without visuals
            texts = [t if isinstance(t, MediaText) else MediaText(t, (), ()) for t in texts]
        ids = [t.ids for t in texts] if media_texts else texts
        out: list[np.ndarray] = [None] * len(texts)
        batches = self._planned([len(s) for s in ids], adapter)
        with self._lock:
            for indices, adapters in batches:
                flat = flatten([ids[i] for i in indices])
                media = None
                if media_texts:
                    chosen = [texts[i] for i in indices]
                    media = MediaForward.of_texts(chosen, self.config.media, self.device, adapters)
                ctx = self.model.planner.plan(*flat, every_row=True, media=media, adapters=adapters)
                send = None
                if self._launcher is not None:
                    send = partial(self._launcher.send_every_row, *flat, media, adapters)
                rows = self._forward_context(ctx, self._token_states, send)
                bounds = flat[1].tolist()
                states = rows.numpy()
                for i, a, b in zip(indices, bounds[:-1], bounds[1:], strict=True):
                    out[i] = states[a:b]
        return out

    def _token_states(self, hidden: torch.Tensor) -> HostResult:
        """Every token's final hidden state in fp32, through the checkpoint's projection of
        every token where it has one (heads.build_token_head)."""
        head = self.model.token_head
        return HostResult(head(hidden) if head is not None else hidden.float())

    def embed_media(
        self,
        texts: Sequence[MediaText],
        *,
        normalize: bool = True,
        dimensions: int | None = None,
        adapter: Adapters = None,
    ) -> np.ndarray:
        """Embed texts with images and video (a multimodal checkpoint: media.py says how a
        text holds them); float32 [n, dimensions or embedding_size] in input order.
        `adapter` as `embed`'s."""
        self._check_dimensions(dimensions)
        pooled = torch.from_numpy(self.pool_media_checked(self.check_media(texts), adapter))
        return finish(pooled, normalize=normalize, dimensions=dimensions).contiguous().numpy()

    def check_media(self, texts: Sequence[MediaText]) -> list[MediaText]:
        """Each text's ids (`check_sequences`), then its visuals (`check_visuals`)."""
        self._media_config()  # a text-only model refuses before any text is looked at
        seqs = self.check_sequences([t.ids for t in texts])
        return self.check_visuals(
            [MediaText(s, t.visuals) for s, t in zip(seqs, texts, strict=True)]
        )

    def check_visuals(self, texts: Sequence[MediaText]) -> list[MediaText]:
        """Texts whose ids passed `check_sequence`, with their visuals checked against their
        placeholders (`MediaText.checked`; ValueError naming the text)."""
        media = self._media_config()
        checked = []
        for i, text in enumerate(texts):
            try:
                checked.append(text.checked(media))
            except ValueError as e:
                raise ValueError(f"texts[{i}]: {e}") from None
        return checked

    def _media_config(self):
        if self.config.media is None:
            raise ValueError(
                "this checkpoint has no vision tower: images and video need a multimodal "
                "checkpoint (Qwen3-VL)"
            )
        return self.config.media

    def pool_media_checked(self, texts: list[MediaText], adapter: Adapters = None) -> np.ndarray:
        """`embed_media` before truncation and normalisation, for texts that passed
        `check_media` (or `check_visuals`)."""
        self._require_pooled()
        out = np.empty((len(texts), self.embedding_size), dtype=np.float32)
        return self._run_media(texts, out, self._embedding_head, adapter)

    def score_media(self, texts: Sequence[MediaText], adapter: Adapters = None) -> np.ndarray:
        """Relevance of templated (query, document) pairs with their images (a multimodal
        reranker, Qwen3-VL-Reranker): float32 [n] in [0, 1]. `adapter` as `score`'s."""
        return self.score_media_checked(self.check_media(texts), adapter)

    def score_media_checked(self, texts: list[MediaText], adapter: Adapters = None) -> np.ndarray:
        """`score_media` for pairs that passed `check_media` (or `check_visuals`)."""
        self._require("rerank")
        out = np.empty(len(texts), dtype=np.float32)
        return self._run_media(texts, out, self.model.head, adapter)

    def _run_media(
        self, texts: list[MediaText], out: np.ndarray, head, adapter: Adapters
    ) -> np.ndarray:
        """Forwards planned by the token budget, each running the vision tower once over all
        of its visuals; `head(pooled)` -> rows of `out`."""
        batches = self._planned([len(t.ids) for t in texts], adapter)
        with self._lock:
            for indices, adapters in batches:
                chosen = [texts[i] for i in indices]
                media = MediaForward.of_texts(chosen, self.config.media, self.device, adapters)
                flat = flatten([t.ids for t in chosen])
                ctx = self.model.planner.plan(*flat, media=media, adapters=adapters)
                send = None
                if self._launcher is not None:
                    send = partial(self._launcher.send_media, *flat, media, adapters=adapters)
                spans = None
                if self.config.visual_span_mean and self.route.pooling == "mean":
                    spans = visual_spans([t.ids for t in chosen], self.config.media)
                pooled = partial(self._pooled, ctx, head=head, spans=spans)
                out[indices] = self._forward_context(ctx, pooled, send).numpy()
        return out

    def score(
        self, token_id_lists: Sequence[Sequence[int]], adapter: Adapters = None
    ) -> np.ndarray:
        """Relevance of each templated (query, document) token id list: float32 [n] in [0, 1].
        Only for task "rerank"; building the template is the caller's (or the Triton
        tokenizer's) job, see qwen_embed_deploy.serving.rerank."""
        self._require("rerank")
        return self.score_checked(self.check_sequences(token_id_lists), adapter)

    def score_checked(self, sequences: list[np.ndarray], adapter: Adapters = None) -> np.ndarray:
        """`score` for sequences that already passed `check_sequence`."""
        self._require("rerank")
        return self.launch_checked(sequences, adapter).result()

    def rank_blocks(self, blocks: Sequence[Sequence[int]], adapter: Adapters = None) -> np.ndarray:
        """A listwise reranker's (jina-reranker-v3) scores of one query's documents: `blocks`
        are its templated sequences, each the query and a block of documents with their
        markers (qwen_embed_deploy.serving.listwise builds them); float32 [documents] in
        order, cosines in [-1, 1] (heads.listwise_scores)."""
        checked = self.check_blocks(self.check_sequences(blocks))
        return self.rank_blocks_checked(checked, adapter)

    def check_blocks(self, blocks: list[np.ndarray]) -> list[ChunkedText]:
        """Sequences that passed `check_sequence` as a listwise reranker's blocks: each with
        its markers as late chunks, the documents' then the query's (ValueError otherwise)."""
        self._require("rerank")
        if not self.config.listwise:
            raise ValueError("rank_blocks needs a listwise reranker (JinaForRanking)")
        return [ChunkedText(ids, self.model.head.spans(ids)) for ids in blocks]

    def rank_blocks_checked(
        self, blocks: list[ChunkedText], adapter: Adapters = None
    ) -> np.ndarray:
        """`rank_blocks` for one query's blocks from `check_blocks`: one call (its blocks'
        scores are merged); a block's documents are its chunks but the last."""
        head = self.model.head
        return listwise_scores(self._pool_chunks(blocks, head, head.width, adapter))

    def classify(
        self, token_id_lists: Sequence[Sequence[int]], adapter: Adapters = None
    ) -> np.ndarray:
        """A sequence classifier's logits float32 [n, labels] (task "classify"; the names are
        `config.labels`)."""
        return self.classify_checked(self.check_sequences(token_id_lists), adapter)

    def classify_checked(self, sequences: list[np.ndarray], adapter: Adapters = None) -> np.ndarray:
        """`classify` for sequences that already passed `check_sequence`."""
        self._require("classify")
        return self.launch_checked(sequences, adapter).result()

    def _require(self, task: str) -> None:
        if self.task != task:
            raise ValueError(
                f"this encoder was loaded with task={self.task!r}; {task!r} needs task={task!r}"
            )

    def _require_pooled(self) -> None:
        self._require("embed")
        if self.config.multi_vector:
            raise ValueError(MULTI_VECTOR_ONLY)

    def _launch(
        self, sequences: list[np.ndarray], out: np.ndarray, head, adapter: Adapters
    ) -> HostRows:
        """Forward batches planned by token budget, queued; `head(pooled [n, hidden])` -> rows
        of `out` (HostRows)."""
        batches = self._planned([len(s) for s in sequences], adapter)
        rows = HostRows(out)
        with self._lock:
            for indices, adapters in batches:
                batch = [sequences[i] for i in indices]
                rows.add(indices, self._forward(batch, head, adapters))
        return rows

    def check_sequences(self, token_id_lists: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """`check_sequence` of each list, the id range checked over all of them at once (a
        list's own checks, naming it, run only where something is wrong)."""
        arrays = []
        for seq in token_id_lists:
            try:
                arr = np.asarray(seq)
            except (OverflowError, ValueError):
                break
            if (
                arr.ndim != 1
                or arr.dtype.kind not in "iu"
                or not 0 < arr.size <= self.max_input_tokens
            ):
                break
            arrays.append(arr)
        else:
            flat = np.concatenate(arrays) if arrays else None
            if flat is None or (flat.min() >= 0 and flat.max() < self.config.vocab_size):
                return arrays
        return [self.check_sequence(i, s) for i, s in enumerate(token_id_lists)]

    def check_sequence(self, index: int, seq: Sequence[int]) -> np.ndarray:
        """Validate one token id list (ValueError naming it and the limit); returns it as array."""
        try:
            arr = np.asarray(seq)
        except (OverflowError, ValueError):  # ragged nesting, ints beyond int64
            arr = np.asarray([None])
        if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"token_ids[{index}] must be a flat list of integers")
        if arr.size == 0:
            raise ValueError(f"token_ids[{index}] is empty")
        if arr.size > self.max_input_tokens:
            raise ValueError(
                f"token_ids[{index}] has {arr.size} tokens, more than the model's "
                f"limit of {self.max_input_tokens}"
            )
        if arr.min() < 0 or arr.max() >= self.config.vocab_size:
            raise ValueError(
                f"token_ids[{index}] holds ids outside 0..{self.config.vocab_size - 1}"
            )
        return arr

    def _forward(self, sequences: list[np.ndarray], head, adapters: np.ndarray | None):
        """`adapters`: each sequence's index (segments.BASE: none), or None: none."""
        flat = flatten(sequences)  # the one flat host copy every rank plans from
        # Planned before the workers hear of it: a batch rank 0 cannot plan never reaches them.
        ctx = self.model.planner.plan(*flat, adapters=adapters)
        send = None
        if self._launcher is not None:
            send = partial(self._launcher.send_batch, *flat, adapters=adapters)
        return self._forward_context(ctx, partial(self._pooled, ctx, head=head), send)

    def _forward_context(self, ctx: ForwardContext, finish, send):
        """`finish(final hidden states)` of one planned forward; with tensor parallelism,
        `send()` first tells the workers what to plan and compute."""
        if send is None:
            return self._compute(ctx, finish)
        if self._broken is not None:
            raise EncoderBroken(self._broken)
        try:
            send()
            return self._compute(ctx, finish)
        except Exception as e:
            failure = self._launcher.failure()
            self._broken = (
                f"tensor-parallel forward failed ({failure + '; ' if failure else ''}"
                f"{type(e).__name__}: {e}); the encoder must be loaded again"
            )
            self._launcher.close(graceful=False)
            raise EncoderBroken(self._broken) from e

    def _pooled(self, ctx: ForwardContext, hidden: torch.Tensor, *, head, spans=None) -> HostResult:
        """pruned: the model returned the pooled rows; pooling works in fp32 either way. A plan
        (shared prefixes) implies last pooling, so pruning: `pool` sees plain batches. `spans`:
        each text's rows to mean (media.visual_spans) in place of the route's pooling."""
        if spans is not None:
            pooled = pool_spans(hidden, spans)
        elif ctx.last is not None:
            pooled = hidden.float()
        else:
            pooled = pool(hidden, ctx.batch, self.route.pooling, self.model.pooler)
        return HostResult(head(pooled))  # the one device-to-host copy of this batch

    def _compute(self, ctx: ForwardContext, finish):
        with torch.inference_mode():
            hidden = self.model(ctx)
            if hidden.device.type == "cuda" and self._launcher is not None:
                done = torch.cuda.Event()
                done.record()
                wait_for_device(done.query, lambda: self._launcher.failure(wait_s=0))
            result = finish(hidden)
        self.model.planner.commit(ctx)
        self._count(ctx)
        return result

    def _count(self, ctx: ForwardContext) -> None:
        self.stats["received_tokens"] += ctx.received_tokens
        self.stats["computed_tokens"] += ctx.computed_tokens
        self.stats["forwards"] += 1

    @property
    def prefix_cache(self):
        """Hits, lookups and bytes in use of the prefix cache (segments.PrefixCache)."""
        return self.model.planner.cache

    def close(self) -> None:
        """Stop tensor-parallel workers; safe to call more than once."""
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> Encoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
