"""Engine tokens/s by text length, the native attention operator vs PyTorch SDPA per segment,
on one encoder in process.

    python bench_lengths.py [--model-dir .cache/demo-model] [--lengths 128 512 2048 8192]

Per length L: calls of 8,192 tokens (8,192 / L texts of L tokens; random ids ending with
<|endoftext|>), prefix reuse off; then the text mix of `make perf-peers` (workload.make_texts,
512 texts, one call).  The two backends take turns on the same encoder
(workload.alternate: the machine's drift falls on both). Reports tokens/s, each length's share
of the 128-token figure, and the cosine between the two backends' vectors.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from harness import RESULTS, markdown_table, new_record, write_report
from tokenizers import Tokenizer

from qwen_embed import Encoder, native
from qwen_embed.attention import create_backend
from qwen_embed_deploy.demo import ENDOFTEXT_ID

from bench_peers import REPO, ensure_model
from workload import alternate, make_texts

TOKENS = 8192


def use_backend(enc: Encoder, backend):
    def switch():
        enc.model.backend = backend
        for layer in enc.model.layers:
            layer.self_attn.backend = backend

    return switch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "demo-model"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 8192])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--isa", default="", help="run the native kernels of this instruction set")
    p.add_argument("--out", default=str(RESULTS / "lengths"))
    args = p.parse_args()
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
        max_batch_tokens=TOKENS,
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
                    for _ in range(max(1, TOKENS // length))
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

    record = new_record(route=route, tokens_per_call=TOKENS, rows=rows)
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
        f"{TOKENS} tokens per call, {torch.get_num_threads()} threads",
        f"native kernels: {native.isa()}",
    ]
    write_report(args.out, record, "Engine tokens/s by text length", notes, table)


if __name__ == "__main__":
    main()
