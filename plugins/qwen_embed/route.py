"""How an encoder runs, resolved once from its settings, its checkpoint and the machine.

`choose_route` is a pure function of those, so every outcome is testable on any machine. The
route is plain data; `describe()` is for people (the load log, `qwen-embed info`) and `labels()`
for the encoder's route metric. Nothing decides behaviour from their text.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from . import avx2_gemm, fp8, kernels, native, onednn
from .adapters import resolve_adapter
from .attention import choose_backend
from .config import ModelConfig
from .cpu import CpuFeatures, fp32_gemm
from .heads import resolve_task
from .settings import EncoderSettings, parse_lora_modules


class Linear(enum.Enum):
    """What the linear layers compute in (this fixes the vectors; `Gemm` says on what)."""

    FLOAT = "float"  # in the activation dtype
    # bf16 activations on a CPU without bf16 instructions, fp16 ones on any CPU: the weights
    # are held in fp32 and multiplied by one fp32 GEMM, because torch emulates those GEMMs
    # (far slower) and oneDNN packs fp16 weights only where the CPU converts fp16 itself.
    FP32_GEMM = "fp32 GEMM"
    # q|k, gate|up and down: per-channel int8 weights, per-token int8 activations on
    # int8.Int8Weight; the layers int8.FLOAT_LAYERS names stay in floats, on the route's Gemm
    INT8 = "int8"
    # the layers int8 quantises: per-channel e4m3 weights, per-token e4m3 activations, bf16
    # out, on fp8.Fp8Weight (torch._scaled_mm); the rest in bf16
    FP8 = "fp8"


class Gemm(enum.Enum):
    """The one kernel the float linear layers multiply on (engine.FLOAT_GEMMS holds each)."""

    TORCH = "F.linear"  # on the weights as held: cuBLAS on a GPU; CPUs without oneDNN
    ONEDNN = "oneDNN GEMM on packed weights"  # onednn.PackedWeight, packed once at load
    # bf16 on the native operator (onednn.NativeBf16Weight): a row's result the same at any
    # row count, which oneDNN's bf16 GEMM is not on AMX CPUs (settings.batch_invariant)
    NATIVE_BF16 = "batch-invariant native GEMM"
    # fp32 on CPUs with AVX2 and no AVX-512 (avx2_gemm.Avx2F32Weight), packed once at load
    NATIVE_F32 = "native AVX2 fp32 GEMM on packed weights"


@dataclass(frozen=True)
class Route:
    device: str  # rank 0's device; rank r of a GPU group uses cuda:(index + r)
    dtype: str  # activations, embeddings, norms
    linear: Linear
    gemm: Gemm
    attn_backend: str
    task: str  # "embed" | "rerank" | "classify"
    pooling: str
    adapter: str | None  # the task adapter merged into the weights (adapters.py)
    lora_names: tuple[str, ...]  # the adapters a request may name, kept unmerged (lora.py)
    prefix_reuse: bool  # shared prefixes computed once (segments.py)
    prune: bool  # the last layer computes only the pooled rows (last-token pooling)
    elementwise: str  # the row-op table (kernels.TABLES): "native", "triton" or "torch"
    native_isa: str | None  # the native CPU kernels' instruction set (native/), None if unused
    cuda_graph_tokens: int  # forwards up to this many tokens replay CUDA graphs; 0: none
    reason: str  # why this dtype and linear route
    attention_reason: str

    def describe(self) -> str:
        linear = {
            Linear.FLOAT: self.dtype,
            Linear.FP32_GEMM: f"{self.dtype} as fp32 GEMM",
            Linear.INT8: "int8 (per-channel weights, per-token activations, Hadamard-rotated "
            "rows; the attention's values and output projection in floats)",
            Linear.FP8: "fp8 e4m3 (per-channel weights, per-token activations, bf16 out; the "
            "attention's values and output projection in bf16)",
        }[self.linear]
        linear += f", {self.gemm.value}"
        return (
            f"{self.device}, dtype {self.dtype}, linear layers {linear}: {self.reason}; "
            f"attention {self.attn_backend} ({self.attention_reason}); prefix reuse "
            f"{'on' if self.prefix_reuse else 'off'}, last-layer pruning "
            f"{'on' if self.prune else 'off'}; elementwise ops "
            + " ".join(filter(None, (self.elementwise, self.native_isa)))
            + (
                f"; CUDA graphs up to {self.cuda_graph_tokens} tokens"
                if self.cuda_graph_tokens
                else ""
            )
            + (f"; task adapter {self.adapter!r} merged" if self.adapter else "")
            + (f"; adapters per request: {', '.join(self.lora_names)}" if self.lora_names else "")
        )

    def labels(self) -> dict[str, str]:
        return {k: str(v.value if isinstance(v, enum.Enum) else v) for k, v in asdict(self).items()}

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "linear": self.linear.value,
            "gemm": self.gemm.value,
            "lora_names": list(self.lora_names),  # as JSON reads it back (published facts)
        }

    @classmethod
    def from_dict(cls, data: dict) -> Route:
        return cls(
            **{
                **data,
                "linear": Linear(data["linear"]),
                "gemm": Gemm(data["gemm"]),
                "lora_names": tuple(data["lora_names"]),
            }
        )


def _cuda_has_bf16(device: str) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 8


def choose_route(
    settings: EncoderSettings,
    config: ModelConfig,
    device: str,
    features: CpuFeatures,
    onednn: bool = True,
    choose_attention: Callable[..., tuple[str, str]] = choose_backend,
    native_isa: Callable[[], str | None] = native.isa,
    gpu_bf16: Callable[[str], bool] = _cuda_has_bf16,
    gpu_fp8: Callable[[str], bool] = fp8.gpu_runs,
    brgemm_runs: Callable[[], bool] = onednn.brgemm_runs,
    avx2_f32_runs: Callable[[], bool] = avx2_gemm.runs,
    has_triton: Callable[[], bool] = kernels.has_triton,
) -> Route:
    """dtype "auto" is the checkpoint's 16-bit dtype on GPU, and for an fp32 checkpoint bf16
    (fp16 on GPUs without bf16, `gpu_bf16(device)`, which also run a bf16 checkpoint in
    fp16): fp32 GEMMs and attention would be many times slower; on CPU bf16 where bf16 GEMMs
    outrun fp32's (`CpuFeatures.bf16_outruns_fp32`: AMX, AVX512_BF16 but on Intel cores
    without AMX), else fp32. quantization "int8" (CPU only)
    swaps the linear layers' GEMM (int8.quantizes says which); "fp8" runs the same layers in
    fp8 and the rest in bf16 (GPUs with fp8 tensor cores, `gpu_fp8(device)`; on CPU to check
    it). The float layers' one `Gemm`:
    batch_invariant "on" multiplies bf16 ones on the native operator (`brgemm_runs()`), and
    "auto" does wherever it runs (bf16 GEMMs on CPU need bf16 instructions); fp32 ones on CPUs
    with AVX2 and no AVX-512 take the native AVX2 operator (`avx2_f32_runs()`; prepack_weights
    "auto"); else CPU routes take oneDNN's GEMM on weights packed at load where torch has
    oneDNN (prepack_weights), and F.linear elsewhere. Prefix reuse needs causal attention and
    last-token pooling; pruning, last-token pooling. Norms, rotary and silu run in the row-op
    table kernels.choose picks: native kernels on CPU where they are built (native/), Triton's
    on CUDA."""
    s = settings
    cpu = device == "cpu"
    if s.quantization == "int8" and not cpu:
        raise ValueError("quantization 'int8' runs on CPU only; use dtype bfloat16 on GPUs")
    task = resolve_task(s.task, config)
    per_request = tuple(name for name, _ in parse_lora_modules(s.lora_modules))
    pooling = resolve_pooling(s.pooling, task, config)
    # a multi-vector retriever's forwards compute every token: nothing shared, nothing pruned
    last_pooled = pooling == "last" and not config.multi_vector
    reuse_valid = config.is_causal and last_pooled
    if s.prefix_reuse == "on" and not reuse_valid:
        raise ValueError(
            "prefix_reuse needs causal attention and last-token pooling "
            f"(is_causal={config.is_causal}, pooling={pooling!r}, "
            f"multi_vector={config.multi_vector})"
        )
    hybrid = config.linear_attention is not None
    if hybrid and s.quantization == "fp8":
        raise ValueError(
            "a checkpoint with linear-attention layers (Qwen3.5) runs in floats or int8: "
            "quantization must be 'none' or 'int8'"
        )
    if s.quantization == "fp8":
        dtype, reason = _fp8_dtype(s.dtype, device, gpu_fp8)
    else:
        half = None if cpu or s.dtype != "auto" else gpu_bf16(device)
        dtype, reason = _dtype(s.dtype, cpu, device, config.checkpoint_dtype, features, half)
    # 16-bit float weights held in fp32 (layers.linear_weight_dtype), the int8 route's too
    fp32_held = cpu and fp32_gemm(dtype, features.native_bf16)
    if s.quantization == "int8":
        linear, reason = Linear.INT8, reason + "; int8 linear layers set by the deployment"
        if cpu and not features.vnni:  # int8.Int8Weight
            reason += (
                " (no VNNI on this CPU: its int8 products run on the native AVX2 operator)"
                if features.avx2 and native_isa() is not None
                else " (no VNNI on this CPU: its int8 products run as float64 GEMMs)"
            )
    elif s.quantization == "fp8":
        linear = Linear.FP8
    elif fp32_held:
        linear = Linear.FP32_GEMM
    else:
        linear = Linear.FLOAT
    if s.prepack_weights == "on" and not (cpu and onednn):
        raise ValueError("prepack_weights needs a CPU device and a torch with oneDNN")
    prepack = s.prepack_weights == "on" or (s.prepack_weights == "auto" and cpu and onednn)
    # fp32 GEMMs (and oneDNN's bf16 ones on CPUs without AMX) are row-invariant already; the
    # native operator runs wherever the native build has AVX-512, so "on" is the same route
    # everywhere, and "auto" takes it where it runs: row-invariant on AMX, faster than oneDNN's
    # bf16 GEMM there, and on AVX512_BF16 CPUs on few rows (the same on many: docs/tuning.md)
    if s.batch_invariant == "on" and not cpu:
        raise ValueError("batch_invariant 'on' runs on CPU only")
    bf16_gemm = dtype == "bfloat16" and not fp32_held
    if s.batch_invariant == "on":
        native_gemm = bf16_gemm
        if bf16_gemm and not brgemm_runs():
            raise ValueError(
                "batch_invariant 'on' with bf16 needs the native bf16 operator (make setup "
                "builds it; AVX-512 and torch's oneDNN)"
            )
    else:
        native_gemm = bf16_gemm and s.batch_invariant == "auto" and cpu and brgemm_runs()
    # there oneDNN's fp32 GEMM loses to MKL's on many rows and MKL's to oneDNN's on few
    avx2_f32 = (
        s.prepack_weights == "auto"
        and cpu
        and (dtype == "float32" or fp32_held)
        and features.avx2
        and not features.avx512
        and avx2_f32_runs()
    )
    if native_gemm:
        gemm = Gemm.NATIVE_BF16
    elif avx2_f32:
        gemm = Gemm.NATIVE_F32
    else:
        gemm = Gemm.ONEDNN if prepack else Gemm.TORCH
    backend, why = s.attn_backend, "set by the deployment"
    if backend == "auto":
        backend, why = choose_attention(device, config.head_dim, dtype=dtype)
    isa = native_isa() if cpu and dtype in native.DTYPE_NAMES else None
    return Route(
        device=device,
        dtype=dtype,
        linear=linear,
        gemm=gemm,
        attn_backend=backend,
        task=task,
        pooling=pooling,
        adapter=resolve_adapter(s.adapter, config.adapters, per_request),
        lora_names=per_request,
        prefix_reuse=reuse_valid and s.prefix_reuse != "off",
        prune=last_pooled,
        elementwise=kernels.choose(device, isa, has_triton),
        native_isa=isa,
        cuda_graph_tokens=0 if cpu or s.tp_size > 1 or hybrid else s.cuda_graph_tokens,
        reason=reason,
        attention_reason=why,
    )


def _fp8_dtype(requested: str, device: str, gpu_fp8: Callable[[str], bool]) -> tuple[str, str]:
    """bf16 around the fp8 layers (their GEMM writes bf16), on a device that runs them."""
    if requested not in ("auto", "bfloat16"):
        raise ValueError(
            f"quantization 'fp8' computes in bfloat16: dtype must be auto or bfloat16, "
            f"not {requested!r}"
        )
    if device == "cpu":
        return "bfloat16", (
            "fp8 linear layers set by the deployment, on torch's fp8 GEMM: on CPU to check the "
            "route, slower than the float routes (int8 is the CPU's quantised route)"
        )
    if not gpu_fp8(device):
        raise ValueError(
            "quantization 'fp8' needs fp8 tensor cores (compute capability 8.9 or later: Ada, "
            f"Hopper, Blackwell) and torch's scaled fp8 GEMM on them: {device} does not run it; "
            "use dtype bfloat16"
        )
    return "bfloat16", "fp8 linear layers set by the deployment, bf16 around them"


def resolve_pooling(setting: str, task: str, config: ModelConfig) -> str:
    """`auto` is the checkpoint's pooling (sentence_modules.py), else the last token, which a
    reranker or a classifier always reads."""
    if task in ("rerank", "classify"):
        if setting not in ("auto", "last"):
            raise ValueError(f"task {task!r} reads the last token: pooling must be 'last'")
        return "last"
    pooling = (config.sentence.pooling or "last") if setting == "auto" else setting
    if config.attention_pooling is not None and pooling != "attention":
        raise ValueError(
            f"pooling {pooling!r}: this checkpoint pools by attention (its `mha_pma` head); "
            "pooling must be 'auto' or 'attention'"
        )
    if config.attention_pooling is None and pooling == "attention":
        raise ValueError(
            "pooling 'attention' needs a checkpoint with an attention pooling head "
            "(config.json's `embedding_method: pma`: C2LLM, CodeFuse-CGE)"
        )
    return pooling


def _dtype(
    requested: str,
    cpu: bool,
    device: str,
    checkpoint_dtype: str | None,
    features: CpuFeatures,
    gpu_bf16: bool | None,
) -> tuple[str, str]:
    if requested != "auto":
        return requested, f"dtype {requested} set by the deployment"
    if not cpu:
        if checkpoint_dtype == "bfloat16" and not gpu_bf16:
            return "float16", (
                f"auto: a bfloat16 checkpoint runs in float16 on {device}, which has no bf16 "
                "(before compute capability 8.0)"
            )
        if checkpoint_dtype in ("float16", "bfloat16"):
            return checkpoint_dtype, f"the checkpoint's dtype on {device}"
        half = "bfloat16" if gpu_bf16 else "float16"
        return half, (
            f"auto: a {checkpoint_dtype or 'float32'} checkpoint runs in {half} on {device} "
            "(dtype float32 keeps fp32)"
        )
    if features.bf16_outruns_fp32:
        return "bfloat16", f"auto: {features.describe()} has native bf16 GEMM"
    if features.native_bf16:
        return "float32", (
            f"auto: {features.describe()} multiplies fp32 faster than bf16 (an Intel CPU's "
            "AVX512_BF16 without AMX; dtype bfloat16 halves the weights' memory)"
        )
    return (
        "float32",
        f"auto: {features.describe()} has no bf16 instructions (bf16 would be emulated)",
    )
