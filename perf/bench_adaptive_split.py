"""Two servers of unequal speed: the client's adaptive split against an even split, timed.

    python bench_adaptive_split.py [--texts 96] [--slow-layers 12] [--repeats 3]

Each server is pinned to its own core (two "machines"); the slow one serves a deeper model.
The client measures each server's speed and sizes chunks by it; the even split sends half the
texts to each. Both are timed in the same run, alternately; the test suite only checks what
the scheduler decided (tests/test_client.py), since a loaded machine can flip a timing.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from harness import RESULTS, new_record, write_report

from qwen_embed_client import EmbeddingClient
from qwen_embed_deploy.demo import build_demo_model
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.triton import TritonServer


def even_split(fast: str, slow: str, texts: list[str]) -> float:
    half = len(texts) // 2
    with EmbeddingClient(fast) as a, EmbeddingClient(slow) as b:
        threads = [
            threading.Thread(target=a.embed, args=(texts[:half],)),
            threading.Thread(target=b.embed, args=(texts[half:],)),
        ]
        began = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - began


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--texts", type=int, default=96)
    p.add_argument("--slow-layers", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "adaptive_split"))
    args = p.parse_args()
    texts = [f"document {i} " + "about many things " * 12 for i in range(args.texts)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fast_model = build_demo_model(tmp / "fast-model", layers=3)
        slow_model = build_demo_model(tmp / "slow-model", layers=args.slow_layers, seed=2)
        fast = TritonServer(
            render(tmp / "fast", {"embed": fast_model}), cpus="0", log_path=tmp / "fast.log"
        )
        slow = TritonServer(
            render(tmp / "slow", {"embed": slow_model}), cpus="1", log_path=tmp / "slow.log"
        )
        with (
            fast,
            slow,
            EmbeddingClient([fast.grpc_url, slow.grpc_url], requests_in_flight=2) as client,
        ):
            client.embed(texts[:16])  # learn the speeds
            for _ in range(args.repeats):
                before = {u: s["texts_done"] for u, s in client.stats().items()}
                began = time.monotonic()
                client.embed(texts)
                adaptive = time.monotonic() - began
                split = {u: s["texts_done"] - before[u] for u, s in client.stats().items()}
                even = even_split(fast.grpc_url, slow.grpc_url, texts)
                rows.append(
                    {
                        "adaptive_s": adaptive,
                        "even_s": even,
                        "ratio": even / adaptive,
                        "fast_texts": split[fast.grpc_url],
                        "slow_texts": split[slow.grpc_url],
                    }
                )
                print(rows[-1], flush=True)
    table = [
        "| adaptive s | even split s | even / adaptive | texts to fast | texts to slow |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        table.append(
            f"| {r['adaptive_s']:.1f} | {r['even_s']:.1f} | {r['ratio']:.2f} | "
            f"{r['fast_texts']} | {r['slow_texts']} |"
        )
    note = (
        f"fast server: demo model (3 layers) on core 0; slow: {args.slow_layers} layers on "
        f"core 1; {args.texts} texts per job"
    )
    title = "Adaptive split over two unequal servers vs an even split"
    write_report(args.out, new_record(rows=rows), title, [note], table)


if __name__ == "__main__":
    main()
