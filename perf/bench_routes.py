"""The engine in process on one model, two or more ways of running it taking turns on the same
texts: what a route choice (packed weights, the batch-invariant GEMM, int8 layouts, the
attention operator, LoRA adapters per request or merged) is worth end to end, the engine against
its GEMM bound, long texts, and any encoder setting's values on the CPU or a GPU.

    python bench_routes.py prepack [--dtypes bfloat16 float32]
    python bench_routes.py bf16_gemm [--rounds 4]
    python bench_routes.py int8 [--rounds 3] [--quantization fp8]
    python bench_routes.py gemm_bound [--quantization none|int8] [--pairs 15]
    python bench_routes.py lengths [--lengths 128 512 2048 8192]
    python bench_routes.py long [--lengths 8192 16384 32768]
    python bench_routes.py adapters [--adapters 3] [--rank 16]
    python bench_routes.py settings --variant "" --variant cuda_graph_tokens=16384 [--device cuda]

Each subcommand writes its own report (results/<subcommand>.md and .json by default); `python
bench_routes.py SUBCOMMAND --help` says what it measures and how. The oneDNN primitive cache
is sized as the launcher sizes an encoder's, before torch loads.
"""

from __future__ import annotations

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from harness import (  # noqa: E402
    REPO,
    best_seconds,
    cosines,
    ensure_model,
    markdown_table,
    new_record,
    round_ratios,
    run_subcommands,
    status_mib,
    taking_turns,
    write_report,
)
from safetensors import safe_open  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from qwen_embed import Encoder, avx2_gemm, lora, native, row_plans  # noqa: E402
from qwen_embed import int8 as int8_route  # noqa: E402
from qwen_embed.attention import create_backend  # noqa: E402
from qwen_embed.avx2_gemm import Avx2F32Weight  # noqa: E402
from qwen_embed.engine import FLOAT_GEMMS, TORCH_DTYPES  # noqa: E402
from qwen_embed.layers import _Linear, linear_weight_dtype  # noqa: E402
from qwen_embed.onednn import PackedWeight, brgemm_runs  # noqa: E402
from qwen_embed.row_plans import PRIMITIVE_CACHE_CAPACITY  # no torch
from qwen_embed.settings import EncoderSettings  # noqa: E402
from qwen_embed_deploy.demo import ENDOFTEXT_ID, build_demo_adapter  # noqa: E402

from bench_engine import linear_bound, qwen3_5_replica, workload  # noqa: E402
from bench_peers import linear_shapes  # noqa: E402
from workload import alternate, alternate_forwards, make_queries, make_texts  # noqa: E402

# ---------------------------------------------------------------- prepack

PREPACK_DOC = """\
The float route's GEMMs on one encoder: weights packed for oneDNN at load (onednn.py) vs plain
F.linear, and, where it runs (fp32 weights, a CPU with AVX2), the native AVX2 operator on its own
packed weights (avx2_gemm.py, the default fp32 GEMM on CPUs with AVX2 and no AVX-512).

    python bench_routes.py prepack [--model-dir .cache/demo-model] [--dtypes bfloat16 float32]

Per dtype: one encoder loaded with packed weights, which also keeps its plain weights for the
comparison; the GEMMs take turns (perf/workload.alternate: the machine's drift falls on all) on
three workloads: 64 mixed documents (80% 16-64 tokens, 20% 256-1024) as one call, and
Qwen3-Embedding queries (default instruction) 8 and 1 per call, prefix reuse off. oneDNN's
primitive cache is bounded as the launcher runs Triton (row_plans.PRIMITIVE_CACHE_CAPACITY) unless
the environment sets it. Reports the best tokens/s of each, their ratios and the max abs
difference of the vectors against the packed ones.

Then the planned row counts of the packed GEMMs (row_plans.planned_rows): the present ladder of
steps vs one 16-row step, on one packed encoder with prefix reuse on (as served), over the same
128 queries cut into forwards of 1-16 queries: many row counts, as Triton's batches bring.
"""


# Read when oneDNN starts, so before torch: the launcher's value.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(PRIMITIVE_CACHE_CAPACITY))


def switch(linears, kernels, plain):
    """Sets each linear layer's kernel (None: F.linear on its plain weight)."""

    def use():
        for m, k, w in zip(linears, kernels, plain, strict=True):
            m.kernel, m.weight = (k, None) if k is not None else (None, w)

    return use


ONE_STEP = ((row_plans.PADDED_ROWS_MAX, 16),)  # what the ladder replaced


