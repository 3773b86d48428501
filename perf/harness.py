"""The one harness every benchmark stands on: drive a server (or a peer, or the engine) with
N clients for S seconds, scrape its metrics, and write the report in one format.

- `drive(make_sender, counts, check, clients=, per_request=, seconds=)`: client threads send
  requests back to back; tokens/s, latency percentiles, and every answer checked.
- `triton_sender`, `openai_sender`, `rerank_sender`: the `make_sender` of each protocol.
- `best_seconds(call, reps)`: a microbenchmark's best time.
- `cosine_check(reference)`, `score_check(reference)`: what "checked" means for vectors/scores.
- metrics: `TritonServer.metric(name, **labels)` and `scrape`/`metric_sum`
  (qwen_embed_deploy.triton) read Triton's Prometheus page.
- fixtures: `REPO`, `ensure_model(path, layers)` (a demo-shaped model built once), `cpu_tag()`
  (this CPU kind's short name for report file names).
- `run_subcommands(doc, commands)`: a script of several benchmarks, one subcommand each, each
  writing its report to `--out` (results/<subcommand> by default).
- `new_record(**fields)` and `write_report(out, record, title, notes, table)`: OUT.json (the
  record: date, machine, CPU flags, command, then the benchmark's fields) and OUT.md.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parent.parent

Check = Callable[[list[int], np.ndarray], float]


# ---------------------------------------------------------------- fixtures


def ensure_model(path: Path, layers: int) -> Path:
    """A model of Qwen3-Embedding-0.6B's shape with `layers` layers at `path`, built once
    (never into a directory whose name says other layers, as "bench-model-4l" does)."""
    if not (path / "config.json").is_file():  # config.json is written last by the builder
        named = re.search(r"-(\d+)l$", path.name)
        if named and int(named[1]) != layers:
            raise SystemExit(f"{path} is named for {named[1]} layers; this builds {layers}")
        subprocess.run(
            [sys.executable, "-m", "qwen_embed_deploy.demo", str(path), "--layers", str(layers)],
            check=True,
        )
    return path


def named_revision(revision: str) -> str:
    """A git revision as reports name a base: with its commit ("HEAD (f29ac88)"), which a
    name like HEAD does not keep once later commits land."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", revision], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    return revision if not commit or revision == commit else f"{revision} ({commit})"


def cpu_tag() -> str:
    """Short name of this CPU kind for result file names (the widest native kernels it runs;
    "zen5" for AMD's family 26 and "xeon-avx512bf16" for an Intel Xeon whose AMX is hidden,
    which run Zen 4's): results per kind, as RESULTS.md sorts them, stay side by side."""
    from qwen_embed.cpu import cpu_features
    from qwen_embed.native import isa_for

    features = cpu_features()
    isa = isa_for(features)
    if isa == "avx512bf16" and "family 26," in machine():
        return "zen5"
    return f"xeon-{isa}" if isa == "avx512bf16" and features.intel else isa


def run_subcommands(doc: str, commands: dict[str, tuple[str, Callable, Callable]]) -> None:
    """Parse the command line of a script of several benchmarks, `commands` holding for each
    subcommand (its docstring, a function adding its arguments, its run(args)), and run it."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    subparsers = p.add_subparsers(dest="command", required=True)
    for name, (text, arguments, run) in commands.items():
        sub = subparsers.add_parser(
            name,
            help=text.splitlines()[0],
            description=text,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        arguments(sub)
        sub.add_argument("--out", default=str(RESULTS / name), help="the report, without suffix")
        sub.set_defaults(run=run)
    args = p.parse_args()
    args.run(args)


# ---------------------------------------------------------------- load


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The cosine of each row of a with the same row of b."""
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (a * b).sum(1) / (norms + 1e-12)


def cosine_check(reference: np.ndarray) -> Check:
    """The lowest cosine of an answer's vectors against the reference rows."""

    def check(idx: list[int], vectors: np.ndarray) -> float:
        return float(cosines(vectors, reference[idx]).min())

    return check


def score_check(reference: np.ndarray) -> Check:
    """1 minus the largest difference of an answer's scores from the reference scores."""

    def check(idx: list[int], scores: np.ndarray) -> float:
        return 1.0 - float(np.abs(scores.reshape(-1) - reference[idx]).max())

    return check


def round_ratios(mine: list, theirs: list, which: int = 0) -> list[float]:
    """Round by round, one variant's rate over another's (entry `which` of each round's rates,
    as two variants taking turns recorded them)."""
    return [a[which] / b[which] for a, b in zip(mine, theirs, strict=True)]


