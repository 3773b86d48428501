"""The native CPU kernels one at a time: row-wise ops against a copy, attention against torch
SDPA and vLLM's CPU kernel, GEMM blockings, and this checkout's operators against another
revision's.

    python bench_kernels.py rows [--tokens 2048 16384] [--dtypes bfloat16 float32]
    python bench_kernels.py attention [--lengths 32 128 256 1024 4096 8192]
    python bench_kernels.py bf16_blocking [--rows 20 128 1024 16384]
    python bench_kernels.py int8_blocking [--rows 20 128 1024 16384]
    python bench_kernels.py native_ab [--base HEAD] [--ops int8 int8_avx2 bf16 f32 attention]

Each subcommand writes its own report (results/<subcommand>.md and .json by default); `python
bench_kernels.py SUBCOMMAND --help` says what it measures and how.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from harness import (
    REPO,
    best_seconds,
    fmt,
    markdown_table,
    named_revision,
    new_record,
    run_subcommands,
    taking_turns,
    write_report,
)

from qwen_embed import cpu, int8, native
from qwen_embed.attention import AttentionSpec, create_backend
from qwen_embed.avx2_gemm import Avx2F32Weight
from qwen_embed.cpu import keep_freed_memory
from qwen_embed.kernels import native_cpu
from qwen_embed.native import build
from qwen_embed.onednn import NativeBf16Weight, PackedWeight, brgemm_runs
from qwen_embed.segments import AttentionLayout

# ---------------------------------------------------------------- rows

ROWS_DOC = """\
The row-wise ops of a decoder layer against the memory bound: GB/s of each native kernel,
and of a plain copy of the same bytes on the same machine.

    python bench_kernels.py rows [--tokens 2048 16384] [--dtypes bfloat16 float32]

Two sizes by default: 2,048 tokens, where most ops' bytes fit a server's last-level cache
(the kernels' arithmetic shows), and 16,384, which stream from memory. Bytes are what an op
must read and write once (inputs, outputs, cos/sin tables), on the demo model's widths
(Qwen3-Embedding-0.6B: hidden 1024, 16 query / 8 kv heads of 128, MLP 3072). The copy moves
as many bytes (read + write), so both meet the same caches; glibc keeps freed memory as the
engine has it (cpu.keep_freed_memory), so neither pays first-touch page faults.
"""


# Qwen3-Embedding-0.6B's widths
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 1024, 16, 8, 128, 3072


def ops(tokens: int, dtype: torch.dtype) -> dict:
    """name -> (call, bytes it reads and writes)"""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    e = torch.finfo(dtype).bits // 8
    x, residual, w = rand(tokens, HIDDEN), rand(tokens, HIDDEN), rand(HIDDEN)
    qkv = rand(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q, k = qkv[:, : HEADS * HEAD_DIM], qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM]
    cos, sin, norm_w = rand(tokens, HEAD_DIM // 2), rand(tokens, HEAD_DIM // 2), rand(HEAD_DIM)
    gate_up = rand(tokens, 2 * MLP)
    rope = native_cpu.norm_rotary
    table = tokens * HEAD_DIM * e  # cos and sin
    return {
        "rms_norm": (lambda: native_cpu.rms_norm(x, w, 1e-6), 2 * x.numel() * e),
        "residual add": (lambda: x.add_(residual), 3 * x.numel() * e),
        "q norm + rotary": (
            lambda: rope(q, cos, sin, HEAD_DIM, norm_w, 1e-6),
            2 * q.numel() * e + table,
        ),
        "k norm + rotary": (
            lambda: rope(k, cos, sin, HEAD_DIM, norm_w, 1e-6),
            2 * k.numel() * e + table,
        ),
        "silu(gate) * up": (lambda: native_cpu.silu_mul(gate_up), 3 * tokens * MLP * e),
    }


def best_of_both(call, nbytes: int, reps: int) -> tuple[float, float]:
    """Bytes per second of `call` and of a copy that reads and writes `nbytes` in all, each the
    best of `reps`, the two taking turns so that both meet the same moments of a shared host."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    op = copy = float("inf")
    for _ in range(reps):
        op = min(op, best_seconds(call, 1))
        copy = min(copy, best_seconds(lambda: dst.copy_(src), 1))
    return nbytes / op, nbytes / copy


def rows_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 16384])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--reps", type=int, default=30, help="at 16,384 tokens; more at fewer")


