"""Less work per vector: shared-prefix reuse and last-layer pruning, on vs off in one run.

    python bench_prefix.py [--seconds 30] [--rounds 3] [--deep-layers 28] [--deep-texts 24]
                           [--workloads 1-text 32-text documents] [--drivers python perf_analyzer]
                           [--no-pruning] [--no-engine] [--vllm QUERIES]

Through Triton (two servers up at once, encoder prefix_reuse "auto" vs "off", dtype auto, taking
turns in rounds so that the machine's drift falls on both):
- query workload: Qwen3-Embedding's default instruction + queries of 4-30 words (one token
  each), as 1-text requests from 16 clients and as 32-text requests from 4 clients;
- document workload: perf/workload.py's mix, no shared prefix (the detection's cost).
Two load generators on the same two cores as the server: `python` (the client threads of
bench_peers, which also check every vector against the engine's) and `perf_analyzer` (C++,
much less CPU per request: closer to clients on other machines; tokens/s from the server's
own token count over a fixed window). tokens/s count the tokens users sent; the server's own
metrics give tokens computed per token received and the prefix cache hit rate.
In process (the engine alone): reuse on vs off for forwards of 1-32 queries each (what the
Triton ratio can at most reach with the batches Triton forms), and last-layer pruning on vs
off on the document workload with the demo model's 3 layers and with Qwen3-Embedding-0.6B's
28-layer shape (random weights, fewer texts).
`--vllm QUERIES`: under each query case's load, our server (reuse auto) beside vLLM's CPU build
(prefix caching on, its default) over QUERIES new queries, the same for both (vLLM keeps every
block it computed: a query it had seen would cost it next to nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import (
    REPO,
    RESULTS,
    cosine_check,
    drive,
    ensure_model,
    new_record,
    openai_sender,
    triton_sender,
    write_report,
)
from tokenizers import Tokenizer

from qwen_embed import Encoder, ModelConfig
from qwen_embed.batch import flatten
from qwen_embed.cpu import cpu_features
from qwen_embed.route import choose_route
from qwen_embed.settings import EncoderSettings
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.triton import TritonServer, execute_seconds, free_port, metric_sum, scrape

from bench_peers import installed, peer_server
from workload import alternate, alternate_forwards, make_queries, make_texts

sys.path.insert(0, str(Path(__file__).resolve().parent / "perf_analyzer"))
from sweep import PERF_ANALYZER, wait_idle  # noqa: E402

METRICS = (
    "qwen_embed_tokens_total",
    "qwen_embed_tokens_computed_total",
    "qwen_embed_prefix_cache_hits_total",
    "qwen_embed_prefix_cache_lookups_total",
)


BUSY = ("tokenizer", "encoder")


def metrics(server: TritonServer) -> dict[str, float]:
    """The encoder's counters, and the seconds each step was busy so far (every instance):
    the tokenizer's executes (Triton's statistics), the encoder's calls (its own metric)."""
    samples = scrape(server.metrics_url)
    out = {name: metric_sum(samples, name, model="encoder") for name in METRICS}
    out["tokenizer busy"] = execute_seconds(server.model_stats()["tokenizer"])
    out["encoder busy"] = metric_sum(samples, "qwen_embed_encode_seconds_sum", model="encoder")
    return out


