"""The engine against its GEMM bound, in one process, taking turns.

    python bench_gemm_bound.py [--model-dir .cache/bench-model-4l] [--quantization none]
                               [--pairs 15]

bench_peers.py divides the engine's tokens/s by a GEMM probe run minutes apart; on a host whose
speed drifts 2x within minutes that ratio is mostly the drift. Here each pair times the engine's
embed() of 64 mixed documents (workload.make_texts) and, right beside it, the model's linear
layers alone on as many rows: every layer's weights at their shapes, in the route's dtype,
through oneDNN's packed GEMM (onednn.PackedWeight), the fastest CPU GEMM the engine has
(`--quantization int8`: the int8 route's quantised layers through int8.Int8Weight, its float
layers packed). The order alternates. The fraction is the layers' time over the engine's, the
median of the pairs with its quartiles. The bound counts every layer whole, as bench_peers'
does, although the engine computes only the pooled rows past the last layer's keys and values.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from harness import RESULTS, new_record, taking_turns, write_report
from render_results import gemm_bound
from tokenizers import Tokenizer

from qwen_embed import Encoder, int8
from qwen_embed.engine import TORCH_DTYPES
from qwen_embed.layers import linear_weight_dtype
from qwen_embed.onednn import PackedWeight

from bench_peers import REPO, ensure_model, linear_shapes
from workload import make_texts


def linear_layers(config: dict, rows: int, dtype: torch.dtype, quantization: str) -> list:
    """One layer's matmuls as the route runs them, each with `rows` random input rows."""
    layers = []
    for name, (n, k) in linear_shapes(config).items():
        w = torch.randn(n, k, dtype=dtype).to(linear_weight_dtype(dtype, torch.device("cpu")))
        quantised = quantization == "int8" and int8.quantizes(name)
        layers.append(
            (int8.Int8Weight(w) if quantised else PackedWeight(w), torch.randn(rows, k).to(dtype))
        )
    return layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-model-4l"))
    p.add_argument("--quantization", default="none", choices=["none", "int8"])
    p.add_argument("--texts", type=int, default=64)
    p.add_argument("--pairs", type=int, default=15)
    p.add_argument("--out", default=str(RESULTS / "gemm_bound"))
    args = p.parse_args()
    model_dir = ensure_model(Path(args.model_dir).resolve(), 4)
    config = json.loads((model_dir / "config.json").read_text())
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    docs = [e.ids for e in tok.encode_batch(make_texts(args.texts, 0))]
    tokens = sum(map(len, docs))

    with Encoder.from_pretrained(model_dir, quantization=args.quantization) as enc:
        dtype = TORCH_DTYPES[enc.route.dtype]
        layers = linear_layers(config, tokens, dtype, args.quantization)

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
        "(oneDNN-packed weights; int8: the route's int8 layers) over the engine's",
    ]
    table = gemm_bound(record)  # the results page's table
    print(write_report(args.out, record, "The engine against its GEMM bound", notes, table))


if __name__ == "__main__":
    main()
