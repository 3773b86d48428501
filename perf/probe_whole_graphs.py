"""Would one CUDA graph per small forward, attention inside, beat the engine's graphs? A probe
for a lent GPU, before the engine changes (issue 58's one-client latency).

    python perf/probe_whole_graphs.py --model-dir .cache/qwen3-0.6b-shape --dtype bfloat16 \
        --device cuda [--texts-per-call 8 64] [--calls 32] [--max-rows 16384]

The engine's graphs (qwen_embed/cuda_graphs.py) stop at every layer's attention, which runs
eagerly on the batch's own layout: a small forward still makes a graph launch and an attention
call per layer from Python, and leaves the GPU idle between them. Here a forward of up to R rows,
S texts and L tokens in its longest text replays one graph: the attention reads its offsets
from static buffers, the texts past the batch's own padded as empty ones, and sizes its
FlashAttention grid by L (L/128 x S x heads blocks, those past a text's end returning at once).
Rows are bucketed as the engine's graphs are, texts and L by powers of two; the last layer stays
pruned to the pooled rows. The same Encoder runs three ways, taking turns per round: eagerly,
with its own graphs, and with these; prefix reuse is off (a plain batch: the engine's graphs
serve shared prefixes). Reports milliseconds per call and the vectors' min cosine against the
eager forward's.
On CPU (a check of the buffers' plumbing, not a figure) nothing is captured and attention runs
per segment on each batch's own lengths, padded with the empty texts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from harness import RESULTS, markdown_table, new_record, write_report

from qwen_embed import Encoder
from qwen_embed.attention import VARLEN_REASON
from qwen_embed.cuda_graphs import BUCKETS, cuda_capture
from qwen_embed.segments import AttentionLayout, ForwardContext
from qwen_embed_deploy.serving.config import DEMO_MODEL_DIR

from bench_engine import workload


def _run_as_is(fn: Callable[[], None]) -> Callable[[], None]:
    return fn


class WholeGraphs:
    """A QwenModel's `graphs` (cuda_graphs.TokenGraphs' interface): `forward(ctx)` runs a plain
    pruned batch of up to `max_rows` rows through one captured forward per (rows, texts,
    longest text) bucket, captured on first use; None (the eager forward) for anything else."""

    def __init__(self, model, max_rows: int, capture: Callable):
        self.model = model
        self.rows = [b for b in BUCKETS if b < max_rows] + [max_rows]
        self.capture = capture
        self.static = model.norm.weight.device.type == "cuda"
        self.entries: dict[tuple[int, int, int], dict] = {}
        self.replays = 0
        self.capture_s = 0.0

    def forward(self, ctx: ForwardContext) -> torch.Tensor | None:
        t, s = ctx.batch.num_tokens, ctx.batch.num_seqs
        rows = next((r for r in self.rows if r >= t), None)
        if rows is None or ctx.plan is not None or ctx.last is None or ctx.media is not None:
            return None
        texts = 1 << (s - 1).bit_length()
        longest = min(rows, max(128, 1 << (max(ctx.batch.seq_lens) - 1).bit_length()))
        key = (rows, texts, longest)
        entry = self.entries.get(key) or self._capture(key)
        b = entry["buffers"]
        b["ids"][:t].copy_(ctx.batch.input_ids)
        b["positions"][:t].copy_(ctx.batch.positions)
        b["cu"][: s + 1].copy_(ctx.batch.cu_seqlens)
        b["cu"][s + 1 :].fill_(t)  # the padding texts: empty, at the end
        torch.clamp(b["texts"], max=s, out=b["cu_last"])  # one pooled row per text
        b["last"][:s].copy_(ctx.last_rows)
        if not self.static:  # nothing captured: attention plans each batch's own segments
            lens = ctx.batch.seq_lens
            entry["layouts"] = self._layouts(b, lens, (1,) * s, texts)
        entry["replay"]()
        self.replays += 1
        return entry["out"][:s]

    def _layouts(self, b, k_lens, q_last, texts) -> tuple[AttentionLayout, AttentionLayout]:
        """The attention layouts of every layer and of the pruned last one over the static
        offsets; their lengths (FlashAttention's grid is sized by the longest) are the
        bucket's bound on a GPU, each batch's own elsewhere."""
        pad = (0,) * (texts - len(k_lens))
        k_lens, q_last = (*k_lens, *pad), (*q_last, *pad)
        host = b["cu"].cpu()
        layouts = (
            AttentionLayout(k_lens, k_lens, b["cu"], b["cu"], host, host, None),
            AttentionLayout(q_last, k_lens, b["cu_last"], b["cu"], b["cu_last"].cpu(), host, None),
        )
        for layout in layouts:
            self.model.backend.prepare(layout)
        return layouts

    def _capture(self, key: tuple[int, int, int]) -> dict:
        (rows, texts, longest), model = key, self.model
        device = model.norm.weight.device
        started = time.perf_counter()
        b = {
            "ids": torch.zeros(rows, dtype=torch.int64, device=device),
            "positions": torch.zeros(rows, dtype=torch.int64, device=device),
            "cu": torch.zeros(texts + 1, dtype=torch.int32, device=device),
            "cu_last": torch.arange(texts + 1, dtype=torch.int32, device=device),
            "texts": torch.arange(texts + 1, dtype=torch.int32, device=device),
            "last": torch.zeros(texts, dtype=torch.int64, device=device),
        }
        entry = {"buffers": b, "layouts": self._layouts(b, (longest,), (1,), texts)}

        def forward():
            layout, last = entry["layouts"]
            x, cos, sin = model.stem(b["ids"], b["positions"])
            residual = None
            final = len(model.layers) - 1
            for i, layer in enumerate(model.layers):
                at, picked = (last, b["last"]) if i == final else (layout, None)
                q, k, v, residual = layer.before_attention(x, residual, cos, sin, picked)
                attn = model.backend.forward(q, k, v, at).reshape(q.shape[0], -1)
                x, residual = layer.after_attention(attn, residual, picked)
            entry["out"] = model.norm(x, residual)[0]

        with torch.inference_mode():
            entry["replay"] = self.capture(forward)
        self.entries[key] = entry
        self.capture_s += time.perf_counter() - started
        return entry


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    dots = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(dots.min())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(DEMO_MODEL_DIR))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", help="cuda[:N], or cpu to check the plumbing")
    p.add_argument("--texts-per-call", type=int, nargs="+", default=[8, 64])
    p.add_argument("--calls", type=int, default=32, help="calls per size and variant per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-rows", type=int, default=16384, help="the largest rows bucket")
    p.add_argument("--out", type=Path, default=RESULTS / "whole_graphs")
    args = p.parse_args()
    gpu = args.device.startswith("cuda")
    attention = {} if gpu else {"attn_backend": "torch"}
    with Encoder.from_pretrained(
        args.model_dir, dtype=args.dtype, device=args.device, prefix_reuse="off", **attention
    ) as enc:
        model = enc.model
        if gpu and enc.route.attention_reason != VARLEN_REASON:
            route = enc.route.describe()
            raise SystemExit(f"the probe needs PyTorch's varlen FlashAttention; route: {route}")
        capture = cuda_capture(model.norm.weight.device) if gpu else _run_as_is
        variants = {"eager": None, "engine's graphs": model.graphs}
        variants["one graph per forward"] = WholeGraphs(model, args.max_rows, capture)
        whole = variants["one graph per forward"]
        reserved = torch.cuda.memory_reserved() if gpu else 0
        calls = {
            n: [workload("mixed", n, seed, 0) for seed in range(args.calls)]
            for n in args.texts_per_call
        }
        vectors, ms = {}, {(n, v): [] for n in calls for v in variants}
        for round_ in range(args.rounds + 1):  # round 0 captures, warms up and checks
            for n, batches in calls.items():
                for name, graphs in variants.items():
                    model.graphs = graphs
                    times = []
                    for i, seqs in enumerate(batches):
                        started = time.perf_counter()
                        out = enc.embed(seqs)
                        times.append(time.perf_counter() - started)
                        if round_ == 0:
                            vectors[(n, name, i)] = out
                    if round_:
                        ms[(n, name)].append(1e3 * statistics.median(times))
        model.graphs = variants["engine's graphs"]
        reserved = (torch.cuda.memory_reserved() - reserved) if gpu else 0
    rows = []
    for n in calls:
        eager = statistics.median(ms[(n, "eager")])
        engine = statistics.median(ms[(n, "engine's graphs")])
        for name in variants:
            got = statistics.median(ms[(n, name)])
            worst = min(
                cosine(vectors[(n, name, i)], vectors[(n, "eager", i)]) for i in range(args.calls)
            )
            rows.append(
                [
                    n,
                    name,
                    f"{got:.2f}",
                    f"{eager / got:.2f}x",
                    f"{engine / got:.2f}x",
                    f"{worst:.6f}",
                ]
            )
    embeds = args.calls * len(calls) * (args.rounds + 1)
    record = new_record(
        model_dir=args.model_dir,
        dtype=args.dtype,
        device=args.device,
        route=enc.route.describe(),
        ms_per_call={f"{n} {v}": t for (n, v), t in ms.items()},
        whole_graph_replays=whole.replays,
        whole_graph_embeds=embeds,
        graphs_captured=sorted(whole.entries),
        capture_s=whole.capture_s,
        memory_reserved_bytes=reserved,
    )
    notes = [
        f"work: {args.calls} calls of each size (the benchmarks' mixed lengths), "
        f"{args.rounds} rounds, the variants taking turns; median ms per call "
        "(embed(): planning, forward, pooling, the copy to the host)",
        f"route: {record['route']}",
        f"one graph per forward: {whole.replays} forwards replayed in {embeds} embed() calls; "
        f"{len(whole.entries)} graphs (rows, texts, longest) captured in {whole.capture_s:.1f} s; "
        f"GPU memory reserved during the probe (its graphs' pool, the eager forwards' "
        f"activations) {reserved / 2**20:.0f} MiB",
    ]
    table = markdown_table(
        ["texts per call", "forward", "ms per call", "x eager", "x engine's graphs", "min cosine"],
        rows,
    )
    write_report(args.out, record, "One CUDA graph per forward, attention inside", notes, table)


if __name__ == "__main__":
    main()
