"""Engine tokens/s against transformers' padded forward, same texts, same dtype, one run.

    python perf/bench_engine.py --model-dir .cache/demo-model [--dtype float32]

Workloads (seeded, `--workloads`): "mixed" = 80% texts of 16-64 tokens and 20% of 256-1024, in
random order; "uniform" = every text the same length; "short" = queries of 8-40 tokens; "long" =
texts of 2,048-4,096 tokens. Token ids are drawn uniformly from the BPE vocabulary and end with
<|endoftext|>, like the tokenizer's output (compute does not depend on which ids).
transformers runs Qwen3Model/Qwen2Model with SDPA attention on left-padded batches of 32 in
input order and takes the last position (Qwen3-Embedding's recipe); beside it, as
sentence-transformers batches, texts sorted by length (longest first) in batches of each
`--sorted-batch-sizes`. The engine gets the whole list at once. All must agree (cosine) so the
comparison is of equal work. On a GPU the run also times the model's linear layers alone
(F.linear: cuBLAS) at the engine's batch rows, the bound the engine's tokens/s is a fraction of.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F
from harness import RESULTS, markdown_table, new_record, write_report

from qwen_embed import Encoder, ModelConfig
from qwen_embed_deploy.demo import ENDOFTEXT_ID

WORKLOADS = ("mixed", "uniform", "short", "long")


def workload(kind: str, n: int, seed: int, uniform_len: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    if kind == "mixed":
        long = rng.random(n) < 0.2
        lengths = np.where(long, rng.integers(256, 1025, n), rng.integers(16, 65, n))
    elif kind == "short":
        lengths = rng.integers(8, 41, n)
    elif kind == "long":
        lengths = rng.integers(2048, 4097, n)
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


def sorted_embed(model, seqs: list[list[int]], batch_size: int) -> np.ndarray:
    """sentence-transformers' batching: longest first, padded per batch; in input order."""
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    vectors = transformers_embed(model, [seqs[i] for i in order], batch_size)
    out = np.empty_like(vectors)
    out[order] = vectors
    return out


def linear_bound(config: ModelConfig, rows: int, dtype: torch.dtype, device, reps: int) -> float:
    """Tokens/s of the model's linear layers alone at `rows` rows: every layer's q|k|v, o,
    gate|up and down, random weights, F.linear (cuBLAS on a GPU)."""
    h, d = config.hidden_size, config.head_dim
    q, kv, inter = config.num_heads * d, config.num_kv_heads * d, config.intermediate_size
    shapes = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]
    weights = [torch.randn(n, k, dtype=dtype, device=device) / k**0.5 for n, k in shapes]
    inputs = {k: torch.randn(rows, k, dtype=dtype, device=device) for _, k in shapes}

    def layers() -> None:
        for _ in range(config.num_layers):
            for w in weights:
                F.linear(inputs[w.shape[1]], w)
        torch.cuda.synchronize(device)

    layers()
    return rows / timed(layers, reps)[0]


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
    p.add_argument("--cuda-graph-tokens", type=int, help="default: the setting's default")
    p.add_argument("--workloads", nargs="+", default=["mixed", "uniform"], choices=WORKLOADS)
    p.add_argument("--mixed-texts", type=int, default=96)
    p.add_argument("--uniform-texts", type=int, default=96)
    p.add_argument("--short-texts", type=int, default=2048)
    p.add_argument("--long-texts", type=int, default=64)
    p.add_argument("--uniform-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--sorted-batch-sizes", type=int, nargs="*", default=[32, 256])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "engine_vs_transformers"))
    args = p.parse_args()

    dtype = getattr(torch, args.dtype)
    graphs = {} if args.cuda_graph_tokens is None else {"cuda_graph_tokens": args.cuda_graph_tokens}
    encoder = Encoder.from_pretrained(
        args.model_dir,
        dtype=args.dtype,
        device=args.device,
        attn_backend=args.attn_backend,
        **graphs,
    )
    reference = transformers_model(args.model_dir, dtype).to(args.device)
    config = ModelConfig.from_dir(args.model_dir)
    gpu = encoder.device.type == "cuda"
    rows = []
    for kind in args.workloads:
        n = getattr(args, f"{kind}_texts")
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
        row = {
            "workload": kind,
            "texts": n,
            "tokens": tokens,
            "padded_tokens": padded,
            "engine_tokens_per_s": tokens / engine_s,
            "transformers_tokens_per_s": tokens / hf_s,
            "ratio": hf_s / engine_s,
            "min_cosine": cos,
            "sorted_tokens_per_s": {},
        }
        for size in args.sorted_batch_sizes:
            sorted_s, vectors = timed(lambda s=seqs, b=size: sorted_embed(reference, s, b), 1)
            row["sorted_tokens_per_s"][size] = tokens / sorted_s
            row["min_cosine"] = min(row["min_cosine"], float((ours * vectors).sum(1).min()))
        if gpu:
            bound_rows = min(tokens, encoder.max_batch_tokens)
            bound = linear_bound(config, bound_rows, dtype, encoder.device, args.reps)
            row["linear_bound_tokens_per_s"] = bound
            row["fraction_of_bound"] = row["engine_tokens_per_s"] / bound
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)

    record = new_record(
        dtype=args.dtype,
        device=args.device,
        attn_backend=args.attn_backend,
        route=encoder.route.describe(),
        model_dir=args.model_dir,
        model=config.__dict__,
        results=rows,
    )
    notes = [
        f"model: {args.model_dir} ({config.num_layers} layers, hidden {config.hidden_size}), "
        f"dtype {args.dtype}, device {args.device}, attention {args.attn_backend}, "
        f"transformers batches of {args.batch_size} in input order; length-sorted batches of "
        f"{args.sorted_batch_sizes} (sentence-transformers' order, one run each); engine best "
        f"of {args.reps}",
        f"route: {encoder.route.describe()}",
    ]
    if gpu:
        notes.append(
            "bound: the model's linear layers alone (F.linear, cuBLAS) at min(tokens, "
            f"max_batch_tokens = {encoder.max_batch_tokens}) rows, best of {args.reps}"
        )
    header = [
        "workload",
        "texts",
        "tokens",
        "padded tokens (transformers)",
        "engine tok/s",
        "transformers tok/s",
        "engine / transformers",
        *(f"sorted {b} tok/s" for b in args.sorted_batch_sizes),
        *(["linear bound tok/s", "engine / bound"] if gpu else []),
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
            *(f"{r['sorted_tokens_per_s'][b]:.0f}" for b in args.sorted_batch_sizes),
            *(
                [f"{r['linear_bound_tokens_per_s']:.0f}", f"{r['fraction_of_bound']:.0%}"]
                if gpu
                else []
            ),
            f"{r['min_cosine']:.6f}",
        ]
        for r in rows
    ]
    title = "Engine vs transformers padded forward"
    write_report(args.out, record, title, notes, markdown_table(header, rows_md))
    encoder.close()


if __name__ == "__main__":
    main()
