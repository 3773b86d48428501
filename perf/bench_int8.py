"""The int8 route's layout: which linear layers run in int8, and whether their rows are rotated.

    python bench_int8.py [--model-dir .cache/bench-model-4l] [--rounds 3]

In process, dtype auto, one encoder per layout (the int8 route loaded with `int8.FLOAT_SHARDS`,
`int8.FLOAT_LAYERS` and `int8.rotation_block` as the layout names them), beside the float route:
- the route as it is: q|k, gate|up and down in int8, rows rotated (v and o in floats);
- the same layers without the rotation;
- q|k|v and gate|up in int8, not rotated (the layout before down moved to int8);
- every projection but o in int8, rotated.
The encoders take turns for `rounds` rounds over 64 mixed documents (workload.make_texts) in one
call each: best tokens/s. Accuracy: min and mean cosine against the fp32 float route on those
documents and on 54 texts of random ids (the tests' measure), on a model with random weights.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from unittest import mock

import numpy as np
from harness import RESULTS, cosines, new_record, write_report
from tokenizers import Tokenizer

from qwen_embed import Encoder, int8

from bench_peers import REPO, ensure_model
from workload import make_texts

NOT_ROTATED = {"rotation_block": lambda in_features: 1}
LAYOUTS = {
    "q|k, gate|up, down; rotated (the route)": {"FLOAT_SHARDS": int8.FLOAT_SHARDS},
    "q|k, gate|up, down; not rotated": NOT_ROTATED,
    "q|k|v, gate|up; not rotated": {
        "FLOAT_SHARDS": (),
        "FLOAT_LAYERS": ("mlp.down_proj", "self_attn.o_proj"),
        **NOT_ROTATED,
    },
    "q|k|v, gate|up, down; rotated": {"FLOAT_SHARDS": (), "FLOAT_LAYERS": ("self_attn.o_proj",)},
}
FLOAT = "float route (no int8)"


def random_texts(vocab_size: int, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [5, 17, 40, 90, 128, 200, 300, 511, 33, 64, 7, 250, 1000, 3]
    lengths += [3 + (i * 53) % 700 for i in range(40)]
    return [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-model-4l"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "int8"))
    args = p.parse_args()
    model_dir = ensure_model(Path(args.model_dir).resolve(), 4)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    docs = [e.ids for e in tok.encode_batch(make_texts(64, 0))]
    randoms = random_texts(tok.get_vocab_size())
    tokens = sum(map(len, docs))

    with contextlib.ExitStack() as stack:
        fp32 = stack.enter_context(Encoder.from_pretrained(model_dir, dtype="float32"))
        reference = {"documents": fp32.embed(docs), "random ids": fp32.embed(randoms)}
        encoders = {FLOAT: stack.enter_context(Encoder.from_pretrained(model_dir))}
        for name, changes in LAYOUTS.items():
            with mock.patch.multiple(int8, **changes):
                encoders[name] = stack.enter_context(
                    Encoder.from_pretrained(model_dir, quantization="int8")
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
        model_dir=str(model_dir), dtype=dtype, rounds=args.rounds, tokens=tokens, rows=rows
    )
    notes = [
        f"{model_dir.name}, dtype {dtype}; 64 mixed documents ({tokens} tokens) per call, "
        f"best of {args.rounds} turns; cosines against fp32 (random weights: accuracy on "
        "trained checkpoints is not measured here)"
    ]
    print(write_report(args.out, record, "int8 layouts (int8.py)", notes, table))


if __name__ == "__main__":
    main()