def serve_cases(
    model_dir: Path,
    cases: dict,
    seconds: float,
    rounds: int,
    drivers: list[str],
    encoder_instances: int | None = None,
) -> list[dict]:
    """Both servers (prefix_reuse auto and off) up at once; per workload and load generator
    they take turns for `rounds` rounds of seconds/rounds each, so the machine's drift falls on
    both alike; the order alternates (on-off, off-on, ...) so that neither always follows the
    other."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        servers = {}
        for reuse in ("auto", "off"):
            repo = render(
                Path(tmp) / f"repo-{reuse}",
                {"embed": model_dir},
                {"encoder": {"prefix_reuse": reuse}},
                encoder_instances=(
                    f"count: {encoder_instances}, kind: KIND_CPU" if encoder_instances else None
                ),
            )
            servers[reuse] = stack.enter_context(
                TritonServer(repo, log_path=Path(tmp) / f"server-{reuse}.log")
            )
        for index, (name, case) in enumerate(cases.items()):
            inputs = Path(tmp) / f"inputs-{index}.json"  # perf_analyzer's --input-data
            inputs.write_text(json.dumps({"data": [{"TEXT": [t]} for t in case[0]]}))
            for driver in drivers:
                runs = {reuse: [] for reuse in servers}
                for turn in range(rounds):
                    for reuse, server in list(servers.items())[:: -1 if turn % 2 else 1]:
                        if driver == "python":
                            part = serve_round(server, case, seconds / rounds)
                        else:
                            part = analyzer_round(server, inputs, case, seconds / rounds)
                        runs[reuse].append(part)
                for reuse, parts in runs.items():
                    rows.append(
                        {
                            "workload": name,
                            "driver": driver,
                            "prefix_reuse": reuse,
                            **combine(parts),
                        }
                    )
                on, off = rows[-2], rows[-1]
                print(
                    f"{name}, {driver}: on {on['tokens_per_s']:.0f} tok/s, off "
                    f"{off['tokens_per_s']:.0f}, ratio per round {round_ratios(on, off)}, "
                    f"computed/received {on['computed_per_received']:.2f}, hit rate "
                    f"{on['hit_rate']:.2f}",
                    flush=True,
                )
    return rows


def peer_rows(model_dir: Path, cases: dict, queries: int, seed: int) -> list[dict]:
    """--vllm: our server (prefix reuse auto) and vLLM's CPU build (prefix caching on, its
    default; the model's dtype on this CPU) under each query case's load, every request with
    queries neither has seen (a pool of `queries`, the same for both, in the same order):
    tokens/s and the least cosine against the engine's vectors."""
    if installed("vllm") is None:
        print("vllm: not installed (perf/peers/install.sh vllm)", flush=True)
        return []
    route = choose_route(EncoderSettings(), ModelConfig.from_dir(model_dir), "cpu", cpu_features())
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    pools = {}
    with Encoder.from_pretrained(model_dir, prefix_reuse=False) as enc:  # the reference
        for index, (name, case) in enumerate(cases.items()):
            if name.startswith("query"):
                texts = make_queries(queries - queries % case[4], seed + index)
                ids = [e.ids for e in tok.encode_batch(texts)]
                pools[name] = (texts, np.array([len(i) for i in ids]), enc.embed(ids))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = render(Path(tmp) / "repo", {"embed": model_dir}, {"encoder": {}})
        with TritonServer(repo, log_path=Path(tmp) / "server.log") as server:
            for name, pool in pools.items():
                send = functools.partial(triton_sender, server.grpc_url)
                rows.append(fresh_round("ours", name, send, cases[name], pool))
        port = free_port()
        peer, path = peer_server("vllm", model_dir, route.dtype, port, "on")
        try:
            peer.start(timeout=600)
            for name, pool in pools.items():
                send = functools.partial(openai_sender, port, path, "embed")
                rows.append(fresh_round("vllm", name, send, cases[name], pool))
        finally:
            peer.stop()
    return rows


def fresh_round(system: str, name: str, sender, case, pool) -> dict:
    """`sender(texts)`'s requests: a few of the case's own queries to warm up, then the pool
    ((texts, token counts, reference vectors)) once."""
    texts, counts, _, clients, per_request = case
    drive(
        sender(texts), counts, None, clients=2, per_request=per_request, max_requests=4, seconds=0
    )
    stats = drive(
        sender(pool[0]),
        pool[1],
        cosine_check(pool[2]),
        clients=clients,
        per_request=per_request,
        seconds=0,
        max_requests=len(pool[0]) // per_request,
    )
    print(f"{name}, new queries, {system}: {stats['tokens_per_s']:.0f} tok/s", flush=True)
    return {"workload": name, "system": system, **stats}


def round_ratios(on: dict, off: dict) -> str:
    pairs = zip(on["round_tok_s"], off["round_tok_s"], strict=True)
    return ", ".join(f"{a / b:.2f}" for a, b in pairs)


