"""How batch_invariant's bf16 GEMM is best cut on this CPU: blockings of the native bf16
operator against oneDNN's packed GEMM, per GEMM shape and row count.

    python bench_bf16_blocking.py [--rows 20 128 1024 16384] [--rounds 3]

The operator (ops.cpp bf16_linear) sums each row over the whole K per task and panel (our AMX
tile kernel for panels of 64 on AMX CPUs, oneDNN's micro-kernel otherwise), so every blocking
gives a row the same bits (checked here against the default for each): the weights' panel
(channels per call, 64 as shipped), rows and channels per task, and whether
consecutive tasks share channels or rows. Per shape (Qwen3-Embedding-0.6B's widths) and row
count: every blocking once (best of 3), then the 4 fastest, the default and oneDNN taking
turns for --rounds rounds (median of each's best of 2). The default is the operator's own
(64 rows x 512 channels, channels outermost, panels of 64). bench_int8_blocking.py does the
same for the int8 operator.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable

import torch
from bench_gemm_rows import SHAPES
from harness import RESULTS, best_seconds, markdown_table, new_record, write_report

from qwen_embed import native
from qwen_embed.cpu import keep_freed_memory
from qwen_embed.onednn import PackedWeight, brgemm_runs

PANELS = (64, 128, 256, 512)


def schema_blocking(op) -> tuple:
    """(task rows, task channels, channels outermost): an operator's defaults."""
    args = {a.name: a.default_value for a in op.default._schema.arguments}
    return (args["task_rows"], args["task_channels"], args["channels_outer"])


def default_blocking() -> tuple:
    """(panel, task rows, task channels, channels outermost) as the engine runs the operator:
    onednn.NativeBf16Weight's panel and the operator's own defaults."""
    return (native.PANEL, *schema_blocking(torch.ops.qwen_embed.bf16_linear))


def blockings() -> list[tuple]:
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


def measure(name: str, m: int, rounds: int) -> dict:
    n, k = SHAPES[name]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    packs = {panel: native.pack_panels(w, 2, panel) for panel in PANELS}
    onednn = PackedWeight(w)

    def call(b: tuple):
        panel, rows, channels, channels_outer = b
        return lambda: torch.ops.qwen_embed.bf16_linear(
            x, packs[panel], None, n, rows, channels, channels_outer
        )

    shape = f"{name} {n}x{k}"
    return compare(shape, m, call, blockings(), default_blocking(), lambda: onednn(x), rounds)


def one_blocking(rows: list[dict], m: int, default: str) -> str:
    """The blocking fastest over all shapes at `m` rows (screening times summed)."""
    at_m = [r for r in rows if r["rows"] == m]
    total = {b: sum(r["screened"][b] for r in at_m) for b in at_m[0]["screened"]}
    best = min(total, key=total.get)
    return (
        f"{m} rows, all shapes: fastest one blocking {best}, {total[best]:.2f} ms screened "
        f"against the default's {total[default]:.2f} ({total[best] / total[default]:.2f}x)"
    )


def report(args, rows: list[dict], title: str, baseline: str, default: str) -> None:
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


def arguments(doc: str, report_name: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[20, 128, 1024, 16384])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / report_name))
    return p.parse_args()


def main() -> None:
    args = arguments(__doc__, "bf16_blocking")
    keep_freed_memory()  # as the engine does: no page faults in the timings
    if not brgemm_runs():
        raise SystemExit("the native bf16 operator does not run here (AVX-512 and oneDNN)")
    rows = [measure(name, m, args.rounds) for m in args.rows for name in SHAPES]
    title = "batch_invariant's bf16 GEMM: blockings"
    report(args, rows, title, "oneDNN", label(default_blocking()))


if __name__ == "__main__":
    main()
