"""End-to-end throughput of the `embed` ensemble on a real tritonserver vs the engine alone.

    python perf/bench_serving.py [--concurrency 1 16 64] [--seconds 20]

Texts (seeded): 80% of 16-64 words and 20% of 256-1024 words drawn from common English words
that are one Qwen token each, so a text of N words is about N + 1 tokens. Each request carries
--texts-per-request texts; every client (a thread with its own gRPC client) sends requests
back to back for --seconds. Requests per encoder execute come from the server's own metric
(qwen_embed_encoder_requests_per_execute). Then the server is stopped and the engine embeds
the texts the server embedded at 16 clients, in one call, in this process.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tokenizers import Tokenizer

from qwen_embed import Encoder
from qwen_embed.serving.config import DEMO_MODEL_DIR
from qwen_embed.serving.repository import render
from qwen_embed.serving.triton import TritonServer

from workload import RESULTS, command_line, machine, make_texts, stamp


def metric(server: TritonServer, name: str) -> tuple[float, float]:
    text = urllib.request.urlopen(server.metrics_url).read().decode()
    total = float(re.search(rf"^{name}_sum{{[^}}]*}} (\S+)", text, re.M).group(1))
    count = float(re.search(rf"^{name}_count{{[^}}]*}} (\S+)", text, re.M).group(1))
    return total, count


def run_level(server, texts, concurrency, per_request, seconds):
    """Clients send back to back until the deadline; returns stats and the texts embedded."""
    done, latencies, sent = [], [], []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client(i):
        c = grpcclient.InferenceServerClient(server.grpc_url)
        k = i * 7919
        while time.monotonic() < stop_at:
            batch = [texts[(k + j) % len(texts)] for j in range(per_request)]
            k += per_request * concurrency
            inp = grpcclient.InferInput("TEXT", [per_request, 1], "BYTES")
            inp.set_data_from_numpy(np.array([[t.encode()] for t in batch], dtype=object))
            start = time.perf_counter()
            result = c.infer("embed", [inp])
            elapsed = time.perf_counter() - start
            with lock:
                done.append(int(result.as_numpy("TOKEN_COUNT").sum()))
                latencies.append(elapsed)
                sent.extend(batch)

    before = metric(server, "qwen_embed_encoder_requests_per_execute")
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = metric(server, "qwen_embed_encoder_requests_per_execute")
    executes = after[1] - before[1]
    return {
        "concurrency": concurrency,
        "requests": len(done),
        "texts": len(done) * per_request,
        "tokens": sum(done),
        "seconds": wall,
        "texts_per_s": len(done) * per_request / wall,
        "tokens_per_s": sum(done) / wall,
        "p50_ms": 1000 * float(np.percentile(latencies, 50)),
        "p99_ms": 1000 * float(np.percentile(latencies, 99)),
        "requests_per_execute": (after[0] - before[0]) / executes if executes else 0.0,
    }, sent


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

    texts = make_texts(args.texts, args.seed)
    rows, sent = [], {}
    env = {"QWEN_EMBED_MODEL_DIR": str(Path(args.model_dir).resolve())}
    repo = render(
        tempfile.mkdtemp(prefix="bench-serving-"), {"embed": args.model_dir}, {"encoder": params}
    )
    with TritonServer(repo, env=env, log_path=Path("/tmp/bench_serving_triton.log")) as server:
        run_level(server, texts, 4, args.texts_per_request, 3)  # warm-up
        for c in args.concurrency:
            row, sent[c] = run_level(server, texts, c, args.texts_per_request, args.seconds)
            rows.append(row)
            print(json.dumps(row), flush=True)

    # Compare at 16 clients (the reference point) when that level ran.
    top = next((r for r in rows if r["concurrency"] == 16), rows[-1])
    tok = Tokenizer.from_file(str(Path(args.model_dir) / "tokenizer.json"))
    ids = [e.ids for e in tok.encode_batch(sent[top["concurrency"]])]
    engine_args = {k: params[k] for k in ("dtype", "device", "attn_backend") if k in params}
    with Encoder.from_pretrained(args.model_dir, **engine_args) as enc:
        enc.embed(ids[:8])
        start = time.perf_counter()
        enc.embed(ids)
        engine_s = time.perf_counter() - start
    tokens = sum(map(len, ids))
    engine = {
        "texts": len(ids),
        "tokens": tokens,
        "texts_per_s": len(ids) / engine_s,
        "tokens_per_s": tokens / engine_s,
    }
    print(json.dumps({"engine_alone": engine}), flush=True)

    date, command = stamp(), command_line()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "date": date,
                "machine": machine(),
                "command": command,
                "encoder_params": params,
                "levels": rows,
                "engine_alone": engine,
            },
            indent=2,
        )
    )
    lines = [
        "# End to end through Triton (`embed` ensemble, gRPC) vs the engine alone",
        "",
        f"- date: {date}",
        f"- machine: {machine()}",
        f"- command: `{command}`",
        f"- model: {args.model_dir}, fp32 on CPU, {args.texts_per_request} texts per request, "
        f"{args.seconds:.0f} s per level; texts: 80% 16-64 words, 20% 256-1024 words",
        "",
        "| clients | requests | texts/s | tokens/s | p50 ms | p99 ms "
        "| requests per encoder execute |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {r['texts_per_s']:.1f} "
            f"| {r['tokens_per_s']:.0f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} "
            f"| {r['requests_per_execute']:.1f} |"
        )
    ratio = top["tokens_per_s"] / engine["tokens_per_s"]
    lines += [
        "",
        f"Engine alone, in process, on the {engine['texts']} texts served at "
        f"{top['concurrency']} clients: {engine['texts_per_s']:.1f} texts/s, "
        f"{engine['tokens_per_s']:.0f} tokens/s; Triton end to end at "
        f"{top['concurrency']} clients = {ratio:.2f}x the engine.",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
