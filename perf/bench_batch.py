"""1-text queries through the gateway while an OpenAI Batch API batch runs, against no batch
running, in one run.

    python bench_batch.py [--seconds 60] [--query-clients 2] [--lines 4000]
                          [--texts-per-line 16] [--texts-in-flight 16,256]

One server (this checkout through the launcher, the demo model, dtype auto) and a gateway in
front of it, started once per value of its --batch-texts-in-flight (the Batch API's state in a
temporary directory). Query clients send 1-text `/v1/embeddings` requests of 4-30 words in a
closed loop, first with nothing else running, then while a batch of `--lines` lines of
`--texts-per-line` texts of the perf mix (perf/workload.py) runs at the bulk priority level;
the latency of every query is kept, and the batch's texts/s over the same window. Results:
perf/results/batch.{md,json}.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
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


class Gateway:
    """A gateway process in front of `server` with its own Batch API state."""

    def __init__(self, server: TritonServer, texts_in_flight: int, state: str):
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "qwen_embed_client.gateway", "--triton-url", server.grpc_url]
            + ["--port", str(self.port), "--rerank-model-name", "", "--batch-dir", state]
            + ["--batch-texts-in-flight", str(texts_in_flight)]
        )
        self.api = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused")
        deadline = time.monotonic() + 60
        while True:
            try:
                self.api.models.list()
                return
            except openai.APIConnectionError:
                assert time.monotonic() < deadline and self.process.poll() is None
                time.sleep(0.3)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def during_batch(api: openai.OpenAI, args) -> dict:
    """Query latency while a batch runs, and the batch's texts/s over the same window."""
    batch_id = submit(api, args.lines, args.texts_per_line)
    while api.batches.retrieve(batch_id).request_counts.completed == 0:
        time.sleep(0.2)
    start_count = api.batches.retrieve(batch_id).request_counts.completed
    start = time.monotonic()
    result = summary(queries_for(api, args.seconds, args.query_clients))
    done = api.batches.retrieve(batch_id)
    lines = done.request_counts.completed - start_count
    result["batch_texts_per_s"] = lines * args.texts_per_line / (time.monotonic() - start)
    result["batch_still_running"] = done.status == "in_progress"
    api.batches.cancel(batch_id)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--query-clients", type=int, default=2)
    p.add_argument("--lines", type=int, default=4000)
    p.add_argument("--texts-per-line", type=int, default=16)
    p.add_argument(
        "--texts-in-flight",
        default="16,256",
        help="the gateway's --batch-texts-in-flight values to compare, comma separated",
    )
    p.add_argument("--out", default=str(RESULTS / "batch"))
    args = p.parse_args()
    results = {}
    env = {"QWEN_EMBED_MODEL_DIR": str(DEMO)}
    with TritonServer(REPO / "model_repository", env=env, launcher_args=["--no-rerank"]) as s:
        for n in [int(x) for x in args.texts_in_flight.split(",")]:
            with tempfile.TemporaryDirectory() as state:
                gateway = Gateway(s, n, state)
                try:
                    if not results:  # the baseline, once
                        for _ in range(3):  # warm-up
                            gateway.api.embeddings.create(model="embed", input=["warm up"] * 8)
                        alone = summary(queries_for(gateway.api, args.seconds, args.query_clients))
                        results["no batch"] = alone
                        print("no batch", alone, flush=True)
                    name = f"a batch running, {n} texts in flight"
                    results[name] = during_batch(gateway.api, args)
                    print(name, results[name], flush=True)
                finally:
                    gateway.stop()
    record = new_record(
        seconds=args.seconds,
        query_clients=args.query_clients,
        lines=args.lines,
        texts_per_line=args.texts_per_line,
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
        " s with no batch, then the same while a Batch API batch runs at the bulk priority level, "
        "once per value of the gateway's --batch-texts-in-flight",
        f"the batch: {args.lines} lines x {args.texts_per_line} texts of the perf mix, cancelled "
        "after each window; demo model, dtype auto",
    ]
    write_report(args.out, record, "1-text queries while a batch runs", notes, table)


if __name__ == "__main__":
    main()