def rows(args: argparse.Namespace) -> None:
    keep_freed_memory()
    if native.isa() is None:
        raise SystemExit("the native kernels are not built (make setup)")
    rows = []
    for tokens, dtype_name in ((t, d) for t in args.tokens for d in args.dtypes):
        dtype = getattr(torch, dtype_name)
        for name, (call, nbytes) in ops(tokens, dtype).items():
            rate, copy = best_of_both(call, nbytes, args.reps * max(1, 16384 // tokens))
            rows.append(
                {
                    "tokens": tokens,
                    "op": name,
                    "dtype": dtype_name,
                    "MB": nbytes / 1e6,
                    "GBps": rate / 1e9,
                    "copy_GBps": copy / 1e9,
                    "of_copy": rate / copy,
                }
            )
            print(rows[-1], flush=True)
    record = new_record(
        tokens=args.tokens, isa=native.isa(), threads=torch.get_num_threads(), rows=rows
    )
    notes = [
        f"work: {', '.join(map(str, args.tokens))} tokens, demo model widths; native kernels "
        f"{native.isa()}, {torch.get_num_threads()} threads; best of {args.reps} at 16,384 "
        "tokens and proportionally more at fewer, the op and the copy taking turns",
    ]
    table = markdown_table(
        ["tokens", "op", "dtype", "MB moved", "GB/s", "copy of the same bytes GB/s", "of copy"],
        [
            [
                f"{r['tokens']:,}",
                r["op"],
                r["dtype"],
                f"{r['MB']:.0f}",
                f"{r['GBps']:.1f}",
                f"{r['copy_GBps']:.1f}",
                f"{r['of_copy']:.0%}",
            ]
            for r in rows
        ],
    )
    write_report(args.out, record, "Row-wise ops against a copy of the same bytes", notes, table)


# ---------------------------------------------------------------- attention

ATTENTION_DOC = """\
The native attention operator vs PyTorch SDPA per segment (the torch backend) vs vLLM's CPU
kernel, on one layer's attention of Qwen3-Embedding-0.6B's shape (16 heads, 8 kv heads, head
size 128).

    python bench_kernels.py attention [--lengths 32 128 256 1024 4096 8192]
                                      [--dtypes bfloat16 float32]

Per text length L: one call over ~8,192 tokens of causal texts of L tokens each (one text for
L >= 8,192), the best of --reps calls after a warm-up, with the encoder's threads; with
--rounds N the three kernels take turns N times and the medians are reported. vLLM's kernel
runs in its own venv (perf/peers/vllm_attention.py; `make perf-peers` installs it) on the same
shapes, timed without its KV-cache write; it is left out where that venv is absent.
"""


VLLM_PYTHON = REPO / ".cache" / "peers" / "vllm" / "venv" / "bin" / "python"


ATTENTION_TOKENS = 8192


def vllm_seconds(lens: list[int], dtype: str, reps: int) -> tuple[float | None, float | None]:
    """(attention alone, with its KV-cache write) in seconds, or Nones."""
    if not VLLM_PYTHON.exists():
        return None, None
    cmd = [
        str(VLLM_PYTHON),
        str(REPO / "perf" / "peers" / "vllm_attention.py"),
        f"--lens={','.join(map(str, lens))}",
        f"--heads={HEADS}",
        f"--kv-heads={KV_HEADS}",
        f"--head-dim={HEAD_DIM}",
        f"--dtype={dtype}",
        f"--threads={torch.get_num_threads()}",
        f"--reps={reps}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr}
    if "seconds" not in result:
        print(f"vLLM kernel: {result.get('error', '')[-300:]}", flush=True)
        return None, None
    return result["seconds"], result["seconds_with_cache_write"]


def ratios_to_native(rounds: list[dict], key: str) -> list[float] | None:
    """Per round, `key`'s time over the native operator's (None where `key` was not run)."""
    if any(r[key] is None for r in rounds):
        return None
    return [r[key] / r["native"] for r in rounds]


def attention_inputs(length: int, tokens: int, dtype: torch.dtype) -> tuple:
    """Texts of `length` tokens filling ~`tokens`: (lens, q, k, v, cu offsets int32)."""
    lens = [length] * max(1, tokens // length)
    t = sum(lens)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(t, HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return lens, q, k, v, cu


def measure_attention(length: int, dtype: str, reps: int, rounds: int) -> dict:
    torch_dtype = getattr(torch, dtype)
    lens, q, k, v, cu = attention_inputs(length, ATTENTION_TOKENS, torch_dtype)
    layout = AttentionLayout(tuple(lens), tuple(lens), cu, cu, cu, cu, None)
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, True, torch.device("cpu"), torch_dtype)
    backends, outputs = {}, {}
    for name in ("native", "torch"):
        backends[name] = create_backend(name, spec)
        backends[name].prepare(layout)
        outputs[name] = backends[name].forward(q, k, v, layout)
    per_round = []  # the systems take turns: this host's speed drifts over minutes
    for _ in range(rounds):
        seconds = {
            name: best_seconds(lambda b=backend: b.forward(q, k, v, layout), reps)
            for name, backend in backends.items()
        }
        seconds["vllm"], seconds["vllm_write"] = vllm_seconds(lens, dtype, reps)
        per_round.append(seconds)

    def median_ms(key: str) -> float | None:
        times = [r[key] for r in per_round]
        return None if None in times else statistics.median(times) * 1e3

    vs = {key: ratios_to_native(per_round, key) for key in ("torch", "vllm", "vllm_write")}
    row = {
        "dtype": dtype,
        "length": length,
        "texts": len(lens),
        "rounds": rounds,
        "native_ms": median_ms("native"),
        "torch_ms": median_ms("torch"),
        "vllm_ms": median_ms("vllm"),
        "vllm_with_write_ms": median_ms("vllm_write"),
        "vs_torch": statistics.median(vs["torch"]),
        "vs_vllm": None if vs["vllm"] is None else statistics.median(vs["vllm"]),
        "vs_vllm_range": None if vs["vllm"] is None else [min(vs["vllm"]), max(vs["vllm"])],
        "vs_vllm_with_write": None
        if vs["vllm_write"] is None
        else statistics.median(vs["vllm_write"]),
        "max_abs_vs_torch": (outputs["native"].float() - outputs["torch"].float())
        .abs()
        .max()
        .item(),
    }
    print(row, flush=True)
    return row


def attention_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 256, 1024, 4096, 8192])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1, help="turns of native, torch and vLLM")
    p.add_argument("--isa", default="", help="run the native kernels of this instruction set")


def attention(args: argparse.Namespace) -> None:
    if native.isa() is None:
        raise SystemExit("the native kernels are not built: make setup")
    native.select(args.isa)
    keep_freed_memory()  # as the encoder runs: no fresh pages for every call's buffers
    rows = [
        measure_attention(n, dtype, args.reps, args.rounds)
        for dtype in args.dtypes
        for n in args.lengths
    ]
    record = new_record(isa=native.isa(), threads=torch.get_num_threads(), rows=rows)
    table = markdown_table(
        [
            "dtype",
            "text tokens",
            "texts",
            "native ms",
            "torch SDPA ms",
            "vLLM ms",
            "vLLM + cache write ms",
            "native vs torch",
            "native vs vLLM",
            "native vs vLLM + write",
            "max abs vs torch",
        ],
        [
            [
                r["dtype"],
                r["length"],
                r["texts"],
                fmt(r["native_ms"], ".2f"),
                fmt(r["torch_ms"], ".2f"),
                fmt(r["vllm_ms"], ".2f"),
                fmt(r["vllm_with_write_ms"], ".2f"),
                f"{r['vs_torch']:.2f}x",
                fmt(r["vs_vllm"], ".2f")
                + (
                    ""
                    if r["rounds"] == 1 or r["vs_vllm"] is None
                    else " ({:.2f}-{:.2f})".format(*r["vs_vllm_range"])
                ),
                fmt(r["vs_vllm_with_write"], ".2f"),
                fmt(r["max_abs_vs_torch"], ".1e"),
            ]
            for r in rows
        ],
    )
    notes = [
        f"native kernels: {native.isa()}, {torch.get_num_threads()} threads",
        f"one layer: {HEADS} heads, {KV_HEADS} kv heads, head size {HEAD_DIM}, causal",
        "vLLM: torch.ops._C.cpu_attention_with_kv_cache in vLLM's venv (perf/peers/"
        "vllm_attention.py), alone and with its KV-cache write (which packs keys/values as ours "
        "does inside its call), allocating its output per call as ours does (and as vLLM's "
        "Attention layer does); best of --reps calls each, per round; with --rounds > 1 the "
        "three take turns and the table gives medians (times, and ratios within a round, with "
        "their range)",
    ]
    write_report(args.out, record, "Attention operator: native vs torch SDPA vs vLLM", notes, table)


# ---------------------------------------------------------------- bf16_blocking, int8_blocking

BF16_BLOCKING_DOC = """\
How batch_invariant's bf16 GEMM is best cut on this CPU: blockings of the native bf16
operator against oneDNN's packed GEMM, per GEMM shape and row count.

    python bench_kernels.py bf16_blocking [--rows 20 128 1024 16384] [--rounds 3]

The operator (gemm/ops.cpp bf16_linear) sums each row over the whole K per task and panel (our AMX
tile kernel for panels of 16 and 64 on AMX CPUs, our panel kernel or oneDNN's micro-kernel
otherwise), so every blocking gives a row the same bits (checked here against the default for
each): the weights' panel (native.bf16_panel's as shipped: 16 on AMX CPUs, else 64), rows and
channels per task, and whether consecutive tasks share channels or rows. The gate|up
projection runs gated where the engine gates it (native.gates: silu(gate) * up in the GEMM's
store), against oneDNN's GEMM and the native SiLU gating after it. Per shape
(Qwen3-Embedding-0.6B's widths) and row count: every blocking once (best of 3), then the 4
fastest, the default and oneDNN taking turns for --rounds rounds (median of each's best of 2).
The default is the operator's own (64 rows x 512 channels, channels outermost) on the shipped
panel. `int8_blocking` does the same for the int8 operator.
"""

INT8_BLOCKING_DOC = """\
How the int8 route's GEMM is best cut on this CPU: blockings of the native int8 operator
(quantised rows, the integer sums on our AMX tile kernel or VNNI panel kernel, the rescale;
the gate|up projection gated where the engine gates it, as in `bf16_blocking`) per GEMM shape
and row count, against the float route's bf16 GEMM (oneDNN's packed) of the same shape; on CPUs
without VNNI, of the AVX2 operator (gemm/pairs_avx2.cpp: 16-channel panels, 96 rows x 256
channels by default) against the fp32 GEMM.

    python bench_kernels.py int8_blocking [--rows 20 128 1024 16384] [--rounds 3]

The operator (gemm/ops.cpp int8_linear) sums each row over the whole K per task and block of
channels, so every blocking gives a row the same bits (checked against the default for each):
rows and channels per task, and whether consecutive tasks share channels or rows. Per shape of
the route's int8 layers (Qwen3-Embedding-0.6B's widths) and row count: every blocking once
(best of 3), then the 4 fastest, the default and the bf16 GEMM taking turns (as
`bf16_blocking`). The default is the operator's own (96 rows x 1,024 channels,
channels outermost).
"""

# Qwen3-Embedding-0.6B's linear layers, (out, in) features
BF16_SHAPES = {
    "qkv": (4096, 1024),
    "o": (1024, 2048),
    "gate_up": (6144, 1024),
    "down": (1024, 3072),
}
GATED = "gate_up"  # the projection the engine gates where the operator can (native.gates)
# the widths are multiples of 32: each shape's panel is bf16_panel(k)'s, the same for all
DEFAULT_PANEL = native.bf16_panel(1024)
PANELS = tuple(sorted({DEFAULT_PANEL, 64, 128, 256, 512}))


def schema_blocking(op) -> tuple:
    """(task rows, task channels, channels outermost): an operator's defaults."""
    args = {a.name: a.default_value for a in op.default._schema.arguments}
    return (args["task_rows"], args["task_channels"], args["channels_outer"])


def bf16_default() -> tuple:
    """(panel, task rows, task channels, channels outermost) as the engine runs the operator:
    onednn.NativeBf16Weight's panel and the operator's own defaults."""
    return (DEFAULT_PANEL, *schema_blocking(torch.ops.qwen_embed.bf16_linear))


def bf16_blockings() -> list[tuple]:
    grid = itertools.product(PANELS, (32, 64), (256, 512, 1024), (True, False))
    return [b for b in grid if b[2] % b[0] == 0]


def label(b: tuple) -> str:
    panel, rows, channels, channels_outer = b
    return f"{rows}x{channels} {'channels' if channels_outer else 'rows'} outer, panel {panel}"


def compare(
    shape: str,
    m: int,
    call: Callable[[tuple], Callable],
    grid: list[tuple],
    default: tuple,
    baseline: Callable,
    rounds: int,
) -> dict:
    """A GEMM of `m` rows: every blocking of `grid` checked against the default's bits and
    screened once; then the 4 fastest, the default and the baseline taking turns for `rounds`
    rounds."""
    reference = call(default)()
    once = {}
    for b in grid:
        assert torch.equal(call(b)(), reference), f"{label(b)} gave other bits"
        once[b] = best_seconds(call(b), 3)
    top = sorted(once, key=once.get)[:4]
    turns = {"baseline": baseline, default: call(default), **{b: call(b) for b in top}}
    times = {key: [] for key in turns}
    for _ in range(rounds):
        for key, fn in turns.items():
            times[key].append(best_seconds(fn, 2) * 1e3)
    ms = {key: statistics.median(t) for key, t in times.items()}
    best = min(top, key=ms.get)
    row = {
        "shape": shape,
        "rows": m,
        "blockings": len(once),
        "onednn_ms": ms["baseline"],
        "default_ms": ms[default],
        "best": label(best),
        "best_ms": ms[best],
        "top": {label(b): ms[b] for b in top},
        "screened": {label(b): seconds * 1e3 for b, seconds in once.items()},
    }
    print({key: v for key, v in row.items() if key != "screened"}, flush=True)
    return row


def then_gating(gemm: Callable, gated: bool) -> Callable:
    """A baseline GEMM, followed by the native SiLU gating where the operator gates."""
    return (lambda: torch.ops.qwen_embed.silu_mul(gemm())) if gated else gemm


def measure_bf16(name: str, m: int, rounds: int) -> dict:
    n, k = BF16_SHAPES[name]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    packs = {panel: native.pack_panels(w, 2, panel) for panel in PANELS}
    onednn = PackedWeight(w)
    gated = name == GATED and NativeBf16Weight(w).gates
    # a gated GEMM runs on the tile kernel: 16- and 64-channel panels
    grid = [b for b in bf16_blockings() if not gated or b[0] in (DEFAULT_PANEL, native.PANEL)]

    def call(b: tuple):
        panel, rows, channels, channels_outer = b
        return lambda: torch.ops.qwen_embed.bf16_linear(
            x, packs[panel], None, n, rows, channels, channels_outer, gated
        )

    shape = f"{name} {n}x{k}" + (" gated" if gated else "")
    baseline = then_gating(lambda: onednn(x), gated)
    return compare(shape, m, call, grid, bf16_default(), baseline, rounds)


def one_blocking(rows: list[dict], m: int, default: str) -> str:
    """The blocking fastest over all shapes at `m` rows (screening times summed)."""
    at_m = [r for r in rows if r["rows"] == m]
    everywhere = set.intersection(*(set(r["screened"]) for r in at_m))  # gated: fewer
    total = {b: sum(r["screened"][b] for r in at_m) for b in everywhere}
    best = min(total, key=total.get)
    return (
        f"{m} rows, all shapes: fastest one blocking {best}, {total[best]:.2f} ms screened "
        f"against the default's {total[default]:.2f} ({total[best] / total[default]:.2f}x)"
    )


def blocking_report(args, rows: list[dict], title: str, baseline: str, default: str) -> None:
    """The table of `rows` (one per shape and row count) against the `baseline` GEMM."""
    table = markdown_table(
        [
            "GEMM",
            "rows",
            f"{baseline} ms",
            f"default ms (x {baseline})",
            "fastest blocking",
            f"its ms (x {baseline})",
        ],
        [
            [
                r["shape"],
                r["rows"],
                f"{r['onednn_ms']:.3f}",
                f"{r['default_ms']:.3f} ({r['default_ms'] / r['onednn_ms']:.2f}x)",
                r["best"],
                f"{r['best_ms']:.3f} ({r['best_ms'] / r['onednn_ms']:.2f}x)",
            ]
            for r in rows
        ],
    )
    notes = [
        f"{torch.get_num_threads()} threads; {rows[0]['blockings']} blockings, every one the "
        f"same bits as the default; default: {default}"
    ] + [one_blocking(rows, m, default) for m in args.rows]
    write_report(args.out, new_record(rows=rows), title, notes, table)


INT8_SHAPES = {"qk": (3072, 1024), "gate_up": (6144, 1024), "down": (1024, 3072)}


def int8_operator(vnni: bool) -> tuple:
    """The int8 layers' operator, its panel and its input dtype: the VNNI one on bf16 rows, or
    the AVX2 one on fp32 rows (the float route's dtype on CPUs without VNNI)."""
    if vnni:
        return torch.ops.qwen_embed.int8_linear, native.int8_panel(), torch.bfloat16
    return torch.ops.qwen_embed.int8_linear_avx2, int8.PAIRS_PANEL, torch.float32


def int8_default(op, panel: int) -> tuple:
    return (panel, *schema_blocking(op))


def int8_blockings(vnni: bool, panel: int) -> list[tuple]:
    channels = (256, 512, 1024) if vnni else (64, 256, 1024)
    return list(itertools.product((panel,), (32, 96, 256), channels, (True, False)))


def measure_int8(name: str, m: int, rounds: int) -> dict:
    n, k = INT8_SHAPES[name]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g)
    layer = int8.Int8Weight(w)
    op, panel, dtype = int8_operator(layer.native)
    x = torch.randn(m, k, generator=g).to(dtype)
    float_gemm = PackedWeight(w.to(dtype))
    gated = name == GATED and layer.gates
    if layer.native:
        operands = (x, layer.packed, layer.offset, layer.scale, None, n, layer.rotation)
    else:
        operands = (x, layer.packed, layer.scale, n, layer.rotation)

    gating = {"gated": True} if gated else {}  # the AVX2 operator never gates

    def call(b: tuple):
        _, rows, channels, channels_outer = b
        return lambda: op(*operands, rows, channels, channels_outer, **gating)

    shape = f"{name} {n}x{k}" + (" gated" if gated else "")
    default = int8_default(op, panel)
    blockings = int8_blockings(layer.native, panel)
    baseline = then_gating(lambda: float_gemm(x), gated)
    return compare(shape, m, call, blockings, default, baseline, rounds)