def status_mib(field: str, pid: int | str = "self") -> float:
    """A memory field of /proc/PID/status (VmRSS: resident now, VmHWM: its peak) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no {field} in /proc/{pid}/status")


def best_seconds(call: Callable[[], object], reps: int) -> float:
    """The fastest of `reps` calls after one warm-up call, in seconds (microbenchmarks)."""
    call()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def taking_turns(calls: dict[str, Callable[[], object]], turns: int) -> dict[str, list[float]]:
    """Each call once to warm up, then `turns` turns of every call, the order reversed every
    other turn: the seconds of each call per turn. On a host whose speed drifts, the calls of
    one turn share its phase, so their ratios hold where separate timings do not."""
    for call in calls.values():
        call()
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for turn in range(turns):
        for name in list(calls)[:: -1 if turn % 2 else 1]:
            start = time.perf_counter()
            calls[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def drive(
    make_sender: Callable[[], Callable[[list[int]], tuple[np.ndarray, int | None]]],
    counts: np.ndarray,
    check: Check | None,
    *,
    clients: int,
    per_request: int,
    seconds: float,
    passes: int = 1,
    first_request: int = 0,
    max_requests: int | None = None,
) -> dict:
    """`clients` threads, each with its own `make_sender()`, send requests back to back.

    Request k carries items [k*per_request, (k+1)*per_request) mod the list (`counts[i]` is item
    i's token count), so passes over the list are whole unless the deadline ends one early. No
    request starts after the deadline once `passes` passes are done (or after `max_requests`);
    the wall clock runs until the last one answers. A sender returns (outputs, the server's
    token count or None); `check(idx, outputs)` scores every answer (the report keeps the
    lowest). Failed requests are counted and the run goes on; after 20 it stops.
    """
    n = len(counts)
    per_pass = -(-n // per_request)
    lock = threading.Lock()
    state = {"next": first_request, "sent": 0}
    latencies, tokens, reported, checks, errors = [], [], [], [], []
    start = time.perf_counter()
    deadline = start + seconds

    def take() -> int | None:
        with lock:
            sent = state["sent"]
            if len(errors) >= 20:  # the server is gone or broken: stop, keep the messages
                return None
            if max_requests is not None and sent >= max_requests:
                return None
            past = time.perf_counter() > deadline
            if max_requests is None and sent >= passes * per_pass and past:
                return None
            state["sent"] += 1
            state["next"] += 1
            return state["next"] - 1

    def client() -> None:
        send = make_sender()
        while (k := take()) is not None:
            idx = [(k * per_request + j) % n for j in range(per_request)]
            t0 = time.perf_counter()
            try:
                outputs, server_tokens = send(idx)
            except Exception as exc:  # a failed request is recorded, the run goes on
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}"[:300])
                continue
            elapsed = time.perf_counter() - t0
            score = check(idx, outputs) if check else None
            with lock:
                latencies.append(elapsed)
                tokens.append(int(counts[idx].sum()))
                reported.append(server_tokens)
                if score is not None:
                    checks.append(score)

    load_start = os.getloadavg()
    if clients == 1:
        # In this thread: an in-process engine keeps the OpenMP team and the per-thread
        # kernel state its warm-up built (a fresh thread builds its own, inside the clock).
        client()
    else:
        threads = [threading.Thread(target=client) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall = time.perf_counter() - start
    done = len(latencies)
    # The server's own token count over ours (1.0: it embedded the same token sequences).
    theirs = [(r, t) for r, t in zip(reported, tokens, strict=True) if r is not None]
    return {
        "requests": done,
        "failed_requests": len(errors),
        "errors": errors[:5],
        "texts": done * per_request,
        "tokens": sum(tokens),
        "seconds": wall,
        "passes": done * per_request / n,
        "texts_per_s": done * per_request / wall,
        "tokens_per_s": sum(tokens) / wall,
        "p50_s": float(np.percentile(latencies, 50)) if done else None,
        "p99_s": float(np.percentile(latencies, 99)) if done else None,
        "min_check": min(checks) if checks else None,
        "server_tokens_ratio": sum(r for r, _ in theirs) / sum(t for _, t in theirs)
        if theirs
        else None,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }


def start_gateway(grpc_url: str, *args: str) -> tuple[subprocess.Popen, int]:
    """The HTTP gateway as its own process in front of Triton's gRPC `grpc_url`, as the
    launcher runs it (`args`: its options), once its /health answers: (process, port)."""
    from qwen_embed_deploy.triton import free_port

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "qwen_embed_client.gateway", "--triton-url", grpc_url]
        + ["--port", str(port), *args]
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return process, port
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"the gateway did not come up on port {port}") from None
            time.sleep(0.3)


def triton_sender(
    url: str,
    texts: list[str],
    model: str = "embed",
    images: list[list[bytes]] | None = None,
    **parameters,
):
    """gRPC to a Triton `embed` model: (EMBEDDING, total TOKEN_COUNT); `images`: each text's
    image files (the IMAGES input)."""
    import tritonclient.grpc as grpcclient

    from qwen_embed_client.contract import pack_images

    def make():
        client = grpcclient.InferenceServerClient(url)

        def send(idx):
            inp = grpcclient.InferInput("TEXT", [len(idx), 1], "BYTES")
            inp.set_data_from_numpy(np.array([[texts[i].encode()] for i in idx], dtype=object))
            inputs = [inp]
            if images is not None:
                packed = np.array([[pack_images(images[i])] for i in idx], dtype=object)
                inputs.append(grpcclient.InferInput("IMAGES", [len(idx), 1], "BYTES"))
                inputs[-1].set_data_from_numpy(packed)
            result = client.infer(model, inputs, client_timeout=1800, parameters=parameters or None)
            return result.as_numpy("EMBEDDING"), int(result.as_numpy("TOKEN_COUNT").sum())

        return send

    return make


def encoder_sender(url: str, id_lists: list[list[int]], model: str = "encoder"):
    """gRPC to a Triton `encoder` model, pre-tokenized: (EMBEDDING, None)."""
    import tritonclient.grpc as grpcclient

    from qwen_embed_client.contract import pack_ids

    def make():
        client = grpcclient.InferenceServerClient(url)

        def send(idx):
            inp = grpcclient.InferInput("TOKEN_IDS", [len(idx), 1], "BYTES")
            inp.set_data_from_numpy(np.array([[pack_ids(id_lists[i])] for i in idx], object))
            result = client.infer(model, [inp], client_timeout=1800)
            return result.as_numpy("EMBEDDING"), None

        return send

    return make


def rerank_sender(url: str, query: str, documents: list[str], model: str = "rerank"):
    """gRPC to a Triton `rerank` model: (SCORES of the documents, total TOKEN_COUNT)."""
    import tritonclient.grpc as grpcclient

    def make():
        client = grpcclient.InferenceServerClient(url)

        def send(idx):
            q = grpcclient.InferInput("QUERY", [1], "BYTES")
            q.set_data_from_numpy(np.array([query.encode()], dtype=object))
            docs = grpcclient.InferInput("DOCUMENTS", [len(idx), 1], "BYTES")
            docs.set_data_from_numpy(np.array([[documents[i].encode()] for i in idx], dtype=object))
            result = client.infer(model, [q, docs], client_timeout=1800)
            return result.as_numpy("SCORES").reshape(-1), int(result.as_numpy("TOKEN_COUNT").sum())

        return send

    return make


def openai_sender(port: int, path: str, model: str, texts: list[str], key: str | None = None):
    """One keep-alive HTTP connection per client thread, OpenAI embeddings request/response;
    `key`: the API key each request sends."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"

    def make():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)

        def send(idx):
            body = json.dumps({"model": model, "input": [texts[i] for i in idx]})
            conn.request("POST", path, body, headers)
            response = conn.getresponse()
            payload = response.read()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {payload[:200]!r}")
            data = json.loads(payload)
            rows = sorted(data["data"], key=lambda d: d["index"])
            usage = (data.get("usage") or {}).get("prompt_tokens")
            return np.array([r["embedding"] for r in rows], dtype=np.float32), usage

        return send

    return make


