"""Reranking throughput: pairs/s for one query with 100 mixed-length documents.

    python bench_rerank.py [--model-dir DIR] [--dtype auto] [--rounds 3] [--clients 1 4]

Through Triton (the `rerank` ensemble over gRPC) and through the gateway's /v1/rerank (both
started by the launcher, as `make serve` does), against transformers computing the same scores
in the same run: Qwen3-Reranker's model card code (padded batches, full logits at every
position) and the same with `logits_to_keep=1` (only the last position's logits). Documents are
perf/workload.py's mix (80% 16-64 words, 20% 256-1024). Every path's scores are checked against
transformers' (max abs difference in the table).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
from harness import RESULTS, drive, new_record, rerank_sender, score_check, write_report

from qwen_embed import ModelConfig
from qwen_embed.cpu import cpu_features
from qwen_embed.route import choose_route
from qwen_embed.settings import EncoderSettings
from qwen_embed_client.contract import DEFAULT_TASK
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.serving.rerank import TEXT_PAIRS, PairTokenizer, RerankOptions
from qwen_embed_deploy.triton import TritonServer, free_port

from workload import make_texts

REPO = Path(__file__).resolve().parents[1]
QUERY = "which of these passages says the most about what they would have done first"


def ensure_reranker(path: Path, layers: int) -> Path:
    if not (path / "config.json").is_file():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "qwen_embed_deploy.demo",
                str(path),
                "--layers",
                str(layers),
                "--reranker",
            ],
            check=True,
        )
    return path


def transformers_scores(
    model_dir: Path, documents: list[str], dtype: torch.dtype, batch_size: int, last_only: bool
) -> tuple[np.ndarray, float]:
    """The model card's recipe: left-padded batches, logits at the last position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    prefix = tok.encode(TEXT_PAIRS.prefix, add_special_tokens=False)
    suffix = tok.encode(TEXT_PAIRS.suffix, add_special_tokens=False)
    scores = []
    began = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(documents), batch_size):
            pairs = [
                TEXT_PAIRS.pieces(DEFAULT_TASK, QUERY, d)[0]
                for d in documents[start : start + batch_size]
            ]
            enc = tok(
                pairs,
                padding=False,
                truncation="longest_first",
                return_attention_mask=False,
                max_length=8192 - len(prefix) - len(suffix),
            )
            ids = [prefix + x + suffix for x in enc["input_ids"]]
            batch = tok.pad({"input_ids": ids}, padding=True, return_tensors="pt")
            kwargs = {"logits_to_keep": 1} if last_only else {}
            logits = model(**batch, **kwargs).logits[:, -1, :].float()
            pair = torch.stack([logits[:, no], logits[:, yes]], dim=1)
            scores.append(torch.softmax(pair, dim=1)[:, 1])
    return torch.cat(scores).numpy(), time.perf_counter() - began


def gateway_sender(base: str, documents: list[str]):
    """POST /v1/rerank with the documents of each request: (scores in document order, None)."""

    def make():
        def send(idx):
            body = {"model": "rerank", "query": QUERY, "documents": [documents[i] for i in idx]}
            request = urllib.request.Request(
                f"{base}/v1/rerank", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=1800) as r:
                results = json.loads(r.read())["results"]
            scores = np.empty(len(idx), dtype=np.float32)
            for item in results:
                scores[item["index"]] = item["relevance_score"]
            return scores, None

        return send

    return make


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-reranker-4l"))
    p.add_argument("--layers", type=int, default=4, help="when the model is built here")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--documents", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--out", default=str(RESULTS / "rerank"))
    args = p.parse_args()

    model_dir = ensure_reranker(Path(args.model_dir).resolve(), args.layers)
    documents = make_texts(args.documents, seed=7)
    settings = EncoderSettings(dtype=args.dtype, task="rerank")
    route = choose_route(settings, ModelConfig.from_dir(model_dir), "cpu", cpu_features())
    dtype = getattr(torch, route.dtype)
    pairs = PairTokenizer(model_dir, 8192).encode(QUERY, documents, RerankOptions())
    counts = np.array([len(x) for x in pairs])  # tokens of each (query, document) pair
    rows = []
    reference = None
    for keep_last_only in (False, True):
        name = "transformers, last logits only" if keep_last_only else "transformers (model card)"
        scores, seconds = transformers_scores(
            model_dir, documents, dtype, args.hf_batch_size, keep_last_only
        )
        reference = scores if reference is None else reference
        rows.append(
            {
                "path": name,
                "clients": 1,
                "pairs_per_s": len(documents) / seconds,
                "max_abs": float(np.abs(scores - reference).max()),
            }
        )
        print(rows[-1], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        repo = render(
            Path(tmp) / "repo",
            {},
            {"encoder": {"dtype": route.dtype}},
            rerankers={"rerank": model_dir},
        )
        port = free_port()
        with TritonServer(
            repo, log_path=Path(tmp) / "server.log", launcher_args=["--gateway-port", str(port)]
        ) as server:
            base = f"http://127.0.0.1:{port}"
            for _ in range(60):  # the gateway starts once Triton is ready
                try:
                    urllib.request.urlopen(f"{base}/health", timeout=2)
                    break
                except OSError:
                    time.sleep(0.5)
            paths = {
                "Triton rerank ensemble (gRPC)": rerank_sender(server.grpc_url, QUERY, documents),
                "gateway /v1/rerank": gateway_sender(base, documents),
            }
            check = score_check(reference)
            n = len(documents)
            for name, make in paths.items():
                drive(make, counts, check, clients=1, per_request=4, seconds=0, max_requests=1)
                for clients in args.clients:
                    stats = drive(
                        make,
                        counts,
                        check,
                        clients=clients,
                        per_request=n,
                        seconds=0,
                        max_requests=clients * args.rounds,
                    )
                    rows.append(
                        {
                            "path": name,
                            "clients": clients,
                            "pairs_per_s": stats["texts_per_s"],
                            "max_abs": 1.0 - stats["min_check"],
                            "stats": stats,
                        }
                    )
                    print(rows[-1], flush=True)
    card = rows[0]["pairs_per_s"]
    best_hf = max(rows[0]["pairs_per_s"], rows[1]["pairs_per_s"])
    record = new_record(
        model=str(model_dir), dtype=route.dtype, documents=args.documents, rows=rows
    )
    table = [
        "| path | clients | pairs/s | x model card | x best transformers | max abs vs card |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        table.append(
            f"| {r['path']} | {r['clients']} | {r['pairs_per_s']:.1f} | "
            f"{r['pairs_per_s'] / card:.2f} | {r['pairs_per_s'] / best_hf:.2f} | "
            f"{r['max_abs']:.2e} |"
        )
    note = (
        f"model: {model_dir.name} (Qwen3-Reranker-0.6B shape, {args.layers} layers, random "
        f"weights), dtype {route.dtype}; {args.documents} documents (perf/workload.py mix) "
        f"per request, {args.rounds} requests per client; transformers in padded batches "
        f"of {args.hf_batch_size}"
    )
    write_report(
        args.out, record, "Reranking: pairs/s, one query with mixed-length documents", [note], table
    )


if __name__ == "__main__":
    main()
