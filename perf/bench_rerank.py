"""Reranking throughput: pairs/s for one query with 100 mixed-length documents.

    python bench_rerank.py [--model-dir DIR] [--dtype auto] [--rounds 3] [--clients 1 4]
        [--vllm] [--llama]
    python bench_rerank.py --listwise [--documents 32] ...

Through Triton (the `rerank` ensemble over gRPC) and through the gateway's /v1/rerank (both
started by the launcher, as `make serve` does), against transformers computing the same scores
in the same run: Qwen3-Reranker's model card code (padded batches, full logits at every
position) and the same with `logits_to_keep=1` (only the last position's logits). Documents are
perf/workload.py's mix (80% 16-64 words, 20% 256-1024). Every path's scores are checked against
transformers' (max abs difference in the table). `--vllm`, `--llama`: peers serving the same
checkpoint as their docs serve Qwen3-Reranker (vLLM's CPU build; llama.cpp's llama-server on the
GGUF file its converter writes), beside the Triton ensemble, all with new documents in every
request.

`--listwise`: a listwise reranker (jina-reranker-v3's layout at the same shape, built here from
the same random weights plus its markers and projector): documents/s through the Triton
ensemble against its own `rerank`'s work on transformers (one forward per block of the same
token ids, the projector at the markers, the blocks merged), and beside it the pointwise
reranker through Triton on the same documents.
"""

from __future__ import annotations

import argparse
import json
import shutil
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
from qwen_embed.config import LISTWISE_MARKERS
from qwen_embed.cpu import cpu_features
from qwen_embed.heads import listwise_scores
from qwen_embed.route import choose_route
from qwen_embed.settings import EncoderSettings
from qwen_embed_client.contract import DEFAULT_TASK
from qwen_embed_deploy.demo import make_listwise
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.serving.listwise import BlockTokenizer
from qwen_embed_deploy.serving.rerank import TEXT_PAIRS, PairTokenizer, RerankOptions
from qwen_embed_deploy.triton import TritonServer, free_port

from bench_peers import VLLM_QWEN3_RERANKER, installed, llama_cpp, peer_server
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


def client_rows(
    name: str, make, counts, check, args, rate: str, per_request: int | None = None
) -> list[dict]:
    """After one warm-up request, a row per client count: `rate` (documents per second) over
    requests of `per_request` documents (None: every document), `args.rounds` per client; the
    largest score difference. Requests take the documents in turn, so that from a pool of
    (1 + rounds x clients summed) requests' documents every request has its own."""
    n = per_request or len(counts)
    drive(make, counts, None, clients=1, per_request=n, seconds=0, max_requests=1)
    rows, sent = [], 1
    for clients in args.clients:
        stats = drive(
            make,
            counts,
            check,
            clients=clients,
            per_request=n,
            seconds=0,
            first_request=sent,
            max_requests=clients * args.rounds,
        )
        sent += clients * args.rounds
        max_abs = None if check is None else 1.0 - stats["min_check"]
        rows.append(
            {"path": name, "clients": clients, rate: stats["texts_per_s"], "max_abs": max_abs}
            | {"stats": stats}
        )
        print(rows[-1], flush=True)
    return rows


def ensure_listwise(path: Path, pointwise: Path) -> Path:
    """jina-reranker-v3's layout (`JinaForRanking`) from the pointwise reranker's weights
    (demo.make_listwise)."""
    if not (path / "config.json").is_file():
        shutil.copytree(pointwise, path, dirs_exist_ok=True)
        make_listwise(path)
    return path


def transformers_listwise(
    model_dir: Path, blocks: list[list[int]], dtype: torch.dtype
) -> tuple[np.ndarray, float]:
    """Its own `rerank`'s work on transformers: a forward per block (as its code runs them,
    one at a time), the projector at the markers, the blocks merged."""
    from safetensors import safe_open
    from tokenizers import Tokenizer
    from transformers import Qwen3Model

    model = Qwen3Model.from_pretrained(model_dir, dtype=dtype).eval()
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        w0, w2 = (f.get_tensor(f"projector.{i}.weight").to(dtype) for i in (0, 2))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    document, query = (tok.token_to_id(t) for t in LISTWISE_MARKERS)
    vectors = []
    began = time.perf_counter()
    with torch.inference_mode():
        for ids in blocks:
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            ids = torch.tensor(ids)
            rows = torch.cat([hidden[ids == document], hidden[ids == query]])
            vectors.append((torch.relu(rows @ w0.T) @ w2.T).float().numpy())
    return listwise_scores(vectors), time.perf_counter() - began