def planned_rows_turns(
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


def prepack_arguments(p: argparse.ArgumentParser) -> None:
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


def prepack(args: argparse.Namespace) -> None:
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

            # the native AVX2 operator where it runs on these weights (fp32-held)
            natives = (
                [Avx2F32Weight(w) for w in plain]
                if avx2_gemm.runs() and plain[0].dtype == torch.float32
                else None
            )
            for name, ids, repeats in workloads:
                variants = {
                    "packed": switch(linears, packed, plain),
                    "plain": switch(linears, [None] * len(plain), plain),
                }
                if natives:
                    variants["native"] = switch(linears, natives, plain)
                runs = alternate(enc, ids, variants, repeats, rounds=args.rounds)
                on, off = runs["packed"], runs["plain"]
                native_run = runs.get("native")
                rows.append(
                    {
                        "dtype": dtype,
                        "workload": name,
                        "tokens": sum(map(len, ids)),
                        "packed_tok_s": on["tok_s"],
                        "plain_tok_s": off["tok_s"],
                        "native_tok_s": native_run and native_run["tok_s"],
                        "ratio": on["tok_s"] / off["tok_s"],
                        "max_abs": float(abs(on["vectors"] - off["vectors"]).max()),
                        "native_max_abs": native_run
                        and float(abs(native_run["vectors"] - on["vectors"]).max()),
                    }
                )
                print(rows[-1], flush=True)
    table = [
        "| dtype | workload | tokens/s packed | plain | native AVX2 | packed / plain "
        "| native / packed | max abs diff plain, native |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        native_cells = (
            (f"{r['native_tok_s']:.0f}", f"{r['native_tok_s'] / r['packed_tok_s']:.3f}")
            if r["native_tok_s"]
            else ("-", "-")
        )
        native_diff = f", {r['native_max_abs']:.1e}" if r["native_tok_s"] else ""
        table.append(
            f"| {r['dtype']} | {r['workload']} | {r['packed_tok_s']:.0f} | "
            f"{r['plain_tok_s']:.0f} | {native_cells[0]} | {r['ratio']:.3f} | "
            f"{native_cells[1]} | {r['max_abs']:.1e}{native_diff} |"
        )
    many = [e.ids for e in tok.encode_batch(make_queries(128))]
    plans = [
        r
        for dtype in args.dtypes
        for r in planned_rows_turns(model_dir, dtype, many, args.forward_sizes, args.rounds)
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
        "The float route's GEMMs: oneDNN-packed, plain F.linear, native AVX2",
        [note],
        table,
    )


# ---------------------------------------------------------------- bf16_gemm

BF16_GEMM_DOC = """\
What batch_invariant "on" costs: the bf16 route's GEMM on the native operator
(onednn.NativeBf16Weight, a row the same at any batch; the default wherever it runs) against
oneDNN's packed GEMM ("off"), end to end.

    python bench_routes.py bf16_gemm [--model-dir .cache/bench-model-4l] [--rounds 4]

In process, dtype bfloat16, one encoder each, taking turns for `rounds` rounds: 64 mixed
documents (workload.make_texts) in one call, and 16 short texts one call each; best tokens/s
of each and its ratio to off round by round. Then the same-vector check of each: the
16 texts alone against the same texts among the documents, bitwise (texts differing, max-abs).
"""


GEMMS = {
    "off": "oneDNN packed (batch_invariant off)",
    "on": "native operator (batch_invariant on; the default)",
}


def bf16_gemm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-model-4l"))
    p.add_argument("--rounds", type=int, default=4)


def bf16_gemm(args: argparse.Namespace) -> None:
    if not brgemm_runs():
        raise SystemExit("the native bf16 operator does not run here (AVX-512 and oneDNN)")
    model_dir = ensure_model(Path(args.model_dir).resolve(), 4)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    docs = [e.ids for e in tok.encode_batch(make_texts(64, 0))]
    shorts = [e.ids for e in tok.encode_batch(make_texts(16, 1))]
    tokens, short_tokens = sum(map(len, docs)), sum(map(len, shorts))
    with contextlib.ExitStack() as stack:
        encoders = {
            name: stack.enter_context(
                Encoder.from_pretrained(model_dir, dtype="bfloat16", batch_invariant=switch)
            )
            for switch, name in GEMMS.items()
        }
        # tokens/s per round: [documents, short texts]; the GEMMs take turns within a round
        rounds = {name: [] for name in encoders}
        for _ in range(args.rounds):
            for name, enc in encoders.items():
                enc.embed(docs[:2])
                began = time.perf_counter()
                enc.embed(docs)
                docs_rate = tokens / (time.perf_counter() - began)
                began = time.perf_counter()
                for s in shorts:
                    enc.embed([s])
                rounds[name].append((docs_rate, short_tokens / (time.perf_counter() - began)))
        rows = []
        for name, enc in encoders.items():
            alone = np.stack([enc.embed([s])[0] for s in shorts])
            among = enc.embed(shorts + docs)[: len(shorts)]
            differ = int((alone != among).any(axis=1).sum())
            rows.append(
                {
                    "gemm": name,
                    "docs_tok_s": max(r[0] for r in rounds[name]),
                    "short_tok_s": max(r[1] for r in rounds[name]),
                    "rounds_tok_s": rounds[name],
                    "rows_differing": differ,
                    "max_abs": float(np.abs(alone - among).max()),
                }
            )
            print(rows[-1], flush=True)
    base = rows[0]

    def ratios(r: dict, which: int) -> str:
        """This GEMM's tokens/s over off's, round by round: their median and range."""
        per_round = round_ratios(r["rounds_tok_s"], base["rounds_tok_s"], which)
        low, high = min(per_round), max(per_round)
        return f"{statistics.median(per_round):.2f}x ({low:.2f}-{high:.2f}x)"

    table = markdown_table(
        [
            "GEMM",
            "64 documents, best tokens/s",
            "per round x off: median (range)",
            "16 short texts, one call each, best tokens/s",
            "per round x off: median (range)",
            "texts alone differing from among documents (of 16)",
            "max-abs",
        ],
        [
            [
                r["gemm"],
                f"{r['docs_tok_s']:.0f}",
                ratios(r, 0),
                f"{r['short_tok_s']:.0f}",
                ratios(r, 1),
                r["rows_differing"],
                f"{r['max_abs']:.3g}",
            ]
            for r in rows
        ],
    )
    notes = [
        f"{model_dir.name}, bfloat16; 64 mixed documents ({tokens} tokens) per call and 16 short "
        f"texts ({short_tokens} tokens) one call each; {args.rounds} rounds, the GEMMs taking "
        "turns in each"
    ]
    record = new_record(model_dir=str(model_dir), rounds=args.rounds, rows=rows)
    print(write_report(args.out, record, "batch_invariant: the bf16 GEMM it runs", notes, table))


# ---------------------------------------------------------------- int8

INT8_DOC = """\
The int8 route's layout: which linear layers run in int8, and whether their rows are rotated.

    python bench_routes.py int8 [--model-dir .cache/bench-model-4l] [--rounds 3] [--qwen3-5]

In process, dtype auto, one encoder per layout (the int8 route loaded with `int8.FLOAT_SHARDS`,
`int8.FLOAT_LAYERS` and `int8.rotation_block` as the layout names them), beside the float route:
- the route as it is: q|k, gate|up and down in int8, rows rotated (v and o in floats);
- the same layers without the rotation;
- q|k|v and gate|up in int8, not rotated (the layout before down moved to int8);
- every projection but o in int8, rotated.
The encoders take turns for `rounds` rounds over 64 mixed documents (workload.make_texts) in one
call each: best tokens/s. Accuracy: min and mean cosine against the fp32 float route on those
documents and on 54 texts of random ids (the tests' measure), on a model with random weights.
`--quantization fp8`: the fp8 route's layouts instead (it quantises the layers int8 does, never
rotated; on CPU its products run on torch's fp8 GEMM, so its tokens/s say nothing of a GPU's):
the route (v and o in bf16), every projection in fp8, and down in bf16 as well as v and o.
`--qwen3-5`: Qwen3.5's replica (bench_engine.py --qwen3-5) and its hybrid stack's layouts: the
route (the linear attention's v|z in int8; its b|a|q|k and output projection in floats), its
q|k in int8 too, full attention's v in int8 too, the linear attention's output projection in
int8 too.
"""


NOT_ROTATED = {"rotation_block": lambda in_features: 1}


LAYOUTS = {
    "q|k, gate|up, down; rotated (the route)": {"FLOAT_SHARDS": int8_route.FLOAT_SHARDS},
    "q|k, gate|up, down; not rotated": NOT_ROTATED,
    "q|k|v, gate|up; not rotated": {
        "FLOAT_SHARDS": {},
        "FLOAT_LAYERS": ("mlp.down_proj", "self_attn.o_proj"),
        **NOT_ROTATED,
    },
    "q|k|v, gate|up, down; rotated": {"FLOAT_SHARDS": {}, "FLOAT_LAYERS": ("self_attn.o_proj",)},
}


# Qwen3.5's hybrid stack (`--qwen3-5`: bench_engine.qwen3_5_replica):
# its linear-attention layers' in_proj (b|a|q|k|v|z) cut around the shards kept in floats.
HYBRID_LAYOUTS = {
    "linear attention's v|z, full attention's q|k, gate|up, down (the route)": {
        "FLOAT_SHARDS": int8_route.FLOAT_SHARDS
    },
    "linear attention's q|k in int8 too": {
        "FLOAT_SHARDS": {"qkv_proj": ("v",), "in_proj": ("b", "a")},
        "FLOAT_LAYERS": (*int8_route.FLOAT_LAYERS, "linear_attn.ba_proj"),
    },
    "full attention's v in int8 too": {"FLOAT_SHARDS": {"in_proj": ("b", "a", "q", "k")}},
    "linear attention's out_proj in int8 too": {
        "FLOAT_LAYERS": ("self_attn.o_proj", "self_attn.v_proj", "linear_attn.baqk_proj")
    },
}


FP8_LAYOUTS = {
    "q|k, gate|up, down (the route)": {"FLOAT_SHARDS": int8_route.FLOAT_SHARDS},
    "every projection": {"FLOAT_SHARDS": {}, "FLOAT_LAYERS": ()},
    "q|k, gate|up": {"FLOAT_LAYERS": (*int8_route.FLOAT_LAYERS, "mlp.down_proj")},
}


FLOAT = "float route (not quantised)"


def random_texts(vocab_size: int, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [5, 17, 40, 90, 128, 200, 300, 511, 33, 64, 7, 250, 1000, 3]
    lengths += [3 + (i * 53) % 700 for i in range(40)]
    return [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]


def int8_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=None, help="default: .cache/bench-model-4l")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quantization", default="int8", choices=["int8", "fp8"])
    p.add_argument(
        "--qwen3-5",
        action="store_true",
        help="Qwen3.5's replica (bench_engine.py --qwen3-5; default .cache/bench-qwen3_5) "
        "and the hybrid stack's layouts",
    )


def int8_layouts(args: argparse.Namespace) -> None:
    if args.qwen3_5 and args.quantization == "fp8":
        raise SystemExit("--qwen3-5: the fp8 route does not take Qwen3.5 (route.py)")
    if args.qwen3_5:
        model_dir = qwen3_5_replica(Path(args.model_dir or REPO / ".cache" / "bench-qwen3_5"))
    else:
        model_dir = ensure_model(Path(args.model_dir or REPO / ".cache" / "bench-model-4l"), 4)
    model_dir = model_dir.resolve()
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    docs = [e.ids for e in tok.encode_batch(make_texts(64, 0))]
    randoms = random_texts(tok.get_vocab_size())
    tokens = sum(map(len, docs))

    with contextlib.ExitStack() as stack:
        fp32 = stack.enter_context(Encoder.from_pretrained(model_dir, dtype="float32"))
        reference = {"documents": fp32.embed(docs), "random ids": fp32.embed(randoms)}
        encoders = {FLOAT: stack.enter_context(Encoder.from_pretrained(model_dir))}
        layouts = FP8_LAYOUTS if args.quantization == "fp8" else LAYOUTS
        layouts = HYBRID_LAYOUTS if args.qwen3_5 else layouts
        for name, changes in layouts.items():
            with mock.patch.multiple(int8_route, **changes):
                encoders[name] = stack.enter_context(
                    Encoder.from_pretrained(model_dir, quantization=args.quantization)
                )
        best = dict.fromkeys(encoders, 0.0)
        for _ in range(args.rounds):
            for name, enc in encoders.items():
                enc.embed(docs[:2])
                began = time.perf_counter()
                enc.embed(docs)
                best[name] = max(best[name], tokens / (time.perf_counter() - began))
        rows = []
        for name, enc in encoders.items():
            row = {"layout": name, "tok_s": best[name], "x_float": best[name] / best[FLOAT]}
            for texts, ids in (("documents", docs), ("random ids", randoms)):
                c = cosines(enc.embed(ids), reference[texts])
                row[f"{texts} min"], row[f"{texts} mean"] = float(c.min()), float(c.mean())
            rows.append(row)
            print(row, flush=True)
        dtype = encoders[FLOAT].route.dtype

    table = [
        "| layout | tokens/s | x float route | min / mean cosine, documents "
        "| min / mean cosine, random ids |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        layout = r["layout"].replace("|", "\\|")  # a markdown cell
        table.append(
            f"| {layout} | {r['tok_s']:.0f} | {r['x_float']:.2f} | "
            f"{r['documents min']:.5f} / {r['documents mean']:.5f} | "
            f"{r['random ids min']:.5f} / {r['random ids mean']:.5f} |"
        )
    record = new_record(
        model_dir=str(model_dir),
        dtype=dtype,
        quantization=args.quantization,
        rounds=args.rounds,
        tokens=tokens,
        rows=rows,
    )
    notes = [
        f"{model_dir.name}, dtype {dtype}"
        + ("; the fp8 layouts around bf16" if args.quantization == "fp8" else "")
        + f"; 64 mixed documents ({tokens} tokens) per call, "
        f"best of {args.rounds} turns; cosines against fp32 (random weights: accuracy on "
        "trained checkpoints is not measured here)"
    ]
    title = f"{args.quantization} layouts ({args.quantization}.py)"
    print(write_report(args.out, record, title, notes, table))


# ---------------------------------------------------------------- gemm_bound

GEMM_BOUND_DOC = """\
The engine against its GEMM bound, in one process, taking turns.

    python bench_routes.py gemm_bound [--model-dir .cache/bench-model-4l] [--quantization none]
                               [--pairs 15]

bench_peers.py divides the engine's tokens/s by a GEMM probe run minutes apart; on a host whose
speed drifts 2x within minutes that ratio is mostly the drift. Here each pair times the engine's
embed() of 64 mixed documents (workload.make_texts) and, right beside it, the model's linear
layers alone on as many rows: every layer's weights at their shapes, in the route's dtype,
through the route's float GEMM (engine.FLOAT_GEMMS: our AVX2 operator for fp32 layers on CPUs
with AVX2 and no AVX-512, else oneDNN's packed GEMM) (`--quantization int8`: the int8 route's
quantised layers through int8.Int8Weight, its float layers on that GEMM). The order alternates.
The fraction is the layers' time over the engine's, the median of the pairs with its quartiles.
The bound counts every layer whole, as bench_peers' does, although the engine computes only the
pooled rows past the last layer's keys and values.
"""


def linear_layers(
    config: dict, rows: int, dtype: torch.dtype, quantization: str, float_kernel
) -> list:
    """One layer's matmuls as the route runs them (its float layers on `float_kernel`), each
    with `rows` random input rows."""
    layers = []
    for name, (n, k) in linear_shapes(config).items():
        w = torch.randn(n, k, dtype=dtype).to(linear_weight_dtype(dtype, torch.device("cpu")))
        quantised = quantization == "int8" and int8_route.quantizes(name)
        layers.append(
            (
                int8_route.Int8Weight(w) if quantised else float_kernel(w),
                torch.randn(rows, k).to(dtype),
            )
        )
    return layers


def gemm_bound_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-model-4l"))
    p.add_argument("--quantization", default="none", choices=["none", "int8"])
    p.add_argument("--texts", type=int, default=64)
    p.add_argument("--pairs", type=int, default=15)


def gemm_bound(args: argparse.Namespace) -> None:
    model_dir = ensure_model(Path(args.model_dir).resolve(), 4)
    config = json.loads((model_dir / "config.json").read_text())
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    docs = [e.ids for e in tok.encode_batch(make_texts(args.texts, 0))]
    tokens = sum(map(len, docs))

    with Encoder.from_pretrained(model_dir, quantization=args.quantization) as enc:
        dtype = TORCH_DTYPES[enc.route.dtype]
        float_kernel = FLOAT_GEMMS[enc.route.gemm] or PackedWeight
        layers = linear_layers(config, tokens, dtype, args.quantization, float_kernel)

        def gemms() -> None:
            for _ in range(config["num_hidden_layers"]):
                for layer, x in layers:
                    layer(x)

        calls = {"engine": lambda: enc.embed(docs), "linear layers": gemms}
        seconds = taking_turns(calls, args.pairs)
        route = enc.route.describe()

    fractions = [g / e for g, e in zip(seconds["linear layers"], seconds["engine"], strict=True)]
    q1, median, q3 = statistics.quantiles(fractions, n=4)
    record = new_record(
        model_dir=str(model_dir),
        route=route,
        tokens=tokens,
        pairs=args.pairs,
        seconds=seconds,
        fraction={"median": median, "q1": q1, "q3": q3},
    )
    notes = [
        f"{model_dir.name}, {args.texts} mixed documents ({tokens} tokens) per call",
        f"route: {route}",
        f"{args.pairs} pairs taking turns; the fraction per pair is the linear layers' time "
        f"({float_kernel.__name__}; int8: the route's int8 layers) over the engine's",
    ]
    per_s = {name: tokens / statistics.median(t) for name, t in seconds.items()}
    table = markdown_table(
        ["engine tokens/s", "linear layers alone: tokens/s", "fraction (median)", "quartiles"],
        [
            [
                f"{per_s['engine']:.0f}",
                f"{per_s['linear layers']:.0f}",
                f"{median:.2f}",
                f"{q1:.2f} - {q3:.2f}",
            ]
        ],
    )
    print(write_report(args.out, record, "The engine against its GEMM bound", notes, table))


# ---------------------------------------------------------------- lengths

LENGTHS_DOC = """\
Engine tokens/s by text length, the native attention operator vs PyTorch SDPA per segment,
on one encoder in process.

    python bench_routes.py lengths [--model-dir .cache/demo-model] [--lengths 128 512 2048 8192]

Per length L: calls of 8,192 tokens (8,192 / L texts of L tokens; random ids ending with
<|endoftext|>), prefix reuse off; then the text mix of `make perf-peers` (workload.make_texts,
512 texts, one call).  The two backends take turns on the same encoder
(workload.alternate: the machine's drift falls on both). Reports tokens/s, each length's share
of the 128-token figure, and the cosine between the two backends' vectors.
"""


LENGTH_TOKENS = 8192


def use_backend(enc: Encoder, backend):
    def switch():
        enc.model.backend = backend
        for layer in enc.model.layers:
            layer.self_attn.backend = backend

    return switch


def lengths_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "demo-model"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 8192])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--isa", default="", help="run the native kernels of this instruction set")