def serve_round(server, case, seconds) -> dict:
    texts, counts, reference, clients, per_request = case
    make = triton_sender(server.grpc_url, texts)
    check = cosine_check(reference)
    drive(
        make,
        counts,
        check,
        clients=2,
        per_request=per_request,
        seconds=0,
        passes=0,
        max_requests=4,
    )  # warm-up
    before = metrics(server)
    stats = drive(
        make, counts, check, clients=clients, per_request=per_request, seconds=seconds, passes=1
    )
    after = metrics(server)
    return {**stats, "metrics": {k: after[k] - before[k] for k in after}}


def analyzer_round(server, inputs: Path, case, seconds, warm_up: float = 3) -> dict:
    """perf_analyzer keeps `clients` requests of `per_request` texts in flight (consecutive
    texts of the input file, over and over); the server's token count over a window of
    `seconds` after `warm_up` gives tokens/s. Its own report is not used (its windows end
    with whole requests; ours is the same clock for both servers)."""
    _, _, _, clients, per_request = case
    cmd = [
        str(PERF_ANALYZER),
        "-m",
        "embed",
        "-i",
        "grpc",
        "-u",
        server.grpc_url,
        "-b",
        str(per_request),
        "--input-data",
        str(inputs),
        "--concurrency-range",
        f"{clients}:{clients}:1",
        # one long window, stopped by us; -s: no stability test (a shared 2-core machine)
        "--measurement-mode",
        "time_windows",
        "--measurement-interval",
        "3600000",
        "-s",
        "100000",
    ]
    wait_idle(server)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(warm_up)
        before, began = metrics(server), time.perf_counter()
        time.sleep(seconds)
        after, wall = metrics(server), time.perf_counter() - began
    finally:
        proc.kill()
        _, err = proc.communicate()
    wait_idle(server)  # what it left in flight must not slow the other server's turn
    delta = {k: after[k] - before[k] for k in after}
    if not delta["qwen_embed_tokens_total"]:
        raise RuntimeError(f"perf_analyzer sent nothing: {err[-500:]}")
    return {
        "seconds": wall,
        "tokens": delta["qwen_embed_tokens_total"],
        "tokens_per_s": delta["qwen_embed_tokens_total"] / wall,
        "requests": None,
        "failed_requests": None,
        "p99_s": None,
        "min_check": None,
        "metrics": delta,
    }


def combine(parts: list[dict]) -> dict:
    """One row from a server's rounds: totals over them; p99 the worst round's."""
    seconds = sum(p["seconds"] for p in parts)
    delta = {k: sum(p["metrics"][k] for p in parts) for k in parts[0]["metrics"]}
    lookups = delta["qwen_embed_prefix_cache_lookups_total"]

    def over_rounds(key: str, fold):  # None where the driver does not measure it
        values = [p[key] for p in parts if p[key] is not None]
        return fold(values) if values else None

    return {
        "rounds": len(parts),
        "seconds": seconds,
        "requests": over_rounds("requests", sum),
        "failed_requests": over_rounds("failed_requests", sum),
        "tokens_per_s": sum(p["tokens"] for p in parts) / seconds,
        "round_tok_s": [p["tokens_per_s"] for p in parts],
        "p99_s": over_rounds("p99_s", max),
        "min_check": over_rounds("min_check", min),
        "computed_per_received": delta["qwen_embed_tokens_computed_total"]
        / max(delta["qwen_embed_tokens_total"], 1),
        "hit_rate": delta["qwen_embed_prefix_cache_hits_total"] / lookups if lookups else 0.0,
        # Seconds each step computed per second of the run (2 cores: at most ~2 in all).
        **{f"{m}_busy": delta[f"{m} busy"] / seconds for m in BUSY},
    }


def pruning(model_dir: Path, ids: list[list[int]], repeats: int) -> dict:
    """Engine in process, dtype auto, no prefix reuse: the last layer pruned vs computed whole."""
    with Encoder.from_pretrained(model_dir, prefix_reuse=False) as enc:
        planner = enc.model.planner
        runs = alternate(
            enc,
            ids,
            {
                True: lambda: setattr(planner, "prune", True),
                False: lambda: setattr(planner, "prune", False),
            },
            repeats,
        )
    on, off = runs[True], runs[False]
    return {
        "pruned_tok_s": on["tok_s"],
        "full_tok_s": off["tok_s"],
        "ratio": on["tok_s"] / off["tok_s"],
        "min_cosine": float((on["vectors"] * off["vectors"]).sum(1).min()),
    }


