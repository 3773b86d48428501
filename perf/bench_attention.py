"""The native attention operator vs PyTorch SDPA per segment (the torch backend) vs vLLM's CPU
kernel, on one layer's attention of Qwen3-Embedding-0.6B's shape (16 heads, 8 kv heads, head
size 128).

    python bench_attention.py [--lengths 32 128 256 1024 4096 8192] [--dtypes bfloat16 float32]

Per text length L: one call over ~8,192 tokens of causal texts of L tokens each (one text for
L >= 8,192), the best of --reps calls after a warm-up, with the encoder's threads; with
--rounds N the three kernels take turns N times and the medians are reported. vLLM's kernel
runs in its own venv (perf/peers/vllm_attention.py; `make perf-peers` installs it) on the same
shapes, timed without its KV-cache write; it is left out where that venv is absent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess

import torch
from harness import RESULTS, best_seconds, fmt, markdown_table, new_record, write_report

from qwen_embed import native
from qwen_embed.attention import AttentionSpec, create_backend
from qwen_embed.cpu import keep_freed_memory
from qwen_embed.segments import AttentionLayout

from bench_peers import REPO

VLLM_PYTHON = REPO / ".cache" / "peers" / "vllm" / "venv" / "bin" / "python"
HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
TOKENS = 8192


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


def ratios(rounds: list[dict], key: str) -> list[float] | None:
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


def measure(length: int, dtype: str, reps: int, rounds: int) -> dict:
    torch_dtype = getattr(torch, dtype)
    lens, q, k, v, cu = attention_inputs(length, TOKENS, torch_dtype)
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

    vs = {key: ratios(per_round, key) for key in ("torch", "vllm", "vllm_write")}
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 256, 1024, 4096, 8192])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1, help="turns of native, torch and vLLM")
    p.add_argument("--isa", default="", help="run the native kernels of this instruction set")
    p.add_argument("--out", default=str(RESULTS / "attention"))
    args = p.parse_args()
    if native.isa() is None:
        raise SystemExit("the native kernels are not built: make setup")
    native.select(args.isa)
    keep_freed_memory()  # as the encoder runs: no fresh pages for every call's buffers
    rows = [
        measure(n, dtype, args.reps, args.rounds) for dtype in args.dtypes for n in args.lengths
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


if __name__ == "__main__":
    main()