def blocking_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, nargs="+", default=[20, 128, 1024, 16384])
    p.add_argument("--rounds", type=int, default=3)


def bf16_blocking(args: argparse.Namespace) -> None:
    keep_freed_memory()  # as the engine does: no page faults in the timings
    if not brgemm_runs():
        raise SystemExit("the native bf16 operator does not run here (AVX-512 and oneDNN)")
    rows = [measure_bf16(name, m, args.rounds) for m in args.rows for name in BF16_SHAPES]
    title = "batch_invariant's bf16 GEMM: blockings"
    blocking_report(args, rows, title, "oneDNN", label(bf16_default()))


def int8_blocking(args: argparse.Namespace) -> None:
    keep_freed_memory()
    if not (int8.native_kernel() or int8.avx2_kernel()):
        raise SystemExit("no native int8 operator runs here (the build; AVX2, or AVX512_VNNI)")
    rows = [measure_int8(name, m, args.rounds) for m in args.rows for name in INT8_SHAPES]
    op, panel, dtype = int8_operator(int8.native_kernel())
    title = "The int8 route's GEMM: blockings"
    baseline = f"{'bf16' if dtype == torch.bfloat16 else 'fp32'} GEMM"
    blocking_report(args, rows, title, baseline, label(int8_default(op, panel)))


