"""An encoder's settings: one frozen object, with every default written here and nowhere else.

`Encoder.from_pretrained`, the tensor-parallel workers and the Triton encoder model take it
whole. The Triton model builds it from config.pbtxt's `parameters` (`from_parameters`), so a new
setting is a field here plus its row in docs/configuration.md. What follows from the settings,
the checkpoint and the machine (dtype, linear route, attention backend, prefix reuse, pruning)
is resolved once into a `route.Route`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, fields

DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = ("none", "int8", "fp8")
POOLING_METHODS = ("last", "mean", "cls", "attention")
TASKS = ("auto", "embed", "rerank", "classify")
SWITCH = ("auto", "on", "off")
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
# The largest cuda_graph_tokens (the graphs' static buffers are sized for the setting; a
# forward holds at most max_batch_tokens rows but for one text longer than that).
MAX_GRAPH_TOKENS = 65536


def switch(value: bool | str | None, name: str) -> str:
    """A three-way setting as "auto" / "on" / "off"; Python callers may pass None/True/False."""
    if value is None or value == "":
        return "auto"
    if isinstance(value, bool):
        return "on" if value else "off"
    if value not in SWITCH:
        raise ValueError(f"{name} must be 'auto', 'on' or 'off', not {value!r}")
    return value


@dataclass(frozen=True)
class EncoderSettings:
    """What a deployment chooses for one encoder. Each field is a config.pbtxt parameter of the
    same name (docs/configuration.md)."""

    # "auto": cuda:0 where CUDA is present, else the CPU; or "cpu", "cuda", "cuda:N".
    device: str = "auto"
    tp_size: int = 1
    # "auto": bf16 on CPUs whose bf16 GEMMs outrun fp32's (AMX; AVX512_BF16 but on Intel
    # without AMX), else fp32; on GPUs the checkpoint's 16-bit
    # dtype, bf16 (or fp16) for an fp32 checkpoint.
    dtype: str = "auto"
    # "int8" (CPU only): int8 linear layers; "fp8" (GPUs with fp8 tensor cores; CPUs only to
    # check it): e4m3 linear layers, bf16 elsewhere
    quantization: str = "none"
    attn_backend: str = "auto"  # "auto", "native", "torch", "flash_attn", "flashinfer"
    # "embed", "rerank", "classify"; "auto": a sequence classifier's one label reranks, its
    # several labels classify; any other checkpoint embeds
    task: str = "auto"
    # "auto": the checkpoint's (sentence-transformers' Pooling module), else the last token
    pooling: str = "auto"
    max_batch_tokens: int = 16384  # tokens per forward; a longer text runs alone
    # A task adapter the checkpoint ships (adapters/{name}/: jina-embeddings-v5's, a LoRA
    # fine-tune's), merged into the weights at load; "auto": the only one, else `retrieval`;
    # "none": base weights.
    adapter: str = "auto"
    # LoRA adapters a request names (parameter `adapter`), kept unmerged beside the weights:
    # "name=path" pairs, comma-separated (a peft adapter folder or fine-tune, local or a Hub
    # id), or a bare name for the checkpoint's own adapters/{name}/; then nothing is merged.
    lora_modules: str = ""
    # "auto": a prefix that texts share is computed once (causal models, last-token pooling).
    prefix_reuse: str = "auto"
    prefix_cache_mb: float = 256.0  # keys/values of shared prefixes kept between batches
    # "auto": on CPU float routes (where torch has oneDNN) linear weights are packed at load.
    prepack_weights: str = "auto"
    # "on": a text's vector is bitwise the same whatever batch it runs in, also where oneDNN's
    # bf16 GEMM (on AMX CPUs) is not (CPU only). "auto": on for bf16 where the native operator
    # runs (CPUs with AVX512_BF16 or AMX; faster there: docs/tuning.md), else off.
    batch_invariant: str = "auto"
    # GPU, tp_size 1: forwards of up to this many tokens replay CUDA graphs captured at load
    # (cuda_graphs.py); 0: none.
    cuda_graph_tokens: int = 8192
    dist_addr: str = "127.0.0.1:0"  # tensor-parallel rendezvous; port 0 picks a free one
    dist_timeout_s: float = 300.0

    def __post_init__(self):
        set_ = object.__setattr__  # frozen: normalise once, here
        for name in ("prefix_reuse", "prepack_weights"):
            set_(self, name, switch(getattr(self, name), name))
        _one_of("dtype", self.dtype, ("auto", *DTYPES))
        _one_of("quantization", self.quantization, QUANTIZATIONS)
        _one_of("pooling", self.pooling, ("auto", *POOLING_METHODS))
        _one_of("task", self.task, TASKS)
        _one_of("batch_invariant", self.batch_invariant, ("auto", "on", "off"))
        for name, least in (
            ("tp_size", 1),
            ("max_batch_tokens", 1),
            ("prefix_cache_mb", 0),
            ("cuda_graph_tokens", 0),
        ):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if self.cuda_graph_tokens > MAX_GRAPH_TOKENS:
            raise ValueError(
                f"cuda_graph_tokens must be <= {MAX_GRAPH_TOKENS}, got {self.cuda_graph_tokens}"
            )
        parse_lora_modules(self.lora_modules)  # the form checked here; the folders at load
        if self.dist_addr.rpartition(":")[0] == "":
            raise ValueError(f"dist_addr must be host:port, got {self.dist_addr!r}")

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> EncoderSettings:
        return from_parameters(cls, params, "encoder")

    def replace(self, **changes) -> EncoderSettings:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EncoderSettings:
        return cls(**json.loads(text))


def parse_lora_modules(text: str) -> tuple[tuple[str, str | None], ...]:
    """The lora_modules setting as (name, folder or Hub id; None: the checkpoint's own
    adapters/{name}/) pairs."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, where = (part.strip() for part in item.partition("="))
        if not _ADAPTER_NAME.fullmatch(name) or ("=" in item and not where):
            raise ValueError(
                f"lora_modules must be comma-separated name=path pairs or names (letters, "
                f"digits, '.', '_', '-'), got {item!r}"
            )
        if name in (n for n, _ in pairs):
            raise ValueError(f"lora_modules names {name!r} twice")
        pairs.append((name, where or None))
    return tuple(pairs)


def from_parameters(cls, params: dict[str, str], what: str):
    """A settings dataclass from config.pbtxt string parameters: an empty value keeps the
    field's default, an unknown key is refused (a misspelt setting must not be ignored)."""
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(f"unknown {what} parameter(s) {unknown}; known: {sorted(known)}")
    values = {}
    for key, text in params.items():
        if text == "":
            continue
        kind = type(known[key].default)
        try:
            values[key] = kind(text)
        except ValueError:
            raise ValueError(f"parameter {key!r} must be {kind.__name__}, got {text!r}") from None
    return cls(**values)


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