def engine_ratios(
    model_dir: Path, ids: list[list[int]], sizes: list[int], rounds: int = 3
) -> list[dict]:
    """Engine in process, dtype auto: reuse on vs off (one encoder, switched; its prefix cache
    warm) for forwards of `size` queries each, i.e. the batches Triton's dynamic batcher forms
    from 1-text requests (16 clients: 1 to 16, ~8 on average). Best of `rounds` turns."""
    out = []
    with Encoder.from_pretrained(model_dir) as enc:
        planner = enc.model.planner
        variants = {
            reuse: lambda r=reuse: setattr(planner, "prefix_reuse", r) for reuse in (True, False)
        }
        for size in sizes:
            chunks = [ids[i : i + size] for i in range(0, len(ids) - size + 1, size)]
            per_chunk = sum(len(x) for c in chunks for x in c) / len(chunks)  # tokens
            best = alternate_forwards(enc, chunks, variants, rounds)
            out.append(
                {
                    "queries_per_forward": size,
                    "on_tok_s": per_chunk / best[True],
                    "off_tok_s": per_chunk / best[False],
                    "ratio": best[False] / best[True],
                }
            )
            print(out[-1], flush=True)
    return out


def planner_host_ms(model_dir: Path, ids: list[list[int]], size: int, rounds: int = 5) -> dict:
    """Host milliseconds to plan one forward of `size` texts (batch.flatten and Planner.plan:
    shared prefixes, the layout, its copies to the device), prefix reuse on (cache warm) and
    off, taking turns: what a GPU waits for before a call's first forward. Median of `rounds`
    passes over the batches."""
    batches = [ids[i : i + size] for i in range(0, len(ids) - size + 1, size)]
    times = {True: [], False: []}
    with Encoder.from_pretrained(model_dir) as enc:
        planner = enc.model.planner
        for _ in range(rounds):
            for reuse in times:
                planner.prefix_reuse = reuse
                start = time.perf_counter()
                for batch in batches:
                    planner.plan(*flatten([np.asarray(x) for x in batch]))
                times[reuse].append((time.perf_counter() - start) / len(batches) * 1e3)
    tokens = sum(len(x) for x in ids[: len(batches) * size]) / len(batches)
    on, off = (statistics.median(times[r]) for r in (True, False))
    return {"texts": size, "tokens": tokens, "reuse_on_ms": on, "reuse_off_ms": off}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "demo-model"))
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--rounds", type=int, default=3, help="turns per server and workload")
    p.add_argument("--queries", type=int, default=512)
    p.add_argument("--documents", type=int, default=256)
    p.add_argument("--deep-layers", type=int, default=28)
    p.add_argument("--deep-texts", type=int, default=24)
    p.add_argument("--no-pruning", action="store_true", help="skip the in-process pruning runs")
    p.add_argument(
        "--no-engine", action="store_true", help="skip the in-process reuse runs per forward size"
    )
    p.add_argument(
        "--forward-sizes",
        type=int,
        nargs="+",
        default=[1, 4, 8, 16, 32],
        help="queries per forward of the in-process reuse runs",
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=["1-text", "32-text", "documents"],
        default=["1-text", "32-text", "documents"],
        help="serving cases to run (--seconds 0: none)",
    )
    p.add_argument(
        "--drivers",
        nargs="+",
        choices=["python", "perf_analyzer"],
        default=["python", "perf_analyzer"],
        help="load generators",
    )
    p.add_argument(
        "--encoder-instances",
        type=int,
        help="encoder instances per server, each pinned to its share of the cores (default: "
        "the launcher's, one per NUMA node)",
    )
    p.add_argument(
        "--vllm",
        type=int,
        metavar="QUERIES",
        help="also ours and vLLM's CPU build (perf/peers/install.sh vllm), prefix caching on "
        "in both, under each query case's load over QUERIES queries neither has seen",
    )
    p.add_argument("--out", default=str(RESULTS / "prefix"))
    args = p.parse_args()
    if "perf_analyzer" in args.drivers and not PERF_ANALYZER.exists():
        p.error(
            f"{PERF_ANALYZER} is missing: run perf/perf_analyzer/install.sh (make perf-prefix does)"
        )

    model_dir = ensure_model(Path(args.model_dir).resolve(), 3)
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    queries, documents = make_queries(args.queries), make_texts(args.documents, 0)
    query_ids = [e.ids for e in tok.encode_batch(queries)]
    cases = {}
    with Encoder.from_pretrained(model_dir, prefix_reuse=False) as enc:  # the reference
        workloads = [
            ("query, 1-text requests", queries, 16, 1),
            ("query, 32-text requests", queries, 4, 32),
            ("documents, 8-text requests", documents, 8, 8),
        ]
        for name, texts, clients, per_request in workloads:
            if args.seconds <= 0 or not any(w in name for w in args.workloads):
                continue
            ids = [e.ids for e in tok.encode_batch(texts)]
            counts = np.array([len(i) for i in ids])
            cases[name] = (texts, counts, enc.embed(ids), clients, per_request)
    rows = serve_cases(
        model_dir, cases, args.seconds, args.rounds, args.drivers, args.encoder_instances
    )
    peers = peer_rows(model_dir, cases, args.vllm, seed=2) if args.vllm else []
    engine = [] if args.no_engine else engine_ratios(model_dir, query_ids, args.forward_sizes)
    planner = {}
    if not args.no_engine:  # queries (with the instruction) and documents taking turns
        doc_ids = [e.ids for e in tok.encode_batch(documents)]
        pairs = zip(query_ids[: len(doc_ids)], doc_ids, strict=True)
        mixed = [x for pair in pairs for x in pair]
        planner = planner_host_ms(model_dir, mixed, 64)
        print(planner, flush=True)
    prune = {}
    if not args.no_pruning:
        doc_ids = [e.ids for e in tok.encode_batch(documents[:64])]
        prune[f"{model_dir.name} ({layers} layers)"] = pruning(model_dir, doc_ids, 2)
        print(prune, flush=True)
        deep = ensure_model(REPO / ".cache" / f"bench-model-{args.deep_layers}l", args.deep_layers)
        prune[f"Qwen3-Embedding-0.6B shape ({args.deep_layers} layers)"] = pruning(
            deep, doc_ids[: args.deep_texts], 1
        )
        print(prune, flush=True)

    record = new_record(rows=rows, engine=engine, pruning=prune, planner=planner, peers=peers)
    write_report(
        args.out,
        record,
        "Shared-prefix reuse and last-layer pruning, on vs off",
        notes(args, model_dir.name, layers),
        tables(rows, engine, prune, planner) + peer_table(peers),
    )