# ---------------------------------------------------------------- native_ab

NATIVE_AB_DOC = """\
The native operators of this checkout against another revision's, in one process, in pairs.

    python bench_kernels.py native_ab [--base HEAD] [--ops int8 int8_avx2 bf16 f32 attention]
        [--pairs 15]

Timings taken in separate processes or minutes apart move more on a drifting host than most
kernel changes do. Here the base revision's csrc/ is built (with this checkout's compiler flags)
into a second library (in .cache/native-ab/<commit>/) whose operators register as
`qwen_embed_base`, both libraries are loaded, and each measurement is a pair of calls on the
same operands, one per build, the order alternating. The report gives, per operator and shape,
the median of the pairs' time ratios (checkout / base) with their quartiles, the base's median
time, and whether both builds gave the same bits. Shapes: the 4-layer model's linear layers at
each of --rows row counts (int8 and int8_avx2 (the operator of AVX2 CPUs without VNNI): the
int8 route's q|k, gate|up and down; bf16 and f32 (the AVX2 operator): q|k|v, o, gate|up, down)
and the attention of ~--rows tokens of texts of 128, 1,024 and 8,192 tokens, in bf16. Those
layers' weights stay in cache from call to call; at up to 64 rows each GEMM also runs its
layers of all 28 layers of Qwen3-Embedding-0.6B's shape, each with weights of its own (a short
query's forward: the weights stream from memory).
"""