def listwise(args, pointwise: Path) -> None:
    model_dir = ensure_listwise(
        Path(args.model_dir).resolve().with_name("bench-jina-4l"), pointwise
    )
    documents = make_texts(args.documents, seed=7)
    settings = EncoderSettings(dtype=args.dtype, task="rerank")
    route = choose_route(settings, ModelConfig.from_dir(model_dir), "cpu", cpu_features())
    rows = BlockTokenizer(model_dir, 32768).encode(QUERY, documents, RerankOptions())
    blocks = [r for r in rows if r]
    counts = np.array([len(r) for r in rows])
    reference, seconds = transformers_listwise(model_dir, blocks, getattr(torch, route.dtype))
    table_rows = [
        {
            "path": "transformers (its rerank)",
            "clients": 1,
            "docs_per_s": len(documents) / seconds,
            "max_abs": 0.0,
        }
    ]
    print(table_rows[-1], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        repo = render(
            Path(tmp) / "repo",
            {},
            {"encoder": {"dtype": route.dtype}},
            rerankers={"rerank": pointwise, "jina": model_dir},
        )
        with TritonServer(repo, log_path=Path(tmp) / "server.log") as server:
            paths = {
                "Triton, listwise": ("jina", score_check(reference)),
                "Triton, pointwise (Qwen3-Reranker layout)": ("rerank", None),
            }
            for name, (model, check) in paths.items():
                make = rerank_sender(server.grpc_url, QUERY, documents, model)
                table_rows += client_rows(name, make, counts, check, args, "docs_per_s")
    base = table_rows[0]["docs_per_s"]
    record = new_record(
        model=str(model_dir),
        dtype=route.dtype,
        documents=args.documents,
        rows=table_rows,
        blocks=[len(b) for b in blocks],
    )
    table = [
        "| path | clients | documents/s | x transformers | max abs vs transformers |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in table_rows:
        diff = "n/a" if r["max_abs"] is None else f"{r['max_abs']:.2e}"
        table.append(
            f"| {r['path']} | {r['clients']} | {r['docs_per_s']:.1f} | "
            f"{r['docs_per_s'] / base:.2f} | {diff} |"
        )
    note = (
        f"model: {model_dir.name} (jina-reranker-v3's layout at Qwen3-0.6B's shape, "
        f"{args.layers} layers, random weights), dtype {route.dtype}; {args.documents} documents "
        f"(perf/workload.py mix) per request in {len(blocks)} block(s) of "
        f"{', '.join(str(len(b)) for b in blocks)} tokens; {args.rounds} requests per client"
    )
    write_report(
        args.out, record, "Listwise reranking: documents/s, one query per request", [note], table
    )


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


def http_sender(url: str, documents: list[str], query: str = QUERY):
    """POST a rerank request (Cohere's form, which our gateway and vLLM take) with the
    documents of each request: (scores in document order, the tokens its usage counts)."""

    def make():
        def send(idx):
            body = {"model": "rerank", "query": query, "documents": [documents[i] for i in idx]}
            request = urllib.request.Request(
                url, json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=1800) as r:
                answer = json.loads(r.read())
            scores = np.empty(len(idx), dtype=np.float32)
            for item in answer["results"]:
                scores[item["index"]] = item["relevance_score"]
            return scores, answer.get("usage", {}).get("total_tokens")

        return send

    return make


def vllm_texts(documents: list[str]) -> tuple[str, list[str]]:
    """The query and documents as vLLM's docs format them for Qwen3-Reranker (the template's
    head with the query, each document with its tail): our template split where the document
    begins, so that the two tokenized apart are our pair's tokens."""
    whole = [TEXT_PAIRS.pieces(DEFAULT_TASK, QUERY, d)[0] for d in documents]
    query = whole[0][: whole[0].index("<Document>:")]
    return TEXT_PAIRS.prefix + query, [w[len(query) :] + TEXT_PAIRS.suffix for w in whole]


# peer system -> (its rows' label, how its request carries the query and documents)
PEERS = {
    "vllm": ("vLLM /rerank (CPU build)", vllm_texts),
    "llama-best": ("llama.cpp /v1/rerank, output head skipped", lambda d: (QUERY, d)),
    "llama": ("llama.cpp /v1/rerank as built", lambda d: (QUERY, d)),
}


def peer_rows(
    system: str, model_dir: Path, dtype: str, documents, reference, pool, pool_counts, args
):
    """A peer serving the same checkpoint as its docs serve Qwen3-Reranker: vLLM's CPU build
    (prefix caching on, its default) sent `vllm_texts`; llama.cpp's llama-server on the GGUF
    file its own converter writes (the head's "yes" and "no" rows, its rerank template) sent
    the query and documents as they are. One request of the reference's documents for the
    score difference, then the pool's rows."""
    if system == "vllm" and installed("vllm") is None:
        print("vllm: not installed (perf/peers/install.sh vllm)", flush=True)
        return []
    if system.startswith("llama") and not (llama_cpp.ROOT / "versions.txt").is_file():
        print("llama.cpp: not installed (perf/peers/install_llama_cpp.sh)", flush=True)
        return []
    label, texts_of = PEERS[system]
    port = free_port()
    server, endpoint = peer_server(system, model_dir, dtype, port, "on", reranker=True)
    try:
        server.start(timeout=600)
        url = f"http://127.0.0.1:{port}{endpoint}"
        query, texts = texts_of(documents)
        scores, _ = http_sender(url, texts, query)()(list(range(len(texts))))
        max_abs = float(np.abs(scores - reference).max())
        query, texts = texts_of(pool)
        name = f"{label}, new documents per request"
        rows = client_rows(
            name,
            http_sender(url, texts, query),
            pool_counts,
            None,
            args,
            "pairs_per_s",
            len(documents),
        )
    finally:
        server.stop()
    for row in rows:
        row["max_abs"] = max_abs
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-reranker-4l"))
    p.add_argument("--layers", type=int, default=4, help="when the model is built here")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--documents", type=int, default=None, help="100; listwise 32")
    p.add_argument("--listwise", action="store_true", help="a listwise reranker (jina's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument(
        "--vllm",
        action="store_true",
        help="also vLLM's CPU build (perf/peers/install.sh vllm) beside the Triton ensemble, "
        "both with new documents in every request",
    )
    p.add_argument(
        "--llama",
        action="store_true",
        help="also llama.cpp's llama-server (perf/peers/install_llama_cpp.sh), as built and "
        "with its output head skipped, on the GGUF file its converter writes, as --vllm",
    )
    p.add_argument("--out", default=str(RESULTS / "rerank"))
    args = p.parse_args()
    if args.documents is None:
        args.documents = 32 if args.listwise else 100
    model_dir = ensure_reranker(Path(args.model_dir).resolve(), args.layers)
    if args.listwise:
        if args.out == p.get_default("out"):
            args.out = str(RESULTS / "rerank-listwise")
        listwise(args, model_dir)
        return
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
    peers = (["vllm"] if args.vllm else []) + (["llama-best", "llama"] if args.llama else [])
    if peers:  # every request its own documents: no peer reuses a pair it has seen
        pool = make_texts(args.documents * (1 + args.rounds * sum(args.clients)), seed=11)
        pool_counts = np.array(
            [len(x) for x in PairTokenizer(model_dir, 8192).encode(QUERY, pool, RerankOptions())]
        )
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
                "gateway /v1/rerank": http_sender(f"{base}/v1/rerank", documents),
            }
            check = score_check(reference)
            for name, make in paths.items():
                rows += client_rows(name, make, counts, check, args, "pairs_per_s")
            if peers:
                name = "Triton rerank ensemble (gRPC), new documents per request"
                make = rerank_sender(server.grpc_url, QUERY, pool)
                rows += client_rows(
                    name, make, pool_counts, None, args, "pairs_per_s", args.documents
                )
    for system in peers:
        rows += peer_rows(
            system, model_dir, route.dtype, documents, reference, pool, pool_counts, args
        )
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
        diff = "n/a" if r["max_abs"] is None else f"{r['max_abs']:.2e}"
        table.append(
            f"| {r['path']} | {r['clients']} | {r['pairs_per_s']:.1f} | "
            f"{r['pairs_per_s'] / card:.2f} | {r['pairs_per_s'] / best_hf:.2f} | {diff} |"
        )
    note = (
        f"model: {model_dir.name} (Qwen3-Reranker-0.6B shape, {args.layers} layers, random "
        f"weights), dtype {route.dtype}; {args.documents} documents (perf/workload.py mix) "
        f"per request, {args.rounds} requests per client; transformers in padded batches "
        f"of {args.hf_batch_size}"
    )
    notes = [note]
    ours = {r["clients"]: r for r in rows if r["path"].startswith("Triton rerank ensemble (gRPC),")}
    how = {
        "vllm": f"vLLM: {', '.join(installed('vllm') or [])}; Qwen3-Reranker as its docs serve "
        f"it (`--runner pooling --hf-overrides {VLLM_QWEN3_RERANKER}`, prefix caching on as by "
        "default, both cores to its engine), the query and documents formatted as its docs' "
        "example does",
        "llama-best": f"llama.cpp: {'; '.join(llama_cpp.versions().splitlines())}; "
        "`llama-server --reranking` on the "
        "GGUF file its own convert_hf_to_gguf.py writes of the checkpoint (the output head's "
        '"yes" and "no" rows, its rerank template), at the run\'s dtype, the server flags '
        "of bench_peers' llama systems; the query and documents sent as they are; `as built` "
        "computes the output head it throws away, `output head skipped` is the patched build",
    }
    for system in peers:
        label = PEERS[system][0]
        peer = [r for r in rows if r["path"].startswith(label)]
        if not peer:
            continue
        if system in how:
            notes.append(how[system])
        notes.append(
            f"{label}: the tokens its usage counts over ours: "
            + ", ".join(f"{r['stats']['server_tokens_ratio']:.3f}" for r in peer)
            + "; ours (prefix reuse auto) and it on the same new documents in every request "
            "(a pool of perf/workload.py's mix, seed 11): ours over it "
            + ", ".join(
                f"{ours[r['clients']]['pairs_per_s'] / r['pairs_per_s']:.2f}x at "
                f"{r['clients']} client(s)"
                for r in peer
            )
        )
    write_report(
        args.out, record, "Reranking: pairs/s, one query with mixed-length documents", notes, table
    )


if __name__ == "__main__":
    main()
