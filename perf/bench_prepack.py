"""Linear weights packed for oneDNN at load (onednn.py) vs plain F.linear, on one encoder.

    python bench_prepack.py [--model-dir .cache/demo-model] [--dtypes bfloat16 float32]

Per dtype: one encoder loaded with packed weights, which also keeps its plain weights for the
comparison; the two take turns (perf/workload.alternate: the machine's drift falls on both) on
three workloads: 64 mixed documents (80% 16-64 tokens, 20% 256-1024) as one call, and
Qwen3-Embedding queries (default instruction) 8 and 1 per call, prefix reuse off. oneDNN's
primitive cache is bounded as the launcher runs Triton (row_plans.PRIMITIVE_CACHE_CAPACITY) unless
the environment sets it. Reports the best tokens/s of each, their ratio and the max abs
difference of the vectors.

Then the planned row counts of the packed GEMMs (row_plans.planned_rows): the present ladder of
steps vs one 16-row step, on one packed encoder with prefix reuse on (as served), over the same
128 queries cut into forwards of 1-16 queries: many row counts, as Triton's batches bring.
"""

from __future__ import annotations

import os

from qwen_embed.row_plans import PRIMITIVE_CACHE_CAPACITY  # no torch

# Read when oneDNN starts, so before torch: the launcher's value.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(PRIMITIVE_CACHE_CAPACITY))

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from bench_prefix import make_queries  # noqa: E402
from harness import RESULTS, new_record, write_report  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from qwen_embed import Encoder, row_plans  # noqa: E402
from qwen_embed.layers import _Linear  # noqa: E402

from bench_peers import REPO, ensure_model  # noqa: E402
from workload import alternate, alternate_forwards, make_texts  # noqa: E402


def switch(linears, packed, plain, on: bool):
    def use():
        for m, k, w in zip(linears, packed, plain, strict=True):
            m.kernel, m.weight = (k, None) if on else (None, w)

    return use


ONE_STEP = ((row_plans.PADDED_ROWS_MAX, 16),)  # what the ladder replaced


def row_plans(
    model_dir: Path, dtype: str, queries: list[list[int]], sizes: list[int], rounds: int
) -> list[dict]:
    """Ladder vs one 16-row step, taking turns; best ms per forward of each over `rounds`
    (the first turn also plans the row counts it meets)."""
    ladder, rows = row_plans.ROW_STEPS, []
    variants = {
        "ladder": lambda: setattr(row_plans, "ROW_STEPS", ladder),
        "16-row step": lambda: setattr(row_plans, "ROW_STEPS", ONE_STEP),
    }
    try:
        with Encoder.from_pretrained(model_dir, dtype=dtype) as enc:
            for size in sizes:
                chunks = [queries[i : i + size] for i in range(0, len(queries) - size + 1, size)]
                best = alternate_forwards(enc, chunks, variants, rounds)
                rows.append(
                    {
                        "dtype": dtype,
                        "queries_per_forward": size,
                        "ladder_ms": best["ladder"] * 1e3,
                        "step16_ms": best["16-row step"] * 1e3,
                        "speedup": best["16-row step"] / best["ladder"],
                    }
                )
                print(rows[-1], flush=True)
    finally:
        row_plans.ROW_STEPS = ladder
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "demo-model"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument(
        "--forward-sizes",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8, 16],
        help="queries per forward of the row-plan comparison",
    )
    p.add_argument("--out", default=str(RESULTS / "prepack"))
    args = p.parse_args()
    model_dir = ensure_model(Path(args.model_dir).resolve(), 3)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    docs = [e.ids for e in tok.encode_batch(make_texts(64, 0))]
    queries = [e.ids for e in tok.encode_batch(make_queries(64))]
    workloads = [
        ("64 documents per call", docs, 1),
        ("8 queries per call", queries[:8], 6),
        ("1 query per call", queries[:1], 20),
    ]
    rows = []
    for dtype in args.dtypes:
        with Encoder.from_pretrained(
            model_dir, dtype=dtype, prefix_reuse=False, prepack_weights=True
        ) as enc:
            linears = [m for m in enc.model.modules() if isinstance(m, _Linear)]
            packed = [m.kernel for m in linears]
            # The plain weights back from the packed ones (oneDNN's layout -> dense).
            plain = [torch.nn.Parameter(k.packed.to_dense(), requires_grad=False) for k in packed]

            for name, ids, repeats in workloads:
                variants = {
                    "packed": switch(linears, packed, plain, True),
                    "plain": switch(linears, packed, plain, False),
                }
                runs = alternate(enc, ids, variants, repeats, rounds=args.rounds)
                on, off = runs["packed"], runs["plain"]
                rows.append(
                    {
                        "dtype": dtype,
                        "workload": name,
                        "tokens": sum(map(len, ids)),
                        "packed_tok_s": on["tok_s"],
                        "plain_tok_s": off["tok_s"],
                        "ratio": on["tok_s"] / off["tok_s"],
                        "max_abs": float(abs(on["vectors"] - off["vectors"]).max()),
                    }
                )
                print(rows[-1], flush=True)
    table = [
        "| dtype | workload | tokens/s packed | plain | packed / plain | max abs diff |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        table.append(
            f"| {r['dtype']} | {r['workload']} | {r['packed_tok_s']:.0f} | "
            f"{r['plain_tok_s']:.0f} | {r['ratio']:.3f} | "
            f"{r['max_abs']:.1e} |"
        )
    many = [e.ids for e in tok.encode_batch(make_queries(128))]
    plans = [
        r
        for dtype in args.dtypes
        for r in row_plans(model_dir, dtype, many, args.forward_sizes, args.rounds)
    ]
    table += [
        "",
        "Planned row counts (packed weights, prefix reuse on, 128 queries in forwards of n):",
        "",
        "| dtype | queries per forward | ms per forward, ladder | one 16-row step | speed-up |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in plans:
        table.append(
            f"| {r['dtype']} | {r['queries_per_forward']} | {r['ladder_ms']:.1f} | "
            f"{r['step16_ms']:.1f} | {r['speedup']:.3f} |"
        )
    note = (
        f"model: {model_dir.name}; ONEDNN_PRIMITIVE_CACHE_CAPACITY="
        f"{os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY']}; best of {args.rounds} alternating "
        "rounds per variant, one encoder per dtype and comparison"
    )
    write_report(
        args.out,
        new_record(rows=rows, row_plans=plans),
        "oneDNN-packed linear weights vs plain",
        [note],
        table,
    )


if __name__ == "__main__":
    main()