# ---------------------------------------------------------------- reports


ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def machine() -> str:
    """CPU model, core count and library versions, written beside every result."""
    cpu = platform.processor() or "unknown CPU"
    # "AMD EPYC" names several generations: the family and model numbers tell them apart.
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    if "model name" in fields:
        family, model = fields.get("cpu family"), fields.get("model")
        cpu = f"{fields['model name']} (family {family}, model {model})"
    cores = f"{os.cpu_count()} cores"
    usable = len(os.sched_getaffinity(0))
    if usable < (os.cpu_count() or 0):  # pinned to some of them (taskset)
        cores += f" ({usable} in use)"
    described = f"{cpu}, {cores}, Python {platform.python_version()}"
    try:
        import torch

        described += f", torch {torch.__version__} ({torch.get_num_threads()} threads)"
        if torch.cuda.is_available():
            described += f", GPU {torch.cuda.get_device_name()}"
    except ImportError:
        pass
    # A run that caps the libraries' instruction sets (to stand in for a CPU without the wider
    # ones) says so beside the machine.
    limits = [f"{k}={os.environ[k]}" for k in ISA_LIMITS if os.environ.get(k)]
    if limits:
        described += f"; instruction sets capped by {' '.join(limits)}"
    return described


def stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def command_line() -> str:
    """The command as run, quoted so that it runs again as shown (an empty --variant too)."""
    return "python " + shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])


def new_record(**fields) -> dict:
    """What every result carries: date, machine, CPU flags and the command, then `fields`."""
    from qwen_embed.cpu import cpu_features

    return {
        "date": stamp(),
        "machine": machine(),
        "cpu": cpu_features().describe(),
        "command": command_line(),
        **fields,
    }


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
    ]


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def write_report(
    out: str | Path, record: dict, title: str, notes: list[str], table: list[str]
) -> Path:
    """OUT.json (the record) and OUT.md: the title, where and how it ran, notes, a table (any
    markdown lines: tables, sections)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2, default=str))
    lines = [
        f"# {title}",
        "",
        f"- date: {record['date']}",
        f"- machine: {record['machine']}",
        f"- CPU flags: {record['cpu']}",
        f"- command: `{record['command']}`",
        *(f"- {n}" for n in notes),
        "",
        *table,
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')}")
    return out
