"""Which arithmetic the engine runs: activation dtype plus how the linear layers multiply.

Chosen once at load as a pure function of the request (dtype, quantization), the device and the
CPU's features, so every outcome is testable on any machine. The choice and its reason are
logged at load, shown by `qwen-embed info` and carried as labels of the encoder's metrics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .cpu import CpuFeatures

DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = ("none", "int8")


@dataclass(frozen=True)
class Route:
    dtype: str  # activations (and the float weights: embeddings, norms)
    linear: str  # how linear layers multiply
    reason: str
    attention: str = ""  # the attention backend and why (engine.Encoder fills it in)
    elementwise: str = "eager"  # norms, rotary, gating: "compiled (Inductor)" or "eager"
    prepacked: bool = False  # float linear weights packed for oneDNN at load (onednn.py)

    def labels(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}

    def __str__(self) -> str:
        text = f"dtype {self.dtype}, linear layers {self.linear}: {self.reason}"
        text += f"; attention {self.attention}" if self.attention else ""
        return text + f"; elementwise ops {self.elementwise}"


def choose_route(
    dtype: str,
    quantization: str,
    device_type: str,
    checkpoint_dtype: str | None,
    features: CpuFeatures,
    compile_elementwise: bool | None = None,
    prepack_weights: bool | None = None,
    onednn: bool = True,
) -> Route:
    """dtype "auto" is the checkpoint's dtype on GPU; on CPU bf16 where the CPU has bf16
    instructions (AVX512_BF16 or AMX: ~2.5-3.4x fp32 measured), else fp32 (emulated bf16 is
    ~10x slower there). quantization "int8" (CPU only) swaps the linear layers' GEMM.
    `compile_elementwise` (None: for bf16 on CPU, 5-7% there; fp32 gains ~0-1%, less than the
    seconds compiling adds to start-up) fuses the elementwise chains with Inductor (fused.py).
    `prepack_weights` (None: every CPU float route where torch has oneDNN, `onednn`) packs the
    linear weights for oneDNN once at load instead of on every call (onednn.py): A/B in one
    process on a Zen 4 (AVX512_BF16), demo model, oneDNN's primitive cache bounded as Triton
    runs it (perf/results/prepack.md): bf16 1.04-1.21x, fp32 1.09-1.80x; bf16 bit-identical.
    Packed GEMMs also pad row counts so that oneDNN's cached plans repeat (onednn.py)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if dtype not in ("auto", *DTYPES):
        raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, got {dtype!r}")
    if quantization == "int8" and device_type != "cpu":
        raise ValueError("quantization 'int8' runs on CPU only; use dtype bfloat16 on GPUs")
    cpu = device_type == "cpu"
    if dtype != "auto":
        reason = f"dtype {dtype} set by the deployment"
    elif not cpu:
        dtype = checkpoint_dtype if checkpoint_dtype in DTYPES else "float32"
        reason = f"the checkpoint's dtype on {device_type}"
    elif features.native_bf16:
        dtype = "bfloat16"
        reason = f"auto: {features.describe()} has native bf16 GEMM"
    else:
        dtype = "float32"
        reason = f"auto: {features.describe()} has no bf16 instructions (bf16 would be emulated)"
    if quantization == "int8":
        linear = "int8 (per-channel weights, per-token activations)"
        reason += "; int8 linear layers set by the deployment"
    elif dtype == "bfloat16" and cpu and not features.native_bf16:
        linear = "bfloat16 as fp32 GEMM"
    else:
        linear = dtype
    float_cpu = cpu and quantization == "none"
    if prepack_weights is None:
        prepack_weights = float_cpu and onednn
    elif prepack_weights and not (float_cpu and onednn):
        raise ValueError("prepack_weights needs the CPU float route (no int8) and a torch "
                         "with oneDNN")  # fmt: skip
    if prepack_weights:
        linear += ", oneDNN-packed weights"
    if compile_elementwise is None:  # measured worth its start-up seconds only there
        compile_elementwise = cpu and dtype == "bfloat16"
    elementwise = "compiled (Inductor)" if compile_elementwise else "eager"
    return Route(
        dtype=dtype,
        linear=linear,
        reason=reason,
        elementwise=elementwise,
        prepacked=prepack_weights,
    )
