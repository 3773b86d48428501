"""End-to-end throughput of the `embed` ensemble on a real tritonserver vs the engine alone.

    python perf/bench_serving.py [--concurrency 1 16 64] [--seconds 20]

Texts (seeded): 80% of 16-64 words and 20% of 256-1024 words drawn from common English words
that are one Qwen token each, so a text of N words is about N + 1 tokens. Each request carries
--texts-per-request texts; every client (a thread with its own gRPC client) sends requests
back to back for --seconds, every answer checked against the engine's vectors. Requests per
encoder execute come from the server's own metric (qwen_embed_encoder_requests_per_execute).
The engine alone (in this process, all texts per call) is the ceiling the table compares with.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
from harness import (
    RESULTS,
    cosine_check,
    drive,
    fmt,
    markdown_table,
    new_record,
    triton_sender,
    write_report,
)
from tokenizers import Tokenizer

from qwen_embed import Encoder
from qwen_embed.serving.config import DEMO_MODEL_DIR
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.triton import TritonServer

from workload import make_texts

PER_EXECUTE = "qwen_embed_encoder_requests_per_execute"


def executes(server: TritonServer) -> tuple[float, float]:
    """(requests, executes) the encoder has seen, from its requests-per-execute histogram."""
    return server.metric(PER_EXECUTE + "_sum"), server.metric(PER_EXECUTE + "_count")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(DEMO_MODEL_DIR))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--texts-per-request", type=int, default=8)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--texts", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "serving"))
    p.add_argument(
        "--encoder-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="encoder config parameter, e.g. attn_backend=flash_attn dtype=bfloat16",
    )
    args = p.parse_args()
    params = dict(item.split("=", 1) for item in args.encoder_param)
    per_request = args.texts_per_request

    texts = make_texts(args.texts, args.seed)
    tok = Tokenizer.from_file(str(Path(args.model_dir) / "tokenizer.json"))
    ids = [e.ids for e in tok.encode_batch(texts)]
    counts = np.array([len(i) for i in ids])
    engine_args = {k: params[k] for k in ("dtype", "device", "attn_backend") if k in params}
    with Encoder.from_pretrained(args.model_dir, **engine_args) as enc:
        device = str(enc.device)
        enc.embed(ids[:8])
        check = cosine_check(enc.embed(ids))

        def engine_sender():
            return lambda idx: (enc.embed([ids[i] for i in idx]), None)

        # The engine alone, in process: every text in one call, for as long as a level runs.
        engine = drive(
            engine_sender, counts, check, clients=1, per_request=len(ids), seconds=args.seconds
        )
    print(json.dumps({"engine_alone": engine}), flush=True)

    rows = []
    env = {"QWEN_EMBED_MODEL_DIR": str(Path(args.model_dir).resolve())}
    repo = render(
        tempfile.mkdtemp(prefix="bench-serving-"), {"embed": args.model_dir}, {"encoder": params}
    )
    with TritonServer(repo, env=env, log_path=Path("/tmp/bench_serving_triton.log")) as server:
        make = triton_sender(server.grpc_url, texts)
        drive(make, counts, check, clients=4, per_request=per_request, seconds=0, max_requests=8)
        for c in args.concurrency:
            before = executes(server)
            stats = drive(
                make, counts, check, clients=c, per_request=per_request, seconds=args.seconds
            )
            requests, runs = (a - b for a, b in zip(executes(server), before, strict=True))
            rows.append(
                {"concurrency": c, **stats, "requests_per_execute": requests / runs if runs else 0}
            )
            print(json.dumps(rows[-1]), flush=True)

    # Compare at 16 clients (the reference point) when that level ran.
    top = next((r for r in rows if r["concurrency"] == 16), rows[-1])
    ratio = top["tokens_per_s"] / engine["tokens_per_s"]
    record = new_record(encoder_params=params, device=device, levels=rows, engine_alone=engine)
    notes = [
        f"model: {args.model_dir}, encoder parameters {params or 'as shipped'}, "
        f"{per_request} texts per request, {args.seconds:.0f} s per level; texts: 80% 16-64 "
        "words, 20% 256-1024 words; every answer checked against the engine's vectors",
    ]
    header = [
        "clients",
        "requests",
        "failed",
        "texts/s",
        "tokens/s",
        "p50 s",
        "p99 s",
        "min cosine",
        "requests per encoder execute",
    ]
    table = markdown_table(
        header,
        [
            [
                r["concurrency"],
                r["requests"],
                r["failed_requests"],
                f"{r['texts_per_s']:.1f}",
                f"{r['tokens_per_s']:.0f}",
                fmt(r["p50_s"], ".2f"),  # None where every request of a level failed
                fmt(r["p99_s"], ".2f"),
                fmt(r["min_check"], ".5f"),
                f"{r['requests_per_execute']:.1f}",
            ]
            for r in rows
        ],
    )
    table += [
        "",
        f"Engine alone, in process, all {len(ids)} texts per call: "
        f"{engine['texts_per_s']:.1f} texts/s, {engine['tokens_per_s']:.0f} tokens/s; Triton "
        f"end to end at {top['concurrency']} clients = {ratio:.2f}x the engine.",
    ]
    title = "End to end through Triton (`embed` ensemble, gRPC) vs the engine alone"
    write_report(args.out, record, title, notes, table)


if __name__ == "__main__":
    main()
