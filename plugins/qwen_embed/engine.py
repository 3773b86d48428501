"""The public engine: `Encoder.from_pretrained(...)`, then `encoder.embed(token_id_lists)` or,
for a reranker (`task="rerank"`), `encoder.score(token_id_lists)`."""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .attention import AttentionSpec, choose_backend, create_backend
from .batch import flatten, plan_batches
from .config import ModelConfig
from .cpu import HeapTrimmer, cpu_features, keep_freed_memory
from .fused import ELEMENTWISE
from .heads import build_score_head, resolve_task
from .hub import resolve_checkpoint
from .int8 import KERNELS as INT8_KERNELS
from .int8 import Int8Weight
from .layers import TPGroup, _Linear, linear_weight_dtype
from .loader import load_weights
from .models import model_class
from .onednn import PackedWeight
from .onednn import available as onednn_available
from .parallel import RankArgs, TPLauncher
from .pooling import POOLING_METHODS, finish, pool
from .route import Route, choose_route
from .segments import MIN_PREFIX_TOKENS, ForwardContext, Planner, PrefixCache

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
log = logging.getLogger(__name__)


def check_gpu_group(index: int, tp_size: int, device_count: int) -> None:
    """A TP group starting at cuda:index needs GPUs index .. index + tp_size - 1."""
    if index + tp_size > device_count:
        raise ValueError(
            f"tp_size={tp_size} from cuda:{index} needs GPUs {index}..{index + tp_size - 1}, "
            f"but this machine has {device_count}"
        )


