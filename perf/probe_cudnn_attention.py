"""Would cuDNN's ragged attention beat PyTorch's FlashAttention-2 varlen kernel in the engine's
forwards? A probe for a lent GPU, before any backend changes (issue 58: long texts, where
attention is the largest share after the GEMMs).

    python perf/probe_cudnn_attention.py [--heads 16 --kv-heads 8 --head-dim 128] \
        [--workloads mixed long short] [--forwards 4] [--reps 20] [--out DIR/NAME]

Each workload's texts (bench_engine's lengths) are planned into forwards as the engine plans
them (batch.plan_batches, 16,384 tokens), and over each of the first few forwards' flat
[tokens, heads, head_dim] bf16 rows one layer's causal attention runs in four ways:
- FlashAttention-2 varlen, the engine's call (`aten::_flash_attention_forward` with offsets,
  grouped key/value heads read as they are);
- cuDNN ragged (`aten::_cudnn_attention_forward` with offsets) on the grouped heads as they are;
- cuDNN ragged on key/value heads repeated to the query heads (the repeat timed with it), where
  the grouped call is refused;
- cuDNN ragged on shapes rounded up (texts to a power of two with empty ones, rows to a power of
  two, the longest text to a power of two), so that a few execution plans serve any batch.
cuDNN builds an execution plan per shape it has not seen (texts, rows, longest text are in its
key); the first call of each forward is timed apart ("first call") from the median of the rest
(CUDA events). Outputs are compared with FlashAttention-2's over the real rows (max-abs). A
variant that fails reports its error instead. Needs a CUDA GPU with cuDNN 9.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from harness import RESULTS, markdown_table, new_record, write_report

from qwen_embed.batch import plan_batches
from qwen_embed.settings import EncoderSettings

from bench_engine import workload

FORWARD_TOKENS = EncoderSettings().max_batch_tokens  # tokens per forward, as the engine plans
TEXTS = {"mixed": 1024, "long": 64, "short": 2048}
FLASH = "FlashAttention-2 varlen (the engine's)"
GROUPED = "cuDNN ragged, grouped heads"


def _round_up(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def forwards(kind: str, seed: int) -> list[list[int]]:
    """The lengths of each forward the engine would run for the workload's texts."""
    lengths = [len(s) for s in workload(kind, TEXTS[kind], seed, 0)]
    return [[lengths[i] for i in batch] for batch in plan_batches(lengths, FORWARD_TOKENS)]


def offsets(lengths: list[int], texts: int, device) -> torch.Tensor:
    """Cumulative offsets [texts + 1] int32; texts past the real ones are empty."""
    cum = np.cumsum([0, *lengths, *[0] * (texts - len(lengths))])
    return torch.tensor(cum, dtype=torch.int32, device=device)


def flash(q, k, v, cu, longest, scale):
    return torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        cu,
        cu,
        longest,
        longest,
        0.0,
        True,
        False,
        scale=scale,
        window_size_left=-1,
        window_size_right=0,
    )[0]


def cudnn(q, k, v, cu, longest, scale):
    return torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu, cu, longest, longest, False, 0.0, True, False, scale=scale
    )[0]


