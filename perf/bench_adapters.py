"""LoRA adapters named per request (setting lora_modules) against the same fine-tune merged at
load: tokens/s in process, and the weights each way of serving several fine-tunes holds.

    python bench_adapters.py [--model-dir .cache/bench-model-4l] [--adapters 3] [--rank 16]
        [--texts 64] [--rounds 5]

`--adapters` seeded adapters of the model (rank `--rank` on q, k, v, o, gate, up and down, in
peft's files, each naming the model as its base). In one process, dtype auto, three encoders:
one holding the base and every adapter per request (a call naming the first adapter, and a
call naming none: the base's cost beside adapters), and one serving the first adapter's
fine-tune merged at load (what naming the fine-tune's folder as a checkpoint does). Each call
embeds bench_engine's mixed texts (80% of 16-64 tokens, 20% of 256-1,024); the calls take
turns (harness.taking_turns), medians of `--rounds` and of the ratios within a round.
Memory, from the tensors' sizes: what each fine-tune adds, merged (a copy of every linear
layer's weights) or per request (its pairs).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
from harness import (
    REPO,
    RESULTS,
    ensure_model,
    markdown_table,
    new_record,
    taking_turns,
    write_report,
)
from safetensors import safe_open

from qwen_embed import Encoder, ModelConfig
from qwen_embed_deploy.demo import build_demo_adapter

from bench_engine import workload


def tensor_bytes(path: Path, suffix: str = "") -> int:
    """Bytes of the tensors in a safetensors file whose names end with `suffix`, at 2 bytes a
    weight (bf16, as the demo checkpoints and adapters hold them)."""
    with safe_open(str(path), framework="pt") as f:
        return sum(
            2 * int(np.prod(f.get_slice(k).get_shape())) for k in f.keys() if k.endswith(suffix)
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-model-4l"))
    p.add_argument("--adapters", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--texts", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS / "adapters"))
    args = p.parse_args()
    base = ensure_model(Path(args.model_dir), 4)
    config = ModelConfig.from_dir(base)
    texts = workload("mixed", args.texts, 0, 128)
    tokens = sum(len(t) for t in texts)
    with tempfile.TemporaryDirectory() as tmp:
        folders = [
            build_demo_adapter(Path(tmp) / f"adapter{i}", base, rank=args.rank, seed=i)
            for i in range(args.adapters)
        ]
        pair_bytes = [tensor_bytes(f / "adapter_model.safetensors") for f in folders]
        modules = ",".join(f"a{i}={f}" for i, f in enumerate(folders))
        per_request = Encoder.from_pretrained(base, lora_modules=modules)
        merged = Encoder.from_pretrained(folders[0])  # the fine-tune's folder: merged at load
        calls = {
            "adapter per request": lambda: per_request.embed(texts, adapter="a0"),
            "base beside adapters": lambda: per_request.embed(texts),
            "fine-tune merged": lambda: merged.embed(texts),
        }
        agree = float(
            np.min(np.sum(per_request.embed(texts, adapter="a0") * merged.embed(texts), axis=1))
        )
        seconds = taking_turns(calls, args.rounds)
        route = per_request.route.describe()
        per_request.close()
        merged.close()
    rates = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    # a round's systems share its phase of the host's drift: ratios within a round
    ratios = {
        name: statistics.median(m / x for x, m in zip(s, seconds["fine-tune merged"], strict=True))
        for name, s in seconds.items()
    }
    for name, s in seconds.items():
        print(name, [f"{tokens / x:.0f}" for x in s], flush=True)
    rows = [[name, f"{rates[name]:.0f}", f"{ratios[name]:.3f}"] for name in rates]
    n = args.adapters
    linear_bytes = sum(tensor_bytes(f, "_proj.weight") for f in base.glob("*.safetensors"))
    memory = [
        ["merged: a copy of the linear layers", f"{linear_bytes / 2**20:.1f} MiB", "1"],
        [
            f"per request: its pairs (rank {args.rank})",
            f"{pair_bytes[0] / 2**20:.2f} MiB",
            f"{pair_bytes[0] / linear_bytes:.4f}",
        ],
    ]
    record = new_record(
        model=str(base),
        adapters=n,
        rank=args.rank,
        texts=args.texts,
        tokens=tokens,
        rounds=args.rounds,
        route=route,
        tokens_per_s=rates,
        ratio_to_merged=ratios,
        seconds=seconds,
        min_cosine_per_request_vs_merged=agree,
        linear_bytes=linear_bytes,
        pair_bytes=pair_bytes,
    )
    notes = [
        f"model {base} (Qwen3-Embedding-0.6B's shape, {config.num_layers} layers), {n} adapters "
        f"of rank {args.rank} on the 7 linear layers; {args.texts} mixed texts ({tokens} "
        f"tokens) per call, one call per system per round, {args.rounds} rounds taking turns",
        f"route: {route}",
        f"an adapter per request against its fine-tune merged: min cosine {agree:.6f}",
        "memory each fine-tune adds (bf16, from the tensors' sizes, not measured): merged, its "
        "own copy of every linear layer; per request, its pairs. The base's weights and its "
        "embedding table are held once either way on CPU (mapped, shared between processes)",
    ]
    header = ["system", "tokens/s (median)", "/ merged (median within a round)"]
    table = markdown_table(header, rows)
    table += ["", *markdown_table(["each fine-tune", "weights", "/ merged"], memory)]
    write_report(args.out, record, "LoRA adapters per request against merged", notes, table)


if __name__ == "__main__":
    main()