def lengths(args: argparse.Namespace) -> None:
    if args.isa:
        native.select(args.isa)
    model_dir = ensure_model(Path(args.model_dir).resolve(), 3)
    rng = np.random.default_rng(0)
    rows = []
    with Encoder.from_pretrained(
        model_dir,
        dtype=args.dtype,
        attn_backend="native",
        prefix_reuse=False,
        max_batch_tokens=LENGTH_TOKENS,
    ) as enc:
        if enc.route.attn_backend != "native":
            raise SystemExit(f"the native operator does not run here: {enc.route.describe()}")
        spec = enc.model.backend.spec
        variants = {
            "native": use_backend(enc, enc.model.backend),
            "torch": use_backend(enc, create_backend("torch", spec)),
        }
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        mixed = [e.ids for e in tokenizer.encode_batch(make_texts(512, 0))]
        for length in [*args.lengths, "mixed"]:
            texts = (
                mixed
                if length == "mixed"
                else [
                    rng.integers(0, ENDOFTEXT_ID, size=length - 1).tolist() + [ENDOFTEXT_ID]
                    for _ in range(max(1, LENGTH_TOKENS // length))
                ]
            )
            result = alternate(enc, texts, variants, rounds=args.rounds)
            a, b = result["native"]["vectors"], result["torch"]["vectors"]
            rows.append(
                {
                    "length": length,
                    "native_tok_s": result["native"]["tok_s"],
                    "torch_tok_s": result["torch"]["tok_s"],
                    "cosine": float((a * b).sum(1).min()),
                }
            )
            print(rows[-1], flush=True)
        route = enc.route.describe()
    base = {name: rows[0][f"{name}_tok_s"] for name in ("native", "torch")}

    def share(row: dict, name: str) -> str:
        return "" if row["length"] == "mixed" else f"{row[f'{name}_tok_s'] / base[name]:.2f}"

    record = new_record(route=route, tokens_per_call=LENGTH_TOKENS, rows=rows)
    table = markdown_table(
        [
            "text tokens",
            "native tok/s",
            "share of 128",
            "torch SDPA tok/s",
            "share of 128",
            "native vs torch",
            "min cosine",
        ],
        [
            [
                r["length"],
                f"{r['native_tok_s']:.0f}",
                share(r, "native"),
                f"{r['torch_tok_s']:.0f}",
                share(r, "torch"),
                f"{r['native_tok_s'] / r['torch_tok_s']:.2f}x",
                f"{r['cosine']:.5f}",
            ]
            for r in rows
        ],
    )
    notes = [
        f"route: {route}",
        f"{LENGTH_TOKENS} tokens per call, {torch.get_num_threads()} threads",
        f"native kernels: {native.isa()}",
    ]
    write_report(args.out, record, "Engine tokens/s by text length", notes, table)


# ---------------------------------------------------------------- long

LONG_DOC = """\
Long documents: one text of 8K, 16K and 32K tokens through the engine, tokens/s and peak
memory, each length in a fresh process; then the same text with late chunking.

    python bench_routes.py long [--model-dir .cache/demo-model] [--lengths 8192 16384 32768]
        [--chunk-size 512]

Per length: a process loads the encoder (dtype auto, the default max_batch_tokens of 16,384,
so the longer texts are forwards of their own) and embeds one text of random ids ending with
<|endoftext|>, --reps times after a warm-up call; it reports the best tokens/s and the
process's peak resident memory (VmHWM) after loading and after the forwards. Then the text
with late chunking (`embed_chunks`, chunks of --chunk-size tokens, one read-out row each), timed
the same way, and the peak memory after it. Results: perf/results/long.{md,json}.
"""


def measure_long(model_dir: str, length: int, reps: int, chunk_size: int) -> dict:
    from qwen_embed import ChunkedText, Encoder
    from qwen_embed_deploy.demo import ENDOFTEXT_ID

    rng = np.random.default_rng(length)
    ids = rng.integers(0, ENDOFTEXT_ID, size=length - 1).tolist() + [ENDOFTEXT_ID]
    with Encoder.from_pretrained(model_dir, prefix_reuse=False) as enc:
        loaded = status_mib("VmHWM")
        best = best_seconds(lambda: enc.embed([ids]), reps)
        plain_peak = status_mib("VmHWM")
        starts = np.arange(0, length - 1, chunk_size)
        spans = np.stack([starts, np.minimum(starts + chunk_size, length - 1)], axis=1)
        text = ChunkedText(np.array(ids), spans, tail=1)
        chunked = best_seconds(lambda: enc.embed_chunks([text]), reps)
        return {
            "tokens": length,
            "tokens_per_s": length / best,
            "seconds": best,
            "peak_rss_loaded_mib": loaded,
            "peak_rss_mib": plain_peak,
            "chunks": len(spans),
            "chunked_tokens_per_s": length / chunked,
            "chunked_peak_rss_mib": status_mib("VmHWM"),
            "route": enc.route.describe(),
        }


def long_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "demo-model"))
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunk-size", type=int, default=512, help="late chunking's chunk tokens")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the per-length child process


