"""1-text queries through the gateway while an OpenAI Batch API batch runs, against no batch
running, in one run.

    python bench_batch.py [--seconds 60] [--query-clients 2] [--lines 4000] [--texts-per-line 16]

One server (this checkout, the demo model, dtype auto, `make serve`'s launcher with its
gateway; the Batch API's state in a temporary directory). Query clients send 1-text
`/v1/embeddings` requests of 4-30 words in a closed loop, first with nothing else running,
then while a batch of `--lines` lines of `--texts-per-line` texts of the perf mix
(perf/workload.py) runs at the bulk priority level; the latency of every query is kept, and the
batch's texts/s over the same window. Results: perf/results/batch.{md,json}.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import threading
import time

import numpy as np
import openai
from harness import RESULTS, markdown_table, new_record, write_report

from qwen_embed_deploy.triton import TritonServer, free_port

from bench_peers import REPO
from workload import WORDS, make_texts

DEMO = REPO / ".cache" / "demo-model"


def queries_for(api: openai.OpenAI, seconds: float, clients: int) -> list[float]:
    rng = np.random.default_rng(5)
    queries = [" ".join(rng.choice(WORDS, size=int(k))) for k in rng.integers(4, 31, 4096)]
    stop, latencies = threading.Event(), []

    def query(k: int) -> None:
        i = k
        while not stop.is_set():
            start = time.perf_counter()
            api.embeddings.create(model="embed", input=queries[i % len(queries)])
            latencies.append(time.perf_counter() - start)
            i += clients

    threads = [threading.Thread(target=query, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return latencies


def summary(latencies: list[float]) -> dict:
    ms = np.array(latencies) * 1e3
    return {
        "queries": len(ms),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
    }


def submit(api: openai.OpenAI, lines: int, per_line: int) -> str:
    texts = make_texts(lines * per_line, seed=3)
    body = "".join(
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "embed", "input": texts[i * per_line : (i + 1) * per_line]},
            }
        )
        + "\n"
        for i in range(lines)
    )
    source = api.files.create(file=("bench.jsonl", io.BytesIO(body.encode())), purpose="batch")
    batch = api.batches.create(
        input_file_id=source.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    return batch.id


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--query-clients", type=int, default=2)
    p.add_argument("--lines", type=int, default=4000)
    p.add_argument("--texts-per-line", type=int, default=16)
    p.add_argument("--out", default=str(RESULTS / "batch"))
    args = p.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as state:
        env = {"QWEN_EMBED_MODEL_DIR": str(DEMO), "QWEN_EMBED_BATCH_DIR": state}
        launcher = ["--no-rerank", "--gateway-port", str(port)]
        with TritonServer(REPO / "model_repository", env=env, launcher_args=launcher):
            api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
            for _ in range(3):  # warm-up
                api.embeddings.create(model="embed", input=["warm up"] * 8)
            alone = summary(queries_for(api, args.seconds, args.query_clients))
            print("no batch", alone, flush=True)
            batch_id = submit(api, args.lines, args.texts_per_line)
            while api.batches.retrieve(batch_id).request_counts.completed == 0:
                time.sleep(0.2)
            start_count = api.batches.retrieve(batch_id).request_counts.completed
            start = time.monotonic()
            during = summary(queries_for(api, args.seconds, args.query_clients))
            done = api.batches.retrieve(batch_id)
            lines_done = done.request_counts.completed - start_count
            during["batch_texts_per_s"] = (
                lines_done * args.texts_per_line / (time.monotonic() - start)
            )
            still_running = done.status == "in_progress"
            print("batch running", during, "still running:", still_running, flush=True)
            api.batches.cancel(batch_id)
    results = {"no batch": alone, "a batch running": during}
    record = new_record(
        seconds=args.seconds,
        query_clients=args.query_clients,
        lines=args.lines,
        texts_per_line=args.texts_per_line,
        batch_still_running_at_the_end=still_running,
        results=results,
    )
    rows = [
        [
            name,
            r["queries"],
            f"{r['p50_ms']:.0f}",
            f"{r['p99_ms']:.0f}",
            f"{r['mean_ms']:.0f}",
            f"{r['batch_texts_per_s']:.1f}" if "batch_texts_per_s" in r else "",
        ]
        for name, r in results.items()
    ]
    table = markdown_table(
        ["gateway", "1-text queries", "p50 ms", "p99 ms", "mean ms", "batch texts/s"], rows
    )
    notes = [
        f"{args.query_clients} query clients x 1 text through /v1/embeddings, {args.seconds:.0f}"
        " s with no batch, then the same while a Batch API batch runs at the bulk priority level",
        f"the batch: {args.lines} lines x {args.texts_per_line} texts of the perf mix; it was "
        + ("still running" if still_running else "done")
        + " when the second window ended; demo model, dtype auto",
    ]
    write_report(args.out, record, "1-text queries while a batch runs", notes, table)


if __name__ == "__main__":
    main()
