"""End-to-end throughput of the `embed` ensemble on a real tritonserver vs the engine alone.

    python perf/bench_serving.py [--concurrency 1 16 64] [--seconds 20] [--direct | --gateway]

Texts (seeded): 80% of 16-64 words and 20% of 256-1024 words drawn from common English words
that are one Qwen token each, so a text of N words is about N + 1 tokens. Each request carries
--texts-per-request texts; every client (a thread with its own gRPC client) sends requests
back to back for --seconds, every answer checked against the engine's vectors. Requests per
encoder execute come from the server's own metric (qwen_embed_encoder_requests_per_execute).
The engine alone (in this process, all texts per call) is the ceiling the table compares with.

Where a level's wall time goes: the share in encoder calls (qwen_embed_encode_seconds, from a
call's start until its rows are read: on a GPU a call overlaps the next execute) and in encoder
executes (Triton's model statistics; the rest of an execute is reading requests and waiting for
the previous execute's answers, the rest of the wall is the encoder waiting for work), and the
cores each process kept busy (/proc): the encoder's and tokenizer's Python stubs, tritonserver,
and the clients (this process); per model (embed, tokenizer, encoder) the ms a request spent in
it and, of that, queued (Triton's statistics). With --spy, py-spy samples the encoder's and the
tokenizer's stubs' Python stacks while each level runs (without pausing them), each model's
apart: the share of the wall each of our functions was on the stack (inclusive) and the frames
the samples ended in (self), where the time outside the engine's forward goes. With --direct
the requests carry token ids (TOKEN_IDS) straight to the `encoder` model, as a client that
tokenizes for itself sends them: no tokenizer step. With --gateway they are OpenAI embeddings
requests (JSON, float vectors) to the HTTP gateway in front of the server, whose process's
cores the table adds.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from itertools import zip_longest
from pathlib import Path

import numpy as np
from harness import (
    RESULTS,
    cosine_check,
    drive,
    encoder_sender,
    fmt,
    markdown_table,
    new_record,
    openai_sender,
    start_gateway,
    triton_sender,
    write_report,
)
from tokenizers import Tokenizer

from qwen_embed import Encoder
from qwen_embed.settings import EncoderSettings
from qwen_embed_deploy.launcher import proc_stat, stub_processes
from qwen_embed_deploy.placement import gpu_instance_groups
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.serving.config import DEMO_MODEL_DIR
from qwen_embed_deploy.triton import TritonServer, execute_seconds

from workload import make_texts

PER_EXECUTE = "qwen_embed_encoder_requests_per_execute"
MODELS = ("embed", "tokenizer", "encoder")
ENCODE_SECONDS = "qwen_embed_encode_seconds_sum"  # the encoder's calls, summed
# --gateway-key: the key every request sends and its entry in the gateway's keys file, whose
# checks all run (the served model, a minute's requests and tokens, requests in flight, bulk
# priority) and whose limits are never reached.
BENCH_KEY = "bench-key"
BENCH_KEY_ENTRY = {
    "name": "bench",
    "key": BENCH_KEY,
    "models": ["embed"],
    "requests_per_minute": 10**9,
    "tokens_per_minute": 10**12,
    "max_concurrent_requests": 10**6,
    "priority": "bulk",
}


def executes(server: TritonServer) -> tuple[float, float]:
    """(requests, executes) the encoder has seen, from its requests-per-execute histogram."""
    return server.metric(PER_EXECUTE + "_sum"), server.metric(PER_EXECUTE + "_count")


def model_times(server: TritonServer) -> dict[str, tuple[int, int, int, float]]:
    """Per model of MODELS, so far, from Triton's statistics: (requests, ns they spent in it,
    ns of that queued, seconds in its executes)."""
    times = {}
    for name, m in server.model_stats().items():
        if name in MODELS:
            done, queued = m["inference_stats"]["success"], m["inference_stats"]["queue"]
            times[name] = (
                int(done["count"]),
                int(done["ns"]),
                int(queued["ns"]),
                execute_seconds(m),
            )
    return times


def cpu_seconds(server: TritonServer, gateway: int | None = None) -> dict[str, float]:
    """CPU seconds so far of the server's processes, by role, of the clients (this one) and of
    the `gateway` process where there is one."""
    server_pid = server.status()["server_pid"]
    roles = {"tritonserver": [server_pid], "clients": [os.getpid()]}
    if gateway is not None:
        roles["gateway"] = [gateway]
    for pid, model in stub_processes(server_pid).items():
        roles.setdefault(model, []).append(pid)
    return {role: sum(map(_cpu_seconds, pids)) for role, pids in roles.items()}


def _cpu_seconds(pid: int) -> float:
    try:
        fields = proc_stat(pid)
    except OSError:  # gone
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def time_split(server: TritonServer, run, gateway: int | None = None) -> tuple[dict, dict]:
    """run()'s result and where its wall time went: shares in encoder calls and executes, the
    cores each role kept busy, and per model the ms a request spent in it (and queued)."""
    start, cpu = time.perf_counter(), cpu_seconds(server, gateway)
    calls, before = server.metric(ENCODE_SECONDS), model_times(server)
    result = run()
    wall = time.perf_counter() - start
    calls = server.metric(ENCODE_SECONDS) - calls
    cpu_now = cpu_seconds(server, gateway)
    cores = {role: (used - cpu.get(role, 0.0)) / wall for role, used in cpu_now.items()}
    spent = {
        name: [b - a for a, b in zip(before.get(name, (0, 0, 0, 0)), now, strict=True)]
        for name, now in model_times(server).items()
    }
    executes = spent["encoder"][3]
    server_ms = {
        name: {"in": ns / n / 1e6, "queued": queued / n / 1e6}
        for name, (n, ns, queued, _) in spent.items()
        if n
    }
    split = {"calls_share": calls / wall, "executes_share": executes / wall, "cores": cores}
    return result, {**split, "server_ms": server_ms}


class StubSampler:
    """py-spy recording the Python stacks of the encoder stubs `pids` (every thread that runs
    Python, without pausing them) from construction to `stop()`, into files under `directory`."""

    RATE = 100  # samples per second and thread

    def __init__(self, pids: list[int], directory: Path):
        self.files = [directory / f"stub-{pid}.txt" for pid in pids]
        self.start = time.perf_counter()
        self.procs = []
        if py_spy() is None:
            return  # stop() says so
        command = [py_spy(), "record", "--nonblocking", "--function", "--format", "raw"]
        command += ["--rate", str(self.RATE)]
        self.procs = [
            subprocess.Popen(
                [*command, "--pid", str(pid), "--output", str(f)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for pid, f in zip(pids, self.files, strict=True)
        ]

    def stop(self) -> dict:
        """Where the stubs' wall time went (`stack_shares`), or why there is nothing."""
        wall = time.perf_counter() - self.start
        if not self.procs:
            return {"error": "py-spy not found (requirements.txt; the GPU bundle's on PATH)"}
        for proc in self.procs:
            proc.send_signal(signal.SIGINT)  # py-spy writes what it has and exits
        errors = [proc.communicate(timeout=60)[1] for proc in self.procs]
        stacks = [line for f in self.files if f.exists() for line in f.read_text().splitlines()]
        if not stacks:
            return {"error": " ".join(e.strip() for e in errors)[-300:] or "no samples"}
        return stack_shares(stacks, self.RATE * wall * len(self.files))