def long(args: argparse.Namespace) -> None:
    model_dir = str(ensure_model(Path(args.model_dir).resolve(), 3))
    if args.one:
        print(json.dumps(measure_long(model_dir, args.one, args.reps, args.chunk_size)))
        return
    results = []
    for length in args.lengths:
        child = [
            sys.executable,
            __file__,
            "long",
            "--model-dir",
            model_dir,
            "--reps",
            str(args.reps),
        ]
        child += ["--chunk-size", str(args.chunk_size)]
        run = subprocess.run([*child, "--one", str(length)], capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(run.stderr)
        results.append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    base = results[0]["tokens_per_s"]
    rows = [
        [
            f"{r['tokens']:,}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['tokens_per_s'] / base:.2f}",
            f"{r['seconds']:.2f}",
            f"{r['peak_rss_loaded_mib']:.0f}",
            f"{r['peak_rss_mib']:.0f}",
            f"{r['chunks']}",
            f"{r['chunked_tokens_per_s']:.0f}",
            f"{r['chunked_tokens_per_s'] / r['tokens_per_s']:.2f}",
            f"{r['chunked_peak_rss_mib']:.0f}",
        ]
        for r in results
    ]
    header = ["text tokens", "tokens/s", f"vs {results[0]['tokens']:,}", "seconds"]
    header += ["peak RSS loaded MiB", "peak RSS after MiB", "chunks"]
    header += ["chunked tokens/s", "chunked vs plain", "peak RSS after chunked MiB"]
    record = new_record(
        model_dir=model_dir, reps=args.reps, chunk_size=args.chunk_size, results=results
    )
    notes = [f"route: {results[0]['route']}", "one text per call, best of --reps after a warm-up"]
    write_report(args.out, record, "One long text", notes, markdown_table(header, rows))


# ---------------------------------------------------------------- adapters

ADAPTERS_DOC = """\
LoRA adapters a request names (setting lora_modules) against the same fine-tune merged at load.

    python bench_routes.py adapters [--model-dir .cache/bench-model-4l] [--adapters 3]
                             [--rank 16] [--rounds 5] [--merge-tokens 512 1536 3072 6144]

`--adapters` demo adapters of the model (qwen_embed_deploy.demo.build_demo_adapter: rank
`--rank` on q, k, v, o, gate, up and down, peft's files). In process, dtype auto: one encoder
holding the base and every adapter (a call naming the first adapter, and a call naming none:
the base's cost beside adapters) and one serving the first adapter's fine-tune merged at load
(its folder as the checkpoint). Each call embeds 64 mixed documents (workload.make_texts); the
calls take turns (harness.taking_turns), medians of `--rounds` and of the ratios within a round.
Then 16 short queries with the query instruction, named in turn the base and each adapter
(what a Triton execute holds of several clients' queries): one call naming each text's
adapter (one forward) against one call per adapter (one forward each), taking turns. Then
forwards of one adapter's documents at several sizes (`--merge-tokens`), its pair merged into
the weights for the forward (where the route's GEMM merges: NativeBf16Weight) against its
products added (lora.MERGE_FROM_ROWS out of reach), taking turns: where merging pays.
Memory, from the tensors' sizes: what each fine-tune adds, merged (a copy of every linear
layer's weights) or per request (its pairs).
"""

MERGED = "fine-tune merged"
MIXED = "one call, each text's adapter"
SPLIT = "one call per adapter"


def safetensors_bytes(path: Path, suffix: str = "") -> int:
    """Bytes of the tensors in a safetensors file whose names end with `suffix`, at 2 bytes a
    weight (bf16, as the demo checkpoints and adapters hold them)."""
    with safe_open(str(path), framework="pt") as f:
        return sum(
            2 * int(np.prod(f.get_slice(k).get_shape())) for k in f.keys() if k.endswith(suffix)
        )


def adapters_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-model-4l"))
    p.add_argument("--adapters", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--merge-tokens", type=int, nargs="*", default=[512, 1536, 3072, 6144])


def merge_or_add(encoder: Encoder, docs: list[list[int]], sizes: list[int], rounds: int) -> dict:
    """Per forward size (tokens of the first of `docs` that fit in it): seconds of a call of
    adapter a0's texts with its pair merged for the forward and with its products added."""
    timings = {}
    for size in sizes:
        texts, tokens = [], 0
        for d in docs:
            if tokens + len(d) <= size:
                texts.append(d)
                tokens += len(d)

        def call(threshold, texts=texts):
            with mock.patch.object(lora, "MERGE_FROM_ROWS", threshold):
                encoder.embed(texts, adapter="a0")

        turns = taking_turns(
            {"merged": lambda call=call: call(0), "added": lambda call=call: call(2**62)}, rounds
        )
        timings[tokens] = turns
    return timings


def adapters(args: argparse.Namespace) -> None:
    model_dir = ensure_model(Path(args.model_dir).resolve(), 4)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    docs = [e.ids for e in tok.encode_batch(make_texts(64, 0))]
    tokens = sum(map(len, docs))
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        folders = [
            build_demo_adapter(Path(tmp) / f"adapter{i}", model_dir, rank=args.rank, seed=i)
            for i in range(args.adapters)
        ]
        modules = ",".join(f"a{i}={f}" for i, f in enumerate(folders))
        per_request = stack.enter_context(Encoder.from_pretrained(model_dir, lora_modules=modules))
        merged = stack.enter_context(Encoder.from_pretrained(folders[0]))
        calls = {
            "adapter per request": lambda: per_request.embed(docs, adapter="a0"),
            "base beside adapters": lambda: per_request.embed(docs),
            MERGED: lambda: merged.embed(docs),
        }
        agree = float(cosines(per_request.embed(docs, adapter="a0"), merged.embed(docs)).min())
        seconds = taking_turns(calls, args.rounds)
        queries = [e.ids for e in tok.encode_batch(make_queries(16))]
        names = [
            None if i % (args.adapters + 1) == 0 else f"a{i % (args.adapters + 1) - 1}"
            for i in range(len(queries))
        ]
        by_name = {n: [q for q, m in zip(queries, names, strict=True) if m == n] for n in names}
        query_calls = {
            MIXED: lambda: per_request.embed(queries, adapter=names),
            SPLIT: lambda: [per_request.embed(q, adapter=n) for n, q in by_name.items()],
        }
        mixed_seconds = taking_turns(query_calls, args.rounds)
        merge_seconds = merge_or_add(per_request, docs, args.merge_tokens, args.rounds)
        route = per_request.route.describe()
        pair_bytes = safetensors_bytes(folders[0] / "adapter_model.safetensors")
    linear_bytes = sum(
        safetensors_bytes(f, "_proj.weight") for f in model_dir.glob("*.safetensors")
    )
    rates = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    # a round's systems share its phase of the host's drift: ratios within a round
    ratios = {
        name: statistics.median(m / x for x, m in zip(s, seconds[MERGED], strict=True))
        for name, s in seconds.items()
    }
    for name, s in seconds.items():
        print(name, [f"{tokens / x:.0f}" for x in s], flush=True)
    rows = [[name, f"{rates[name]:.0f}", f"{ratios[name]:.3f}"] for name in rates]
    table = markdown_table(
        ["system", "tokens/s (median)", "/ merged (median within a round)"], rows
    )
    query_tokens = sum(map(len, queries))
    query_rates = {n: query_tokens / statistics.median(s) for n, s in mixed_seconds.items()}
    mixed_ratio = statistics.median(
        split / mixed
        for mixed, split in zip(mixed_seconds[MIXED], mixed_seconds[SPLIT], strict=True)
    )
    for name, s in mixed_seconds.items():
        print(name, [f"{query_tokens / x:.0f}" for x in s], flush=True)
    rows = [
        [n, f"{r:.0f}", f"{mixed_ratio if n == MIXED else 1:.3f}"] for n, r in query_rates.items()
    ]
    table += [
        "",
        *markdown_table(
            [
                f"{len(queries)} queries ({query_tokens} tokens)",
                "tokens/s (median)",
                "speed / one call per adapter (median within a round)",
            ],
            rows,
        ),
    ]
    merge_rows = []
    for forward_tokens, turns in merge_seconds.items():
        ratio = statistics.median(
            a / m for m, a in zip(turns["merged"], turns["added"], strict=True)
        )
        merge_rows.append(
            [
                str(forward_tokens),
                f"{1e3 * statistics.median(turns['merged']):.1f}",
                f"{1e3 * statistics.median(turns['added']):.1f}",
                f"{ratio:.3f}",
            ]
        )
    table += [
        "",
        *markdown_table(
            [
                "one forward of a0's documents, tokens",
                "pair merged, ms (median)",
                "products added, ms (median)",
                "speed merged / added (median within a round)",
            ],
            merge_rows,
        ),
    ]
    memory = [
        ["merged: a copy of the linear layers", f"{linear_bytes / 2**20:.1f} MiB", "1"],
        [
            f"per request: its pairs (rank {args.rank})",
            f"{pair_bytes / 2**20:.2f} MiB",
            f"{pair_bytes / linear_bytes:.4f}",
        ],
    ]
    table += ["", *markdown_table(["each fine-tune", "weights", "/ merged"], memory)]
    record = new_record(
        model_dir=str(model_dir),
        adapters=args.adapters,
        rank=args.rank,
        tokens=tokens,
        rounds=args.rounds,
        route=route,
        tokens_per_s=rates,
        ratio_to_merged=ratios,
        seconds=seconds,
        query_tokens=query_tokens,
        query_tokens_per_s=query_rates,
        mixed_speedup=mixed_ratio,
        query_seconds=mixed_seconds,
        merge_seconds={str(k): v for k, v in merge_seconds.items()},
        merge_from_rows=lora.MERGE_FROM_ROWS,
        min_cosine_per_request_vs_merged=agree,
        linear_bytes=linear_bytes,
        pair_bytes=pair_bytes,
    )
    notes = [
        f"{model_dir.name}, {args.adapters} adapters of rank {args.rank} on the 7 linear layers; "
        f"64 mixed documents ({tokens} tokens) per call, {args.rounds} rounds taking turns",
        f"route: {route}",
        f"an adapter per request against its fine-tune merged: min cosine {agree:.6f}",
        f"{len(queries)} queries (workload.make_queries) naming in turn the base and each "
        "adapter: one call naming each text's (one forward) against one call per adapter (one "
        "forward each: what serving each adapter's texts apart costs)",
        f"one adapter's forwards of several sizes: its pair merged into the weights for the "
        f"forward against its products added; the engine merges from {lora.MERGE_FROM_ROWS} rows "
        "(lora.MERGE_FROM_ROWS) where the route's GEMM can",
        "memory each fine-tune adds (at 2 bytes a value, from the tensors' sizes, not measured; "
        "twice both where the route holds fp32, the same ratio): merged, its "
        "own copy of every linear layer; per request, its pairs. The base's weights and its "
        "embedding table are held once either way on CPU (mapped, shared between processes)",
    ]
    write_report(args.out, record, "LoRA adapters per request against merged", notes, table)


# ---------------------------------------------------------------- settings

SETTINGS_DOC = """\
Encoder settings on one model: each variant its own Encoder, all loaded at once and taking turns
on the same texts, so what a setting's value is worth end to end on a workload is read on the
machine at hand (on a GPU, the forward's size against its graphs, for one).

    python bench_routes.py settings --model-dir .cache/qwen3-0.6b-shape --device cuda \\
        --dtype bfloat16 --variant "" --variant cuda_graph_tokens=16384 \\
        --variant max_batch_tokens=8192 [--workloads short mixed long] [--rounds 3]

A variant is comma-separated KEY=VALUE encoder settings (docs/configuration.md) over the
defaults, --device and --dtype; the first (often "", the defaults) is the one the others are
compared with. The workloads are bench_engine's ids (mixed: 1,024 texts, 80% of 16-64 tokens
and 20% of 256-1,024; short: 2,048 of 8-40; long: 64 of 2,048-4,096), --scale times as many.
Per workload, each variant's embed() of all its texts once to warm up (graphs captured, plans
made), then --rounds turns, the order reversed every other turn: its forwards per embed(),
tokens/s of the median turn, the median of the turns' ratios to the first variant, and the min
cosine of its vectors against the first's. On a GPU, the share of the model's linear layers'
cuBLAS bound at the first variant's rows per forward (bench_engine.linear_bound, as bench_engine
reports it at the defaults): one yardstick for every variant.
"""

WORKLOAD_TEXTS = {"mixed": 1024, "short": 2048, "long": 64}


def settings_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "demo-model"))
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--variant",
        action="append",
        required=True,
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="a variant's settings over the defaults ('': the defaults); the first is the base",
    )
    p.add_argument("--workloads", nargs="+", default=list(WORKLOAD_TEXTS), choices=WORKLOAD_TEXTS)
    p.add_argument("--scale", type=float, default=1.0, help="texts per workload, times this")
    p.add_argument("--rounds", type=int, default=3)