def build_model(args: RankArgs, tp: TPGroup) -> nn.Module:
    """Build this rank's shard of the model on its device and load its weights."""
    config = ModelConfig.from_dir(args.model_dir)
    device = args.device_for(tp.rank)
    if device.type == "cpu":
        keep_freed_memory()
    else:  # every rank, 0 included: kernels without a device guard launch on the current one
        torch.cuda.set_device(device)
    dtype = DTYPES[args.dtype]
    kv_heads = max(1, config.num_kv_heads // tp.size)
    backend = create_backend(
        args.attn_backend,
        AttentionSpec(
            num_heads=config.num_heads // tp.size,
            num_kv_heads=kv_heads,
            head_dim=config.head_dim,
            causal=config.is_causal,
            device=device,
            dtype=dtype,
        ),
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config.family)(config, tp, backend)
    finally:
        torch.set_default_dtype(previous)
    if args.task == "rerank" and tp.rank == 0:  # only rank 0 reads the last hidden states
        model.score_head = build_score_head(config, args.model_dir).to(device)
    load_weights(model, args.model_dir)
    prune = args.pooling == "last"  # last-layer pruning (segments.Planner)
    if prune:
        model.prune_last_layer()
    linears = [m for m in model.modules() if isinstance(m, _Linear)]
    if args.quantization == "int8":
        for module in linears:
            module.repack(Int8Weight)
        INT8_KERNELS.ensure_compiled()
    elif (weight_dtype := linear_weight_dtype(dtype, device)) != dtype:
        for module in linears:
            module.to(weight_dtype)
    if args.prepack_weights:
        for module in linears:
            module.repack(PackedWeight)
    # Keys and values of one token in every layer of this shard: the prefix cache's unit.
    bytes_per_token = config.num_layers * 2 * kv_heads * config.head_dim * dtype.itemsize
    model.planner = Planner(prefix_reuse=args.prefix_reuse, prune=prune,
                            cache_bytes=int(args.prefix_cache_mb * 2**20),
                            bytes_per_token=bytes_per_token, num_layers=config.num_layers,
                            device=device)  # fmt: skip
    model.eval()
    if args.compile_elementwise:
        min_rows = model.compiled_min_rows
        # The compiled ops in the warm-up's tiny forwards too, else it would warm the eager ones.
        model.compiled_elementwise, model.compiled_min_rows = True, 0
        try:
            model.compiled_elementwise = ELEMENTWISE.ensure_compiled(lambda: _warm_up(model))
        finally:
            model.compiled_min_rows = min_rows
    if device.type == "cpu":  # after loading: its temporaries go back first
        keep = forward_bytes(config, args.max_batch_tokens, args.dtype, tp.size)
        model.register_forward_hook(HeapTrimmer(keep))
    return model


def forward_bytes(config: ModelConfig, max_batch_tokens: int, dtype: str, tp_size: int) -> int:
    """About what one full-budget forward allocates on a rank (activations; measured on the
    demo model: 0.93 GB bf16, 1.8 GB fp32 at 16,384 tokens): what HeapTrimmer keeps."""
    per_token = 3 * config.intermediate_size // tp_size + 20 * config.hidden_size
    return max_batch_tokens * per_token * DTYPES[dtype].itemsize


def _compiled_as_chosen(route: Route, model: nn.Module) -> Route:
    """The route as it runs: compiling may have failed (no C++ compiler) and left it eager."""
    if route.elementwise != "eager" and not model.compiled_elementwise:
        return dataclasses.replace(route, elementwise="eager (compiling failed; see the log)")
    return route


def _warm_up(model: nn.Module) -> None:
    """Tiny forwards with every shape class a real one meets (many rows and one row, in the
    pruned last layer too, and in the shared-prefix paths; dynamic shapes specialise size 1),
    so compiling happens at load, not in the first requests (seconds each). Prefixes go to a
    throwaway cache. Every TP rank runs the same forwards, so their all-reduces pair up."""
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
            ctx = planner.plan([np.array(s, dtype=np.int64) for s in sequences])
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
        device: torch.device,
        max_batch_tokens: int,
        pooling: str,
        launcher: TPLauncher | None,
        route: Route,
        task: str = "embed",
    ):
        self.model = model
        self.task = task
        self.route = route
        self.config = config
        self.device = device
        self.max_batch_tokens = max_batch_tokens
        self.pooling = pooling
        self._launcher = launcher
        self._lock = threading.Lock()
        # Tokens sent in vs tokens the forward computed (fewer when prefixes are shared).
        self.stats = {"received_tokens": 0, "computed_tokens": 0}
        # Workers are stopped even if the caller forgets close().
        self._finalizer = weakref.finalize(self, launcher.close) if launcher else None

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        tp_size: int = 1,
        attn_backend: str = "auto",
        dtype: str = "auto",
        quantization: str = "none",
        device: str | torch.device | None = None,
        max_batch_tokens: int = 16384,
        pooling: str = "last",
        task: str = "auto",
        prefix_reuse: bool | None = None,
        prefix_cache_mb: float = 256.0,
        compile_elementwise: bool | None = None,
        prepack_weights: bool | None = None,
        dist_addr: str = "127.0.0.1:0",
        dist_timeout_s: float = 300.0,
    ) -> Encoder:
        """Load a checkpoint: a local directory or a Hugging Face model id (from the local
        cache, else downloaded; qwen_embed.hub).

        `dtype` "auto" and `quantization` ("none" | "int8", CPU only) pick the arithmetic
        (route.choose_route; the choice is `encoder.route` and is logged). `dist_addr` is the TP
        rendezvous (host:port); port 0 picks a free port, so several encoders on one host never
        collide. `task`: "embed", "rerank" (`score`), or "auto" (rerank for
        *ForSequenceClassification checkpoints, else embed). `prefix_reuse` (None: on where
        valid, i.e. causal attention and last-token pooling) computes a prefix that sequences
        share once, within a batch and across batches (a cache of `prefix_cache_mb`, 0 keeps
        nothing between batches); see segments.py. `compile_elementwise` (None: bf16 on CPU)
        compiles the norms, rotary and gating with Inductor at load (fused.py; eager if
        compiling fails). `prepack_weights` (None: CPU float routes, where this torch has
        oneDNN) packs the linear weights for oneDNN at load (onednn.py).
        """
        if pooling not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {POOLING_METHODS}, got {pooling!r}")
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)
        if device.type == "cuda":
            check_gpu_group(device.index, tp_size, torch.cuda.device_count())
        model_dir = resolve_checkpoint(model_dir)
        config = ModelConfig.from_dir(model_dir)
        task = resolve_task(task, config)
        if task == "rerank" and pooling != "last":
            raise ValueError("a reranker scores the last token: pooling must be 'last'")
        reuse_valid = config.is_causal and pooling == "last"
        if prefix_reuse and not reuse_valid:
            raise ValueError("prefix_reuse needs causal attention and last-token pooling "
                             f"(is_causal={config.is_causal}, pooling={pooling!r})")  # fmt: skip
        if prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0, got {prefix_cache_mb}")
        route = choose_route(dtype, quantization, device.type, config.checkpoint_dtype,
                             cpu_features(), compile_elementwise, prepack_weights,
                             onednn_available())  # fmt: skip
        attention = f"{attn_backend}: set by the caller"
        if attn_backend == "auto":
            attn_backend, why = choose_backend(device.type, config.head_dim, dtype=route.dtype)
            attention = f"{attn_backend}: {why}"
        route = dataclasses.replace(route, attention=attention)
        log.info("qwen_embed route for %s: %s", model_dir, route)
        host, _, port = dist_addr.rpartition(":")
        args = RankArgs(
            model_dir=str(model_dir),
            tp_size=tp_size,
            attn_backend=attn_backend,
            dtype=route.dtype,
            quantization=quantization,
            device=str(device),
            host=host,
            port=int(port),
            timeout_s=dist_timeout_s,
            task=task,
            pooling=pooling,
            prefix_reuse=reuse_valid if prefix_reuse is None else bool(prefix_reuse),
            prefix_cache_mb=float(prefix_cache_mb),
            compile_elementwise=route.elementwise != "eager",
            prepack_weights=route.prepacked,
            max_batch_tokens=max_batch_tokens,
        )
        if tp_size == 1:
            model = build_model(args, TPGroup())
            route = _compiled_as_chosen(route, model)
            return cls(model, config, device, max_batch_tokens, pooling, None, route, task)
        launcher = TPLauncher(args)
        try:
            tp = launcher.join_groups()
            model = build_model(launcher.args, tp)
            launcher.wait_for("ready")
        except BaseException:
            launcher.close()
            raise
        route = _compiled_as_chosen(route, model)
        return cls(model, config, device, max_batch_tokens, pooling, launcher, route, task)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def max_input_tokens(self) -> int:
        return self.config.max_position_embeddings

    def embed(
        self,
        token_id_lists: Sequence[Sequence[int]],
        *,
        normalize: bool = True,
        dimensions: int | None = None,
    ) -> np.ndarray:
        """Embed each token id list; returns float32 [n, dimensions or hidden] in input order."""
        self._require("embed")
        if dimensions is not None and (
            isinstance(dimensions, bool)
            or not isinstance(dimensions, (int, np.integer))
            or not 1 <= dimensions <= self.hidden_size
        ):
            raise ValueError(
                f"dimensions must be an integer in 1..{self.hidden_size}, got {dimensions!r}"
            )
        sequences = [self.check_sequence(i, s) for i, s in enumerate(token_id_lists)]
        return self.embed_checked(sequences, normalize=normalize, dimensions=dimensions)

    def embed_checked(
        self, sequences: list[np.ndarray], *, normalize: bool = True, dimensions: int | None = None
    ) -> np.ndarray:
        """`embed` for sequences that already passed `check_sequence` (and valid dimensions):
        callers that validate per request (the Triton encoder) do not pay for it twice."""
        self._require("embed")
        out = np.empty((len(sequences), dimensions or self.hidden_size), dtype=np.float32)

        def vectors(pooled: torch.Tensor) -> torch.Tensor:
            return finish(pooled, normalize=normalize, dimensions=dimensions)

        return self._run(sequences, out, vectors)

    def score(self, token_id_lists: Sequence[Sequence[int]]) -> np.ndarray:
        """Relevance of each templated (query, document) token id list: float32 [n] in [0, 1].
        Only for task "rerank"; building the template is the caller's (or the Triton
        tokenizer's) job, see qwen_embed.serving.rerank."""
        self._require("rerank")
        return self.score_checked([self.check_sequence(i, s) for i, s in enumerate(token_id_lists)])

    def score_checked(self, sequences: list[np.ndarray]) -> np.ndarray:
        """`score` for sequences that already passed `check_sequence`."""
        self._require("rerank")
        out = np.empty(len(sequences), dtype=np.float32)
        return self._run(sequences, out, self.model.score_head)

    def _require(self, task: str) -> None:
        if self.task != task:
            raise ValueError(f"this encoder was loaded with task={self.task!r}; {task!r} needs "
                             f"task={task!r}")  # fmt: skip

    def _run(self, sequences: list[np.ndarray], out: np.ndarray, head) -> np.ndarray:
        """Forward batches planned by token budget; `head(pooled [n, hidden])` -> rows of
        `out`."""
        lengths = [len(s) for s in sequences]
        with self._lock:
            for indices in plan_batches(lengths, self.max_batch_tokens):
                out[indices] = self._forward([sequences[i] for i in indices], head)
        return out

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

    def _forward(self, sequences: list[np.ndarray], head) -> np.ndarray:
        if self._launcher is not None:
            self._launcher.send_batch(*flatten(sequences))
        planner = self.model.planner
        ctx = planner.plan(sequences)
        with torch.inference_mode():
            hidden = self.model(ctx)
            # pruned: the model returned the pooled rows; pooling works in fp32 either way. A
            # plan (shared prefixes) implies last pooling, so pruning: `pool` sees plain batches.
            pooled = (
                hidden.float() if ctx.last is not None else pool(hidden, ctx.batch, self.pooling)
            )
            rows = head(pooled)
        planner.commit(ctx)
        self._count(ctx)
        return rows.cpu().numpy()  # the one device-to-host copy of this batch

    def _count(self, ctx: ForwardContext) -> None:
        self.stats["received_tokens"] += ctx.received_tokens
        self.stats["computed_tokens"] += ctx.computed_tokens

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