def py_spy() -> str | None:
    """The py-spy executable: beside this Python (requirements.txt) or on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


# Frames of our code, by their files as py-spy names them (the stub's model.py by its name)
OURS = ("(model.py:", "qwen_embed/", "qwen_embed_deploy/", "qwen_embed_client/")
EXECUTE = "TritonPythonModel.execute "


def stack_shares(lines: list[str], wall_samples: float, top: int = 30) -> dict:
    """py-spy's raw lines ("frame;frame;... count", outermost first, "function (file:line)")
    as shares of `wall_samples` (rate x seconds x stubs): each of our functions' inclusive
    share (on the stack), the frames the samples ended in (any code), and the share inside an
    execute, the rest being time between executes."""
    inclusive, ended = Counter(), Counter()
    sampled = in_execute = 0
    for line in lines:
        stack, _, count = line.rpartition(" ")
        frames, n = stack.split(";"), int(count)
        sampled += n
        ended[frames[-1]] += n
        ours = {f for f in frames if any(k in f for k in OURS)}
        for frame in ours:
            inclusive[frame] += n
        in_execute += n if any(f.startswith(EXECUTE) for f in frames) else 0

    def shares(counter: Counter) -> list[tuple[str, float]]:
        return [(frame or "(no frame)", n / wall_samples) for frame, n in counter.most_common(top)]

    return {
        "sampled": sampled / wall_samples,
        "in_execute": in_execute / wall_samples,
        "inclusive": shares(inclusive),
        "self": shares(ended),
    }


# --spy's samples in a level's row: each sampled model's under its key
SPIED = {"encoder": "spy", "tokenizer": "spy_tokenizer"}


def spy_tables(rows: list[dict]) -> list[str]:
    """The --spy report: per level and model, our functions by inclusive share of its stubs'
    wall."""
    lines = []
    for r, (model, key) in itertools.product(rows, SPIED.items()):
        spy = r.get(key)
        if spy is None:
            continue
        lines += ["", f"{model.capitalize()} stubs at {r['concurrency']} clients (py-spy):"]
        if "error" in spy:
            lines += ["", f"no samples: {spy['error']}"]
            continue
        lines += [
            "",
            f"Inside `execute` {spy['in_execute']:.0%} of the wall; samples with Python on the "
            f"stack {spy['sampled']:.0%} (every thread's).",
            "",
        ]
        lines += markdown_table(
            [
                "our function (on the stack)",
                "share of the wall",
                "where the samples ended",
                "share",
            ],
            [
                [f"`{a[0]}`", f"{a[1]:.1%}", f"`{b[0]}`" if b else "", f"{b[1]:.1%}" if b else ""]
                for a, b in zip_longest(spy["inclusive"], spy["self"])
                if a
            ],
        )
    return lines


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
    p.add_argument(
        "--encoder-instances",
        help="its instance_group, e.g. 'count: 2, kind: KIND_MODEL'; on a GPU the default is "
        "what the launcher serves (placement.gpu_instance_groups: --gpu-instances per GPU, "
        "tokenizers scaled to the CPUs)",
    )
    p.add_argument("--gpu-instances", type=int, default=1, help="encoder instances per GPU")
    path = p.add_mutually_exclusive_group()
    path.add_argument(
        "--direct", action="store_true", help="token ids straight to `encoder` (no tokenizer)"
    )
    path.add_argument(
        "--gateway", action="store_true", help="OpenAI embeddings requests through the gateway"
    )
    p.add_argument(
        "--gateway-key",
        action="store_true",
        help="with --gateway: every request sends a named API key (--api-keys-file) whose "
        "models, limits and priority are checked and never reached",
    )
    p.add_argument(
        "--spy", action="store_true", help="sample the encoder's and tokenizer's stubs with py-spy"
    )
    p.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the server and its models' stubs, e.g. TOKENIZERS_PARALLELISM=false",
    )
    p.add_argument(
        "--encoder-code",
        type=Path,
        help="serve this file as the encoder's model.py (an A/B of a change: e.g. `git show "
        "REV:model_repository/encoder/1/model.py`)",
    )
    args = p.parse_args()
    params = dict(item.split("=", 1) for item in args.encoder_param)
    per_request = args.texts_per_request

    texts = make_texts(args.texts, args.seed)
    tok = Tokenizer.from_file(str(Path(args.model_dir) / "tokenizer.json"))
    ids = [e.ids for e in tok.encode_batch(texts)]
    counts = np.array([len(i) for i in ids])
    engine_settings = EncoderSettings.from_parameters(
        {k: v for k, v in params.items() if k in EncoderSettings.__dataclass_fields__}
    )
    with Encoder.from_pretrained(args.model_dir, engine_settings) as enc:
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
    server_env = dict(item.split("=", 1) for item in args.server_env)
    env = {"QWEN_EMBED_MODEL_DIR": str(Path(args.model_dir).resolve()), **server_env}
    groups = (args.encoder_instances, None)
    if device.startswith("cuda") and args.encoder_instances is None:
        cpus = len(os.sched_getaffinity(0))
        groups = gpu_instance_groups(1, cpus, args.gpu_instances)
    repo = render(
        tempfile.mkdtemp(prefix="bench-serving-"),
        {"embed": args.model_dir},
        {"encoder": params},
        encoder_instances=groups[0],
        tokenizer_instances=groups[1],
    )
    if args.encoder_code is not None:
        shutil.copy(args.encoder_code, Path(repo) / "encoder" / "1" / "model.py")
    with (
        TritonServer(repo, env=env, log_path=Path("/tmp/bench_serving_triton.log")) as server,
        gateway_in_front(server, args.gateway, args.gateway_key) as gateway,
    ):
        if args.direct:
            make = encoder_sender(server.grpc_url, ids)
        elif gateway is not None:
            key = BENCH_KEY if args.gateway_key else None
            make = openai_sender(gateway[1], "/v1/embeddings", "embed", texts, key)
        else:
            make = triton_sender(server.grpc_url, texts)
        gateway_pid = gateway[0].pid if gateway else None
        drive(make, counts, check, clients=4, per_request=per_request, seconds=0, max_requests=8)
        stubs = stub_processes(server.status()["server_pid"]).items()
        spied = {m: [pid for pid, model in stubs if model == m] for m in SPIED if args.spy}
        for c in args.concurrency:
            before = executes(server)
            samplers = {
                SPIED[m]: StubSampler(pids, Path(tempfile.mkdtemp()))
                for m, pids in spied.items()
                if pids
            }
            stats, split = time_split(
                server,
                lambda c=c: drive(
                    make, counts, check, clients=c, per_request=per_request, seconds=args.seconds
                ),
                gateway_pid,
            )
            requests, runs = (a - b for a, b in zip(executes(server), before, strict=True))
            rows.append(
                {
                    "concurrency": c,
                    **stats,
                    "requests_per_execute": requests / runs if runs else 0,
                    **split,
                    **{key: sampler.stop() for key, sampler in samplers.items()},
                }
            )
            print(json.dumps(rows[-1]), flush=True)

    # Compare at 16 clients (the reference point) when that level ran.
    top = next((r for r in rows if r["concurrency"] == 16), rows[-1])
    ratio = top["tokens_per_s"] / engine["tokens_per_s"]
    record = new_record(
        encoder_params=params,
        encoder_instances=groups[0],
        tokenizer_instances=groups[1],
        device=device,
        direct=args.direct,
        encoder_code=str(args.encoder_code) if args.encoder_code else None,
        server_env=server_env,
        gateway=args.gateway,
        gateway_key=args.gateway_key,
        levels=rows,
        engine_alone=engine,
    )
    notes = [
        f"model: {args.model_dir}, encoder parameters {params or 'as shipped'}, instance "
        f"groups: encoder {groups[0] or 'as shipped'}, tokenizer {groups[1] or 'as shipped'}, "
        f"{per_request} texts per request"
        f"{' of token ids straight to `encoder`' if args.direct else ''}"
        f"{' as OpenAI embeddings requests to the gateway' if args.gateway else ''}"
        f"{', each with a named API key (models, limits, priority)' if args.gateway_key else ''}, "
        f"{f'the encoder served from {args.encoder_code}, ' if args.encoder_code else ''}"
        f"{f'the server started with {server_env}, ' if server_env else ''}"
        f"{args.seconds:.0f} s per level; texts: 80% 16-64 "
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
        "wall in encoder calls / executes",
        f"cores: {' / '.join(roles(args.gateway))}",
        "ms per request in embed / tokenizer / encoder (queued)",
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
                fmt(r["p50_s"], ".3f"),  # None where every request of a level failed
                fmt(r["p99_s"], ".3f"),
                fmt(r["min_check"], ".5f"),
                f"{r['requests_per_execute']:.1f}",
                f"{r['calls_share']:.0%} / {r['executes_share']:.0%}",
                " / ".join(f"{r['cores'].get(role, 0.0):.2f}" for role in roles(args.gateway)),
                in_models(r["server_ms"]),
            ]
            for r in rows
        ],
    )
    table += [
        "",
        f"Engine alone, in process, all {len(ids)} texts per call: "
        f"{engine['texts_per_s']:.1f} texts/s, {engine['tokens_per_s']:.0f} tokens/s; Triton "
        f"end to end at {top['concurrency']} clients = {ratio:.2f}x the engine.",
        *spy_tables(rows),
    ]
    path = "`encoder` model, token ids, gRPC" if args.direct else "`embed` ensemble, gRPC"
    if args.gateway:
        path = "the gateway's /v1/embeddings, then the `embed` ensemble"
    title = f"End to end through Triton ({path}) vs the engine alone"
    write_report(args.out, record, title, notes, table)


def in_models(server_ms: dict[str, dict[str, float]]) -> str:
    """Each model's ms per request, queued time in brackets; n/a where none reached it."""
    cells = []
    for name in MODELS:
        t = server_ms.get(name)
        cells.append(f"{t['in']:.1f} ({t['queued']:.1f})" if t else "n/a")
    return " / ".join(cells)


def roles(gateway: bool) -> tuple[str, ...]:
    """The processes whose cores a level's row gives."""
    return (
        ("encoder", "tokenizer", "tritonserver") + (("gateway",) if gateway else ()) + ("clients",)
    )


@contextlib.contextmanager
def gateway_in_front(server: TritonServer, wanted: bool, keyed: bool = False):
    """(process, port) of a gateway in front of `server` while the block runs, where wanted;
    `keyed`: taking BENCH_KEY only, a named key with every check on and no limit reached."""
    if not wanted:
        yield None
        return
    with tempfile.TemporaryDirectory() as where:
        args = ["--rerank-model-name", ""]
        if keyed:
            keys = Path(where) / "keys.json"
            keys.write_text(json.dumps({"keys": [BENCH_KEY_ENTRY]}))
            args += ["--api-keys-file", str(keys)]
        process, port = start_gateway(server.grpc_url, *args)
        try:
            yield process, port
        finally:
            process.terminate()
            process.wait(timeout=30)


if __name__ == "__main__":
    main()