def variant_settings(variant: str, device: str, dtype: str) -> EncoderSettings:
    """A --variant's EncoderSettings: its KEY=VALUE pairs over the defaults, device and dtype."""
    params = {"device": device, "dtype": dtype}
    for item in filter(None, (part.strip() for part in variant.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--variant {variant!r}: {item!r} is not KEY=VALUE")
        params[key.strip()] = value.strip()
    return EncoderSettings.from_parameters(params)


def _embedding(enc: Encoder, seqs, into: dict, name: str):
    """A call of enc.embed(seqs), its vectors kept as into[name]."""

    def call():
        into[name] = enc.embed(seqs)

    return call


def settings(args: argparse.Namespace) -> None:
    names = [v or "defaults" for v in args.variant]
    if len(set(names)) != len(names):
        raise SystemExit(f"--variant given twice: {args.variant}")
    with contextlib.ExitStack() as stack:
        encoders = {
            name: stack.enter_context(
                Encoder.from_pretrained(
                    args.model_dir, variant_settings(v, args.device, args.dtype)
                )
            )
            for name, v in zip(names, args.variant, strict=True)
        }
        base = encoders[names[0]]
        gpu = base.device.type == "cuda"
        config = base.config
        bounds = {}  # workload -> the linear layers' tokens/s, measured once
        rows = []
        for kind in args.workloads:
            n = max(1, round(WORKLOAD_TEXTS[kind] * args.scale))
            # within the model's vocabulary: a replica's may be smaller than Qwen's
            seqs = [[i % config.vocab_size for i in s] for s in workload(kind, n, 0, 0)]
            tokens = sum(map(len, seqs))
            vectors = {}
            calls = {name: _embedding(enc, seqs, vectors, name) for name, enc in encoders.items()}
            before = {name: enc.stats["forwards"] for name, enc in encoders.items()}
            seconds = taking_turns(calls, args.rounds)
            for name, enc in encoders.items():
                row = {
                    "workload": kind,
                    "texts": n,
                    "tokens": tokens,
                    "variant": name,
                    "tokens_per_s": tokens / statistics.median(seconds[name]),
                    "x_base": statistics.median(
                        b / s for b, s in zip(seconds[names[0]], seconds[name], strict=True)
                    ),
                    "min_cosine": float(cosines(vectors[name], vectors[names[0]]).min()),
                    "forwards": (enc.stats["forwards"] - before[name]) / (args.rounds + 1),
                }
                if gpu:  # one yardstick for all: the first variant's forwards' bound
                    if kind not in bounds:
                        dtype = TORCH_DTYPES[base.route.dtype]
                        forward_rows = min(tokens, base.max_batch_tokens)
                        bounds[kind] = linear_bound(config, forward_rows, dtype, base.device, 3)
                    row["fraction_of_bound"] = row["tokens_per_s"] / bounds[kind]
                rows.append(row)
                print(json.dumps(row), flush=True)
        routes = {name: enc.route.describe() for name, enc in encoders.items()}
    record = new_record(
        model_dir=args.model_dir, device=args.device, dtype=args.dtype, routes=routes, rows=rows
    )
    header = ["workload", "texts", "tokens", "variant", "forwards", "tok/s", "x first"]
    header += ["min cosine"]
    header += ["share of the linear bound"] if any("fraction_of_bound" in r for r in rows) else []
    cells = [
        [
            r["workload"],
            r["texts"],
            r["tokens"],
            r["variant"],
            f"{r['forwards']:g}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['x_base']:.3f}",
            f"{r['min_cosine']:.6f}",
            *([f"{r['fraction_of_bound']:.0%}"] if "fraction_of_bound" in r else []),
        ]
        for r in rows
    ]
    notes = [
        f"model: {args.model_dir}; {args.rounds} turns per workload after a warm-up, the order "
        "reversed every other turn; tok/s of the median turn; x first: the median of the turns' "
        f"ratios to {names[0]!r}; min cosine against its vectors",
        *(f"{name}: {route}" for name, route in routes.items()),
    ]
    write_report(
        args.out, record, "Encoder settings taking turns", notes, markdown_table(header, cells)
    )


COMMANDS = {
    "prepack": (PREPACK_DOC, prepack_arguments, prepack),
    "bf16_gemm": (BF16_GEMM_DOC, bf16_gemm_arguments, bf16_gemm),
    "int8": (INT8_DOC, int8_arguments, int8_layouts),
    "gemm_bound": (GEMM_BOUND_DOC, gemm_bound_arguments, gemm_bound),
    "lengths": (LENGTHS_DOC, lengths_arguments, lengths),
    "long": (LONG_DOC, long_arguments, long),
    "adapters": (ADAPTERS_DOC, adapters_arguments, adapters),
    "settings": (SETTINGS_DOC, settings_arguments, settings),
}


def main() -> None:
    run_subcommands(__doc__, COMMANDS)


if __name__ == "__main__":
    main()