CSRC = "plugins/qwen_embed/native/csrc"


BASE_OPS = "qwen_embed_base"
BUILD_SETTINGS = ("CSRC", "BUILD", "LIBRARY", "STAMP", "ISA_FLAGS", "OPERATOR_SOURCES")
MOVED_SOURCES = {"int8_rows.cpp": "gemm/rows.cpp", "gemm_amx.cpp": "gemm/tiles_amx.cpp"}


TEXT_TOKENS = (128, 1024, 8192)


def base_library(revision: str) -> Path:
    """The base revision's kernels built once into .cache/native-ab/<commit>/, their operators
    renamed to qwen_embed_base (two libraries cannot register one namespace)."""
    commit = subprocess.run(
        ["git", "rev-parse", revision], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    out = REPO / ".cache" / "native-ab" / commit
    library = out / "libqwen_embed_base.so"
    if library.exists():
        return library
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "csrc.tar"
        subprocess.run(["git", "archive", "-o", str(archive), commit, CSRC], cwd=REPO, check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        src = Path(tmp) / CSRC
        for source in src.rglob("*.cpp"):  # the operators' registrations, wherever they are
            source.write_text(
                source.read_text()
                .replace("TORCH_LIBRARY(qwen_embed,", f"TORCH_LIBRARY({BASE_OPS},")
                .replace("TORCH_LIBRARY_IMPL(qwen_embed,", f"TORCH_LIBRARY_IMPL({BASE_OPS},")
            )
        out.mkdir(parents=True, exist_ok=True)
        saved = {name: getattr(build, name) for name in BUILD_SETTINGS}
        build.CSRC, build.BUILD, build.LIBRARY, build.STAMP = src, out, library, out / "stamp"
        flags = saved["ISA_FLAGS"]
        build.ISA_FLAGS = {name: f for name, f in flags.items() if (src / name).exists()}
        # a revision from before gemm/ and the operators' split: its names for the same sources
        build.ISA_FLAGS |= {
            old: flags[new] for old, new in MOVED_SOURCES.items() if (src / old).exists()
        }
        ops = tuple(name for name in saved["OPERATOR_SOURCES"] if (src / name).exists())
        build.OPERATOR_SOURCES = ops or ("ops.cpp",)
        try:
            build.build()
        finally:
            for name, value in saved.items():
                setattr(build, name, value)
    return library


# Up to this many rows a case also runs every layer of a 28-layer model (Qwen3-Embedding-0.6B's
# shape) with weights of its own, as a short query's forward does: the weights stream from
# memory, where the single layers' shapes find theirs in cache.
STREAMED_ROWS = 64
STREAMED_LAYERS = 28


def gemm_cases(op: str, shapes: dict, layer: Callable, dtype: torch.dtype, rows: int) -> dict:
    """Per shape (n, k), `layer(n, k)` (a call `(ops, x)` on weights of its own) on `rows` rows;
    up to STREAMED_ROWS rows also every shape in turn, STREAMED_LAYERS times over."""
    cases = {}
    for name, (n, k) in shapes.items():
        call, x = layer(n, k), torch.randn(rows, k, dtype=dtype)
        cases[f"{op} {name} {k} -> {n}"] = lambda ops, call=call, x=x: call(ops, x)
    if rows <= STREAMED_ROWS:
        model = [(layer(n, k), k) for _ in range(STREAMED_LAYERS) for n, k in shapes.values()]
        xs = {k: torch.randn(rows, k, dtype=dtype) for _, k in shapes.values()}

        def streamed(ops):
            return torch.cat([call(ops, xs[k]).flatten() for call, k in model])

        cases[f"{op} {STREAMED_LAYERS} layers, weights streamed"] = streamed
    return cases


def int8_layer(n: int, k: int) -> Callable:
    packed, offset, scale = int8.pack(*int8.quantize_rows(torch.randn(n, k)))
    rotation = int8.rotation_block(k)
    return lambda ops, x: ops.int8_linear(x, packed, offset, scale, None, n, rotation)


def int8_avx2_layer(n: int, k: int) -> Callable:
    packed, scale = int8.pack_pairs(*int8.quantize_rows(torch.randn(n, k)))
    rotation = int8.rotation_block(k)
    return lambda ops, x: ops.int8_linear_avx2(x, packed, scale, n, rotation)


def bf16_layer(n: int, k: int) -> Callable:
    packed = native.pack_panels(torch.randn(n, k, dtype=torch.bfloat16), 2)
    return lambda ops, x: ops.bf16_linear(x, packed, None, n)


def f32_layer(n: int, k: int, weights: torch.dtype = torch.float32) -> Callable:
    """fp32 values are held in fp32, a bf16 checkpoint's (`weights` bf16) in bf16."""
    packed = Avx2F32Weight(torch.randn(n, k).to(weights)).packed
    return lambda ops, x: ops.f32_linear(x, packed, None, n)


def int8_cases(rows: int) -> dict[str, Callable]:
    return gemm_cases("int8_linear", INT8_SHAPES, int8_layer, torch.bfloat16, rows)


def int8_avx2_cases(rows: int) -> dict[str, Callable]:
    return gemm_cases("int8_linear_avx2", INT8_SHAPES, int8_avx2_layer, torch.float32, rows)


def bf16_cases(rows: int) -> dict[str, Callable]:
    return gemm_cases("bf16_linear", BF16_SHAPES, bf16_layer, torch.bfloat16, rows)


def f32_cases(rows: int) -> dict[str, Callable]:
    return gemm_cases("f32_linear", BF16_SHAPES, f32_layer, torch.float32, rows)


def f32_bf16_cases(rows: int) -> dict[str, Callable]:
    layer = functools.partial(f32_layer, weights=torch.bfloat16)
    return gemm_cases("f32_linear bf16-held", BF16_SHAPES, layer, torch.float32, rows)


def attention_cases(rows: int) -> dict[str, Callable]:
    cases = {}
    for length in TEXT_TOKENS:
        lens, q, k, v, cu = attention_inputs(length, rows, torch.bfloat16)
        cases[f"varlen_attention {len(lens)} x {length}"] = lambda ops, q=q, k=k, v=v, cu=cu: (
            ops.varlen_attention(q, k, v, cu, cu, True, HEAD_DIM**-0.5)
        )
    return cases


CASES = {
    "int8": int8_cases,
    "int8_avx2": int8_avx2_cases,
    "bf16": bf16_cases,
    "f32": f32_cases,
    "f32_bf16": f32_bf16_cases,  # bases from 70c0184 on (older ones hold fp32 weights only)
    "attention": attention_cases,
}


def pair_ratios(call: Callable, pairs: int) -> tuple[list[float], list[float]]:
    """`pairs` turns of the base's call and the checkout's: checkout / base time per turn, and
    the base's times."""
    base, checkout = getattr(torch.ops, BASE_OPS), torch.ops.qwen_embed
    seconds = taking_turns({"base": lambda: call(base), "checkout": lambda: call(checkout)}, pairs)
    ratios = [c / b for c, b in zip(seconds["checkout"], seconds["base"], strict=True)]
    return ratios, seconds["base"]


def native_ab_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", default="HEAD", help="git revision to compare against")
    p.add_argument("--ops", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument(
        "--rows", type=int, nargs="+", default=[12800], help="rows per GEMM, tokens per attention"
    )
    p.add_argument("--pairs", type=int, default=15)


def native_ab(args: argparse.Namespace) -> None:
    if native.isa() is None:
        raise SystemExit("the native kernels are not built: make setup")
    cpu.keep_freed_memory()  # as the engine does: outputs reuse freed heap, no page faults
    base = named_revision(args.base)
    torch.ops.load_library(str(base_library(args.base)))
    getattr(torch.ops, BASE_OPS).select_isa(native.isa())
    rows = []
    for count, group in ((c, g) for c in args.rows for g in args.ops):
        for name, call in CASES[group](count).items():
            same = torch.equal(call(getattr(torch.ops, BASE_OPS)), call(torch.ops.qwen_embed))
            ratios, base_seconds = pair_ratios(call, args.pairs)
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            row = {
                "rows": count,
                "op": name,
                "ratio": statistics.median(ratios),
                "q1": q1,
                "q3": q3,
                "base_ms": statistics.median(base_seconds) * 1e3,
                "same_bits": same,
            }
            rows.append(row)
            print(row, flush=True)
    header = ["rows", "operator, shape", "checkout / base time (median of pairs)", "quartiles"]
    table = markdown_table(
        [*header, "base ms", "same bits"],
        [
            [f"{r['rows']:,}", r["op"], f"{r['ratio']:.3f}", f"{r['q1']:.3f}-{r['q3']:.3f}"]
            + [f"{r['base_ms']:.2f}", "yes" if r["same_bits"] else "no"]
            for r in rows
        ],
    )
    record = new_record(base=base, isa=native.isa(), rows_per_call=args.rows, rows=rows)
    notes = [
        f"base: {base}; native kernels {native.isa()}, {torch.get_num_threads()} threads; "
        f"{args.pairs} pairs of calls per shape, one per build, the order alternating"
    ]
    print(
        write_report(
            args.out, record, "Native operators: this checkout vs a base revision", notes, table
        )
    )


COMMANDS = {
    "bf16_blocking": (BF16_BLOCKING_DOC, blocking_arguments, bf16_blocking),
    "int8_blocking": (INT8_BLOCKING_DOC, blocking_arguments, int8_blocking),
    "rows": (ROWS_DOC, rows_arguments, rows),
    "attention": (ATTENTION_DOC, attention_arguments, attention),
    "native_ab": (NATIVE_AB_DOC, native_ab_arguments, native_ab),
}


def main() -> None:
    run_subcommands(__doc__, COMMANDS)


if __name__ == "__main__":
    main()