def timed(fn, reps: int) -> tuple[float, float, torch.Tensor]:
    """(first call ms, median ms of the next `reps`, the output)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    first = 1e3 * (time.perf_counter() - started)
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return first, statistics.median(times), out


def variants(args, lengths: list[int], device):
    """name -> a call on one forward's rows."""
    tokens, texts, longest = sum(lengths), len(lengths), max(lengths)
    scale = args.head_dim**-0.5
    group = args.heads // args.kv_heads
    gen = torch.Generator(device=device).manual_seed(0)

    def rows(n, heads):
        return torch.randn(n, heads, args.head_dim, generator=gen, device=device).to(torch.bfloat16)

    q, k, v = rows(tokens, args.heads), rows(tokens, args.kv_heads), rows(tokens, args.kv_heads)
    cu = offsets(lengths, texts, device)
    padded_rows = _round_up(tokens)
    qp, kp, vp = (
        torch.zeros(padded_rows, *t.shape[1:], dtype=t.dtype, device=device) for t in (q, k, v)
    )
    qp[:tokens], kp[:tokens], vp[:tokens] = q, k, v
    cu_padded = offsets(lengths, _round_up(texts), device)
    longest_padded = _round_up(longest)

    def repeat(k, v):
        return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

    def rounded():  # heads repeated where cuDNN refused the grouped ones (args.repeat_heads)
        kv = repeat(kp, vp) if args.repeat_heads else (kp, vp)
        return cudnn(qp, *kv, cu_padded, longest_padded, scale)

    return {
        FLASH: lambda: flash(q, k, v, cu, longest, scale),
        GROUPED: lambda: cudnn(q, k, v, cu, longest, scale),
        "cuDNN ragged, heads repeated": lambda: cudnn(q, *repeat(k, v), cu, longest, scale),
        "cuDNN ragged, rounded shapes": rounded,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--workloads", nargs="+", default=["mixed", "long", "short"], choices=TEXTS)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--forwards",
        type=int,
        default=4,
        help="of each workload, the first N (each new shape costs cuDNN a plan)",
    )
    p.add_argument("--out", default=str(RESULTS / "probe-cudnn-attention"))
    args = p.parse_args()
    args.repeat_heads = False
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        raise SystemExit("the probe needs a CUDA GPU (cuDNN's attention runs on CUDA only)")
    device = torch.device(args.device)
    results, rows = {}, []
    for kind in args.workloads:
        plan = forwards(kind, seed=0)[: args.forwards]
        totals: dict[str, dict] = {}
        for lengths in plan:
            calls, tokens = variants(args, lengths, device), sum(lengths)
            reference = None
            for name, fn in calls.items():
                entry = totals.setdefault(name, {"first": [], "ms": [], "err": 0.0, "failed": None})
                if entry["failed"]:
                    continue
                try:
                    first, ms, out = timed(fn, args.reps)
                except Exception as e:  # the refusal is the finding
                    entry["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    args.repeat_heads |= name == GROUPED  # for the rounded shapes from here
                    continue
                out = out[:tokens].float()
                if reference is None:
                    reference = out
                err = (out - reference).abs().max().item()
                entry["first"].append(first)
                entry["ms"].append(ms)
                entry["err"] = max(entry["err"], err)
        engine = totals[FLASH]
        flash_ms = None if engine["failed"] else sum(engine["ms"])
        for name, entry in totals.items():
            if entry["failed"]:
                rows.append([kind, len(plan), name, "", "", "", "", entry["failed"]])
                continue
            ms = sum(entry["ms"])
            rows.append(
                [
                    kind,
                    len(plan),
                    name,
                    f"{ms:.3f}",
                    f"{flash_ms / ms:.2f}x" if flash_ms else "n/a",
                    f"{statistics.median(entry['first']):.1f}",
                    f"{entry['err']:.2e}",
                    "",
                ]
            )
            results[f"{kind} {name}"] = {**entry, "ms_total": ms}
    record = new_record(
        device=torch.cuda.get_device_name(device),
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        cudnn_version=torch.backends.cudnn.version(),
        results=results,
    )
    notes = [
        f"GPU {record['device']}, cuDNN {record['cudnn_version']}; one layer's causal "
        f"attention, {args.heads} query / {args.kv_heads} key-value heads of {args.head_dim}, "
        "bf16, random rows",
        f"ms: each forward's median of {args.reps} calls (CUDA events), summed over the "
        "workload's forwards; first call: the median over forwards of a new shape's first call "
        "(wall ms, an execution plan built where cuDNN has none for it)",
        "rounded shapes: "
        + (
            "key/value heads repeated (grouped ones refused)"
            if args.repeat_heads
            else "grouped heads"
        ),
    ]
    table = markdown_table(
        [
            "workload",
            "forwards",
            "attention",
            "ms (all forwards)",
            "x FlashAttention-2",
            "first call ms",
            "max-abs vs FlashAttention-2",
            "error",
        ],
        rows,
    )
    write_report(
        args.out, record, "cuDNN ragged attention against FlashAttention-2 varlen", notes, table
    )


if __name__ == "__main__":
    main()
