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
turns (harness.taking_turns), medians of `--rounds`. Memory, from the tensors' sizes: what
each fine-tune adds, merged (a copy of every linear layer's weights) or per request (its pairs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch
from harness import (
    REPO,
    RESULTS,
    ensure_model,
    markdown_table,
    new_record,
    taking_turns,
    write_report,
)
from safetensors.torch import save_file

from qwen_embed import Encoder, ModelConfig

from bench_engine import workload

TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each adapted linear layer of one decoder layer."""
    h, d, n = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (n, h),
        "up_proj": (n, h),
        "down_proj": (h, n),
    }


def write_adapter(folder: Path, base: Path, config: ModelConfig, rank: int, seed: int) -> int:
    """A peft LoRA adapter of `base` (seeded pairs) in `folder`; returns its pairs' bytes."""
    generator = torch.Generator().manual_seed(seed)
    shapes = linear_shapes(config)
    tensors = {}
    for layer in range(config.num_layers):
        for module, names in TARGETS.items():
            for name in names:
                out, inp = shapes[name]
                key = f"base_model.model.layers.{layer}.{module}.{name}"
                a = torch.randn(rank, inp, generator=generator) / inp**0.5
                b = torch.randn(out, rank, generator=generator) * 0.02
                tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    adapter = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": [n for names in TARGETS.values() for n in names],
        "base_model_name_or_path": str(base),
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(adapter))
    return sum(t.numel() * t.element_size() for t in tensors.values())


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
        folders = [Path(tmp) / f"adapter{i}" for i in range(args.adapters)]
        pair_bytes = [write_adapter(f, base, config, args.rank, i) for i, f in enumerate(folders)]
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
    for name, s in seconds.items():
        print(name, [f"{tokens / x:.0f}" for x in s], flush=True)
    rows = [
        [name, f"{rate:.0f}", f"{rate / rates['fine-tune merged']:.3f}"]
        for name, rate in rates.items()
    ]
    n = args.adapters
    # bf16: 2 bytes a weight, as the checkpoints and the adapters are saved
    linear_bytes = 2 * config.num_layers * sum(o * i for o, i in linear_shapes(config).values())
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
    table = markdown_table(["system", "tokens/s (median)", "/ merged"], rows)
    table += ["", *markdown_table(["each fine-tune", "weights", "/ merged"], memory)]
    write_report(args.out, record, "LoRA adapters per request against merged", notes, table)


if __name__ == "__main__":
    main()
