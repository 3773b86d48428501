"""Engine tokens/s against transformers' padded forward, same texts, same dtype, one run.

    python perf/bench_engine.py --model-dir .cache/demo-model [--dtype float32]

Workloads (seeded): "mixed" = 80% texts of 16-64 tokens and 20% of 256-1024, in random order;
"uniform" = every text the same length. Token ids are drawn uniformly from the BPE vocabulary
and end with <|endoftext|>, like the tokenizer's output (compute does not depend on which ids).
transformers runs Qwen3Model/Qwen2Model with SDPA attention on left-padded batches of 32 in
input order and takes the last position (Qwen3-Embedding's recipe); the engine gets the whole
list at once. Both must agree (cosine) so the comparison is of equal work.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from harness import RESULTS, markdown_table, new_record, write_report

from qwen_embed import Encoder, ModelConfig
from qwen_embed_deploy.demo import ENDOFTEXT_ID


def workload(kind: str, n: int, seed: int, uniform_len: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    if kind == "mixed":
        long = rng.random(n) < 0.2
        lengths = np.where(long, rng.integers(256, 1025, n), rng.integers(16, 65, n))
    else:
        lengths = np.full(n, uniform_len)
    return [
        rng.integers(0, ENDOFTEXT_ID, size=int(k) - 1).tolist() + [ENDOFTEXT_ID] for k in lengths
    ]


def transformers_model(model_dir: str, dtype: torch.dtype):
    from transformers import Qwen2Model, Qwen3Model

    family = ModelConfig.from_dir(model_dir).family
    cls = Qwen3Model if family == "qwen3" else Qwen2Model
    return cls.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").eval()


def transformers_embed(model, seqs: list[list[int]], batch_size: int) -> np.ndarray:
    device = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for i in range(0, len(seqs), batch_size):
            chunk = seqs[i : i + batch_size]
            width = max(map(len, chunk))
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, s in enumerate(chunk):  # left padding: the last position is real
                ids[row, width - len(s) :] = torch.tensor(s)
                mask[row, width - len(s) :] = 1
            hidden = model(input_ids=ids.to(device), attention_mask=mask.to(device))
            last = hidden.last_hidden_state[:, -1].float()
            out.append(torch.nn.functional.normalize(last, dim=-1).cpu().numpy())
    return np.concatenate(out)


def timed(fn, reps: int) -> tuple[float, np.ndarray]:
    best, result = float("inf"), None
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=".cache/demo-model")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--attn-backend", default="torch", help="torch, flash_attn or flashinfer")
    p.add_argument("--mixed-texts", type=int, default=96)
    p.add_argument("--uniform-texts", type=int, default=96)
    p.add_argument("--uniform-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "engine_vs_transformers"))
    args = p.parse_args()

    dtype = getattr(torch, args.dtype)
    encoder = Encoder.from_pretrained(
        args.model_dir, dtype=args.dtype, device=args.device, attn_backend=args.attn_backend
    )
    reference = transformers_model(args.model_dir, dtype).to(args.device)
    rows = []
    for kind, n in (("mixed", args.mixed_texts), ("uniform", args.uniform_texts)):
        seqs = workload(kind, n, args.seed, args.uniform_len)
        tokens = sum(map(len, seqs))
        chunks = [seqs[i : i + args.batch_size] for i in range(0, n, args.batch_size)]
        padded = sum(max(map(len, c)) * len(c) for c in chunks)
        encoder.embed(seqs[:4])  # warm-up
        transformers_embed(reference, seqs[:4], args.batch_size)
        engine_s, ours = timed(lambda s=seqs: encoder.embed(s), args.reps)
        hf_s, theirs = timed(
            lambda s=seqs: transformers_embed(reference, s, args.batch_size), args.reps
        )
        cos = float((ours * theirs).sum(1).min())
        rows.append(
            {
                "workload": kind,
                "texts": n,
                "tokens": tokens,
                "padded_tokens": padded,
                "engine_tokens_per_s": tokens / engine_s,
                "transformers_tokens_per_s": tokens / hf_s,
                "ratio": hf_s / engine_s,
                "min_cosine": cos,
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    config = ModelConfig.from_dir(args.model_dir)
    record = new_record(
        dtype=args.dtype,
        device=args.device,
        attn_backend=args.attn_backend,
        model_dir=args.model_dir,
        model=config.__dict__,
        results=rows,
    )
    notes = [
        f"model: {args.model_dir} ({config.num_layers} layers, hidden {config.hidden_size}), "
        f"dtype {args.dtype}, device {args.device}, attention {args.attn_backend}, "
        f"transformers batches of {args.batch_size}, best of {args.reps}",
    ]
    header = [
        "workload",
        "texts",
        "tokens",
        "padded tokens (transformers)",
        "engine tok/s",
        "transformers tok/s",
        "engine / transformers",
        "min cosine",
    ]
    rows_md = [
        [
            r["workload"],
            r["texts"],
            r["tokens"],
            r["padded_tokens"],
            f"{r['engine_tokens_per_s']:.0f}",
            f"{r['transformers_tokens_per_s']:.0f}",
            f"{r['ratio']:.2f}x",
            f"{r['min_cosine']:.6f}",
        ]
        for r in rows
    ]
    title = "Engine vs transformers padded forward"
    write_report(args.out, record, title, notes, markdown_table(header, rows_md))
    encoder.close()


if __name__ == "__main__":
    main()
