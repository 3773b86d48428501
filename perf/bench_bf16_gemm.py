"""What batch_invariant "on" costs: the bf16 route's GEMM on the native brgemm operator
(onednn.NativeBf16Weight, a row the same at any batch; the default on AMX CPUs) against oneDNN's
packed GEMM ("off"; the default elsewhere), end to end.

    python bench_bf16_gemm.py [--model-dir .cache/bench-model-4l] [--rounds 4]

In process, dtype bfloat16, one encoder each, taking turns for `rounds` rounds: 64 mixed
documents (workload.make_texts) in one call, and 16 short texts one call each; best tokens/s
of each and its ratio to off round by round. Then the same-vector check of each: the
16 texts alone against the same texts among the documents, bitwise (texts differing, max-abs).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import numpy as np
from harness import RESULTS, markdown_table, new_record, round_ratios, write_report
from tokenizers import Tokenizer

from qwen_embed import Encoder
from qwen_embed.onednn import brgemm_runs

from bench_peers import REPO, ensure_model
from workload import make_texts

GEMMS = {
    "off": "oneDNN packed (batch_invariant off; the default without AMX)",
    "on": "brgemm operator (batch_invariant on; the default on AMX)",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-model-4l"))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=str(RESULTS / "bf16_gemm"))
    args = p.parse_args()
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


if __name__ == "__main__":
    main()