def either(value, form: str) -> str:
    return "-" if value is None else format(value, form)


def tables(rows: list[dict], engine: list[dict], prune: dict, planner: dict) -> list[str]:
    by = {(r["workload"], r["driver"], r["prefix_reuse"]): r for r in rows}
    table = (
        [
            "| workload | load generator | tokens/s reuse on | tokens/s off | on / off "
            "| on / off per round | computed per received (on) | cache hit rate (on) "
            "| p99 s on / off | min cosine on | encoder busy on / off | tokenizer busy on / off |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        if rows
        else []  # --seconds 0: no serving cases
    )
    for name, driver, reuse in by:
        if reuse != "auto":
            continue
        on, off = by[(name, driver, "auto")], by[(name, driver, "off")]
        table.append(
            f"| {name} | {driver} | {on['tokens_per_s']:.0f} | "
            f"{off['tokens_per_s']:.0f} | "
            f"{on['tokens_per_s'] / off['tokens_per_s']:.2f} | "
            f"{round_ratios(on, off)} | {on['computed_per_received']:.2f} | "
            f"{on['hit_rate']:.2f} | "
            f"{either(on['p99_s'], '.2f')} / {either(off['p99_s'], '.2f')} | "
            f"{either(on['min_check'], '.5f')} | {on['encoder_busy']:.2f} / "
            f"{off['encoder_busy']:.2f} | {on['tokenizer_busy']:.2f} / "
            f"{off['tokenizer_busy']:.2f} |"
        )
    if engine:
        table += [
            "",
            "Reuse on vs off in process (the engine alone, query workload, cache warm), per "
            "forward size: the most a Triton ratio can reach with batches of that size:",
            "",
            "| queries per forward | tokens/s reuse on | tokens/s off | on / off |",
            "| --- | --- | --- | --- |",
        ]
    for r in engine:
        table.append(
            f"| {r['queries_per_forward']} | {r['on_tok_s']:.0f} | "
            f"{r['off_tok_s']:.0f} | {r['ratio']:.2f} |"
        )
    if prune:
        table += [
            "",
            "Last-layer pruning (engine in process, document mix, prefix reuse off):",
            "",
            "| model | tokens/s pruned | tokens/s whole last layer | ratio | min cosine |",
            "| --- | --- | --- | --- | --- |",
        ]
    for name, r in prune.items():
        table.append(
            f"| {name} | {r['pruned_tok_s']:.0f} | {r['full_tok_s']:.0f} | "
            f"{r['ratio']:.3f} | {r['min_cosine']:.6f} |"
        )
    if planner:
        table += [
            "",
            f"Host time to plan one forward of {planner['texts']} texts (half queries with the "
            f"instruction, half documents; {planner['tokens']:.0f} tokens), the time a GPU waits "
            "before a call's first forward:",
            "",
            "| prefix reuse on (cache warm) | off |",
            "| --- | --- |",
            f"| {planner['reuse_on_ms']:.2f} ms | {planner['reuse_off_ms']:.2f} ms |",
        ]
    return table


def peer_table(peers: list[dict]) -> list[str]:
    """--vllm: ours and vLLM's on the same new queries, per query case."""
    if not peers:
        return []
    by = {(r["workload"], r["system"]): r for r in peers}
    version = ", ".join(installed("vllm"))
    table = [
        "",
        f"Beside vLLM's CPU build ({version}), prefix caching on in both (ours: prefix_reuse "
        "auto; vLLM's default), every request with queries neither has seen (the same ones, in "
        "the same order, for both; vLLM caches every block it computed, so repeated queries "
        "would cost it next to nothing); ours through Triton (gRPC), vLLM's /v1/embeddings:",
        "",
        "| workload | requests | ours tokens/s | vLLM tokens/s | ours / vLLM | p99 s ours / vLLM "
        "| min cosine ours / vLLM | tokens vLLM counts / ours |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, system in by:
        if system != "ours" or (name, "vllm") not in by:
            continue
        ours, theirs = by[(name, "ours")], by[(name, "vllm")]
        table.append(
            f"| {name} | {ours['requests']} | {ours['tokens_per_s']:.0f} | "
            f"{theirs['tokens_per_s']:.0f} | {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f} | "
            f"{ours['p99_s']:.2f} / {theirs['p99_s']:.2f} | {ours['min_check']:.5f} / "
            f"{theirs['min_check']:.5f} | {either(theirs['server_tokens_ratio'], '.3f')} |"
        )
    return table


def notes(args, model_name: str, layers: int) -> list[str]:
    return [
        f"model: {model_name} ({layers} layers, Qwen3-Embedding-0.6B width), encoder dtype "
        f"auto; {args.seconds:.0f} s per case, server and load generator through Triton, both "
        f"servers up, taking turns in {args.rounds} rounds; tokens/s count the tokens sent; "
        f"encoder instances per server: {args.encoder_instances or 'one per NUMA node'}",
        "load generators (on the same two cores): python = bench_peers' client threads, "
        "vectors checked against the engine (min cosine); perf_analyzer = C++, tokens/s from "
        "the server's token count over the window, vectors not checked",
        "busy: seconds inside that step's execute() per second of the run, all its instances "
        "(the encoder's forward and pooling; the tokenizers' executes); the rest of the two "
        "cores goes to Triton, gRPC, the Python stubs' IPC and the load-generating clients",
    ]


if __name__ == "__main__":
    main()
