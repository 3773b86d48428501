"""The native operators of this checkout against another revision's, in one process, in pairs.

    python bench_native_ab.py [--base HEAD] [--ops int8 bf16 attention] [--pairs 15]

Timings taken in separate processes or minutes apart move more on a drifting host than most
kernel changes do. Here the base revision's csrc/ is built (with this checkout's compiler flags)
into a second library (in .cache/native-ab/<commit>/) whose operators register as
`qwen_embed_base`, both libraries are loaded, and each measurement is a pair of calls on the
same operands, one per build, the order alternating. The report gives, per operator and shape,
the median of the pairs' time ratios (checkout / base) with their quartiles, the base's median
time, and whether both builds gave the same bits. Shapes: the 4-layer model's linear layers at
--rows rows (int8: the int8 route's q|k, gate|up and down; bf16: q|k|v, o, gate|up, down) and
the attention of ~--rows tokens of texts of 128, 1,024 and 8,192 tokens, in bf16.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from bench_attention import HEAD_DIM, attention_inputs
from bench_gemm_rows import SHAPES as BF16_SHAPES
from bench_int8_blocking import SHAPES as INT8_SHAPES
from harness import RESULTS, markdown_table, new_record, taking_turns, write_report

from qwen_embed import cpu, int8, native
from qwen_embed.native import build

from bench_peers import REPO

CSRC = "plugins/qwen_embed/native/csrc"
BASE_OPS = "qwen_embed_base"
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
        ops = src / "ops.cpp"
        ops.write_text(
            ops.read_text()
            .replace("TORCH_LIBRARY(qwen_embed,", f"TORCH_LIBRARY({BASE_OPS},")
            .replace("TORCH_LIBRARY_IMPL(qwen_embed,", f"TORCH_LIBRARY_IMPL({BASE_OPS},")
        )
        out.mkdir(parents=True, exist_ok=True)
        saved = build.CSRC, build.BUILD, build.LIBRARY, build.STAMP, build.ISA_FLAGS
        build.CSRC, build.BUILD, build.LIBRARY, build.STAMP = src, out, library, out / "stamp"
        build.ISA_FLAGS = {name: f for name, f in saved[4].items() if (src / name).exists()}
        try:
            build.build()
        finally:
            build.CSRC, build.BUILD, build.LIBRARY, build.STAMP, build.ISA_FLAGS = saved
    return library


def int8_cases(rows: int) -> dict[str, Callable]:
    cases = {}
    for name, (n, k) in INT8_SHAPES.items():
        packed, offset, scale = int8.pack(*int8.quantize_rows(torch.randn(n, k)))
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        rotation = int8.rotation_block(k)
        cases[f"int8_linear {name} {k} -> {n}"] = (
            lambda ops, x=x, p=packed, o=offset, s=scale, n=n, r=rotation: ops.int8_linear(
                x, p, o, s, None, n, r
            )
        )
    return cases


def bf16_cases(rows: int) -> dict[str, Callable]:
    cases = {}
    for name, (n, k) in BF16_SHAPES.items():
        packed = native.pack_panels(torch.randn(n, k, dtype=torch.bfloat16), 2)
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        cases[f"bf16_linear {name} {k} -> {n}"] = lambda ops, x=x, p=packed, n=n: ops.bf16_linear(
            x, p, None, n
        )
    return cases


def attention_cases(rows: int) -> dict[str, Callable]:
    cases = {}
    for length in TEXT_TOKENS:
        lens, q, k, v, cu = attention_inputs(length, rows, torch.bfloat16)
        cases[f"varlen_attention {len(lens)} x {length}"] = lambda ops, q=q, k=k, v=v, cu=cu: (
            ops.varlen_attention(q, k, v, cu, cu, True, HEAD_DIM**-0.5)
        )
    return cases


CASES = {"int8": int8_cases, "bf16": bf16_cases, "attention": attention_cases}


def pair_ratios(call: Callable, pairs: int) -> tuple[list[float], list[float]]:
    """`pairs` turns of the base's call and the checkout's: checkout / base time per turn, and
    the base's times."""
    base, checkout = getattr(torch.ops, BASE_OPS), torch.ops.qwen_embed
    seconds = taking_turns({"base": lambda: call(base), "checkout": lambda: call(checkout)}, pairs)
    ratios = [c / b for c, b in zip(seconds["checkout"], seconds["base"], strict=True)]
    return ratios, seconds["base"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="HEAD", help="git revision to compare against")
    p.add_argument("--ops", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--rows", type=int, default=12800, help="rows per GEMM, tokens per attention")
    p.add_argument("--pairs", type=int, default=15)
    p.add_argument("--out", default=str(RESULTS / "native_ab"))
    args = p.parse_args()
    if native.isa() is None:
        raise SystemExit("the native kernels are not built: make setup")
    cpu.keep_freed_memory()  # as the engine does: outputs reuse freed heap, no page faults
    torch.ops.load_library(str(base_library(args.base)))
    getattr(torch.ops, BASE_OPS).select_isa(native.isa())
    rows = []
    for group in args.ops:
        for name, call in CASES[group](args.rows).items():
            same = torch.equal(call(getattr(torch.ops, BASE_OPS)), call(torch.ops.qwen_embed))
            ratios, base_seconds = pair_ratios(call, args.pairs)
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            row = {
                "op": name,
                "ratio": statistics.median(ratios),
                "q1": q1,
                "q3": q3,
                "base_ms": statistics.median(base_seconds) * 1e3,
                "same_bits": same,
            }
            rows.append(row)
            print(row, flush=True)
    header = ["operator, shape", "checkout / base time (median of pairs)", "quartiles"]
    table = markdown_table(
        [*header, "base ms", "same bits"],
        [
            [r["op"], f"{r['ratio']:.3f}", f"{r['q1']:.3f}-{r['q3']:.3f}", f"{r['base_ms']:.1f}"]
            + ["yes" if r["same_bits"] else "no"]
            for r in rows
        ],
    )
    record = new_record(base=args.base, isa=native.isa(), rows_per_call=args.rows, rows=rows)
    notes = [
        f"base: {args.base}; native kernels {native.isa()}, {torch.get_num_threads()} threads; "
        f"{args.pairs} pairs of calls per shape, one per build, the order alternating"
    ]
    print(
        write_report(
            args.out, record, "Native operators: this checkout vs a base revision", notes, table
        )
    )


if __name__ == "__main__":
    main()
