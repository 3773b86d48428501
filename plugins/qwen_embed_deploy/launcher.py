"""Run tritonserver as production should, and keep it honest.

    python -m qwen_embed_deploy.launcher [--host 0.0.0.0] [--http-port 8000] [--admin-key KEY]

- Models load in explicit model-control mode, so they can be reloaded one at a time.
- The model-repository, shared-memory, trace and logging APIs answer only requests carrying the
  header `admin-key: KEY` (gRPC metadata `triton-grpc-protocol-admin-key: KEY`); without
  --admin-key (or $QWEN_EMBED_ADMIN_KEY) a random key is made that nobody outside this process
  knows, i.e. those APIs are closed.
- A watchdog reloads a model whose Python stub process died: Triton 2.51 neither restarts it nor
  stops answering ready, it just fails every request to that model.
- A tritonserver that exits unasked after it was ready is started again on the same ports (up
  to RESTART_LIMIT times in RESTART_WINDOW_S): its Python backend aborts the whole server when a
  stub dies holding a lock of their shared memory (triton-inference-server/server#8882).
- It serves an edited copy of the repository (repository.edited_copy): the edits below and each
  tokenizer's and encoder's facts (repository.publish_facts), where Triton clients read them.
- On a host without GPUs, `--cpu-instances auto` (default) serves one encoder instance per
  NUMA node in place of a KIND_MODEL encoder group; explicit KIND_CPU groups are kept. Each
  instance pins itself (placement.py).
  On a host with GPUs, `--gpu-instances auto` (default) serves one KIND_GPU encoder instance
  per GPU in place of a KIND_MODEL group that is not a tensor-parallel one, and scales the
  tokenizer instances to the CPUs (placement.gpu_instance_groups).
- `--response-cache-mb N` (or $RESPONSE_CACHE_MB) turns Triton's local response cache on for
  the encoders, bounded to N MiB; off by default (served_edits says what is hashed).
- `--otlp-endpoint URL` (or $OTEL_EXPORTER_OTLP_ENDPOINT, an OTLP/HTTP collector's base URL)
  turns Triton's OpenTelemetry tracing on (one in `--trace-rate` requests, and every request
  that carries a trace context) and the gateway's (trace_args).
- `--gateway-port N` also starts the HTTP gateway (qwen_embed_client.gateway: the OpenAI, TEI
  and Cohere APIs) on the same host once Triton is ready, and stops it on exit.
- `--no-rerank` leaves the reranking models (repository.rerank_models) unloaded.
- SIGTERM/SIGINT are passed on once: the gateway stops taking requests and finishes the ones
  in flight (up to --exit-timeout-secs; their chunks not yet sent still reach Triton), then
  Triton stops taking new requests and finishes its own (up to --exit-timeout-secs) before it
  exits; this process exits with its status.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import http.client
import json
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import NamedTuple
from urllib.error import HTTPError

from tritonclient.grpc.model_config_pb2 import ModelConfig, ModelInstanceGroup

from qwen_embed import ollama_store
from qwen_embed_client.contract import MAX_ANSWER_BYTES, RERANK_RECIPES
from qwen_embed_deploy.host import (
    answer_bytes_limit,
    gpu_count,
    memory_available,
    memory_limit,
    shared_memory_bytes,
)
from qwen_embed_deploy.placement import gpu_instance_groups, read_topology
from qwen_embed_deploy.serving.config import (
    MODEL_DIR_ENV,
    MODEL_REPOSITORY,
    RERANK_MODEL_DIR_ENV,
    model_facts,
)

from .repository import (
    Edit,
    edited_copy,
    ensembles,
    facts_question,
    get_parameter,
    instance_group,
    publish_facts,
    repository_configs,
    rerank_models,
    set_instance_group,
    set_parameter,
)
from .triton import READY_POLL_S, server_command

RESTRICTED_APIS = "model-repository,shared-memory,trace,logging"
ADMIN_HEADER = "admin-key"
STUB_NAME = "triton_python_backend_stub"
CPU = ModelInstanceGroup.KIND_CPU
_PR_SET_PDEATHSIG = 1


def repository_models(model_repository: Path, rerank: bool = True) -> list[str]:
    """The models to load: every one with a config.pbtxt; the reranking ones only with
    `rerank`."""
    names = {p.name for p in model_repository.iterdir() if (p / "config.pbtxt").is_file()}
    return sorted(names if rerank else names - rerank_models(model_repository))


def triton_args(
    model_repository: Path,
    host: str,
    ports: tuple[int, int, int],
    admin_key: str,
    exit_timeout_s: int,
    rerank: bool,
    shm_prefix: str,
) -> list[str]:
    http, grpc, metrics = ports
    restricted = f"{RESTRICTED_APIS}:{ADMIN_HEADER}={admin_key}"
    return [
        f"--model-repository={model_repository}",
        f"--http-address={host}",
        f"--http-port={http}",
        f"--grpc-address={host}",
        f"--grpc-port={grpc}",
        f"--metrics-address={host}",
        f"--metrics-port={metrics}",
        "--model-control-mode=explicit",
        # The configs are complete; Triton's completion would start a Python stub per model (a
        # full import of model.py) before its instances, on every load and reload.
        "--disable-auto-complete-config",
        *(f"--load-model={m}" for m in repository_models(model_repository, rerank)),
        f"--http-restricted-api={restricted}",
        f"--grpc-restricted-protocol={restricted}",
        f"--exit-timeout-secs={exit_timeout_s}",
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
    ]


def cpu_instances(requested: str, numa_nodes: int, gpu_present: bool) -> int | None:
    """Encoder instances to serve: None keeps the repository's own instance_group."""
    if requested == "config" or (requested == "auto" and gpu_present):
        return None
    if requested == "auto":
        return numa_nodes
    if not requested.isdigit() or int(requested) < 1:
        raise ValueError(f"--cpu-instances is auto, config or a count >= 1, not {requested!r}")
    return int(requested)


def served_edits(
    cpu_count: int | None,
    only_kind_model: bool,
    gpu_groups: tuple[ModelInstanceGroup, ModelInstanceGroup] | None,
    response_cache: bool,
    rerank_recipe: str = "",
) -> Edit:
    """The launcher's changes to a repository, as one edit of each model's config:

    - `cpu_count`: the encoders get that many KIND_CPU instances; with `only_kind_model` (what
      `--cpu-instances auto` asks) only KIND_MODEL encoders change: an explicit KIND_CPU group
      is the deployer's own choice.
    - `gpu_groups` (encoder group, tokenizer group; placement.gpu_instance_groups): each
      KIND_MODEL encoder that is neither a tensor-parallel group nor pinned to a device by its
      `device` parameter gets the encoder group (on every GPU, where the shipped KIND_MODEL
      would use cuda:0 alone), and KIND_CPU tokenizers the tokenizer group.
    - `response_cache`: Triton's response cache on for the encoders (embed and rerank). The
      encoders, not the ensembles: Triton hashes a request's inputs, not its parameters, and an
      encoder's inputs carry everything its answer depends on (token ids with the prompt
      applied, FINISH with dimensions, normalize and embedding type).
    - `rerank_recipe`: the embed tokenizers' parameter of that name (an embedder that reranks
      as its authors do, E2Rank's: a fact its clients read).
    """

    def edit(name: str, config: ModelConfig) -> None:
        kinds = [g.kind for g in config.instance_group]
        encoder, tokenizer = name.endswith("encoder"), name.endswith("tokenizer")
        if encoder and cpu_count is not None and len(kinds) == 1:
            group = config.instance_group[0]
            kept = only_kind_model and group.kind != ModelInstanceGroup.KIND_MODEL
            same = group.count == cpu_count and group.kind in (CPU, ModelInstanceGroup.KIND_MODEL)
            if not (kept or same):
                set_instance_group(config, ModelInstanceGroup(count=cpu_count, kind=CPU))
        if gpu_groups is not None and len(kinds) == 1:
            if tokenizer and kinds[0] == ModelInstanceGroup.KIND_CPU:
                set_instance_group(config, gpu_groups[1])
            if encoder and kinds[0] == ModelInstanceGroup.KIND_MODEL:
                if not (_tensor_parallel(config) or _pinned(config)):
                    set_instance_group(config, gpu_groups[0])
        if encoder and response_cache:
            config.response_cache.enable = True
        if tokenizer and rerank_recipe and get_parameter(config, "task") != "rerank":
            set_parameter(config, "rerank_recipe", rerank_recipe)

    return edit


def _pinned(config: ModelConfig) -> bool:
    """The deployer named the encoder's device ("cpu", "cuda:1"): KIND_MODEL keeps it there."""
    return get_parameter(config, "device") not in ("", "auto")


def _tensor_parallel(config: ModelConfig) -> bool:
    return int(get_parameter(config, "tp_size") or 1) > 1


def cache_args(response_cache_mb: int) -> list[str]:
    """tritonserver's flags for a local response cache of that many MiB (none for 0)."""
    if response_cache_mb < 0:
        raise ValueError(f"--response-cache-mb must be >= 0, not {response_cache_mb}")
    return [f"--cache-config=local,size={response_cache_mb * 2**20}"] if response_cache_mb else []


def trace_args(otlp_endpoint: str | None, rate: int) -> list[str]:
    """tritonserver's flags for OpenTelemetry traces to an OTLP/HTTP collector (none without
    an endpoint). Triton traces one request in `rate` (0: only those that arrive with a W3C
    trace context, as the gateway's do) with the timestamps of each model's queue and
    compute; an ensemble's steps are spans under the ensemble's."""
    if rate < 0:
        raise ValueError(f"--trace-rate must be >= 0, not {rate}")
    if not otlp_endpoint:
        return []
    return [
        "--trace-config=mode=opentelemetry",
        "--trace-config=level=TIMESTAMPS",
        f"--trace-config=rate={rate}",
        "--trace-config=count=-1",
        f"--trace-config=opentelemetry,url={otlp_endpoint.rstrip('/')}/v1/traces",
        "--trace-config=opentelemetry,resource=service.name=qwen-embed-triton",
    ]


def gpu_instances(requested: str) -> int | None:
    """Encoder instances per GPU: None keeps the repository's own instance_group."""
    if requested == "config":
        return None
    if requested == "auto":
        return 1
    if not requested.isdigit() or int(requested) < 1:
        raise ValueError(f"--gpu-instances is auto, config or a count >= 1, not {requested!r}")
    return int(requested)


def proc_stat(pid: int | str) -> list[str]:
    """A process's /proc stat fields after its name: [state, ppid, ...] (stat is "pid (comm)
    state ppid ...", and comm may hold spaces, so it is split after the last ')')."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


class Stub(NamedTuple):
    model: str  # from the model.py path it runs
    region: str  # its shared memory, /dev/shm/{region}


def stub_processes(server_pid: int) -> dict[int, str]:
    """Live Python stubs of this server: pid -> model name."""
    return {pid: stub.model for pid, stub in server_stubs(server_pid).items()}


def server_stubs(server_pid: int) -> dict[int, Stub]:
    return find_stubs(lambda ppid, region: ppid == server_pid)


def find_stubs(chosen) -> dict[int, Stub]:
    """Live Python stubs for which chosen(parent pid, shared-memory region) holds."""
    stubs = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = proc_stat(entry.name)[:2]
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # exited while we looked
            continue
        if state == "Z" or not args[0].endswith(STUB_NAME.encode()) or len(args) < 3:
            continue
        if chosen(int(ppid), args[2].decode()):
            stubs[int(entry.name)] = Stub(
                Path(args[1].decode()).parent.parent.name, args[2].decode()
            )
    return stubs


def clear_dead_server(shm_prefix: str) -> None:
    """What a tritonserver that died leaves behind: stubs (one can hang in its exit, holding
    its model's memory) and their regions in /dev/shm. Both are known by the prefix the
    launcher gave this server's regions, which every stub's command line names."""
    for pid in find_stubs(lambda ppid, region: region.startswith(shm_prefix)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for region in Path("/dev/shm").glob(f"{shm_prefix}*"):
        region.unlink(missing_ok=True)


def remove_regions(names) -> None:
    for name in names:
        (Path("/dev/shm") / name).unlink(missing_ok=True)


RELOAD_BACKOFF_MAX_S = 30.0
RESTART_LIMIT = 3
RESTART_WINDOW_S = 600.0


class OomKills:
    """The kernel's OOM kills since the last look (/proc/vmstat's count: the whole host's, every
    cgroup's): what a process that died without a word (Triton: "Stub process ... is not
    healthy") most likely died of."""

    def __init__(self, vmstat: Path = Path("/proc/vmstat")):
        self.vmstat = vmstat
        self._seen = self._count()

    def _count(self) -> int:
        try:
            for line in self.vmstat.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0  # a kernel that does not count them

    def since(self) -> str:
        """What the OOM killer did since the last look, as a clause; "" where nothing."""
        count = self._count()
        killed, self._seen = count - self._seen, count
        if killed <= 0:
            return ""
        return (
            f"the kernel's OOM killer ended {killed} process(es) on this host meanwhile: the "
            "models need more memory than the host or container gives"
        )


class Watchdog(threading.Thread):
    """Reloads (unload + load over the repository API) any model one of whose stubs vanished."""

    def __init__(
        self,
        server_pid: int,
        http_url: str,
        admin_key: str,
        interval_s: float,
        model_repository: Path,
        reloads: list[tuple[str, float]],
    ):
        super().__init__(daemon=True, name="stub-watchdog")
        self.server_pid = server_pid
        self.model_repository = model_repository
        self.http_url = http_url
        self.admin_key = admin_key
        self.interval_s = interval_s
        self.stopping = threading.Event()
        self.reloads = reloads  # (model, seconds), appended to; kept across server restarts
        self.oom = OomKills()

    def _call(self, path: str, body: dict | None = None, timeout: float = 300) -> bytes:
        request = urllib.request.Request(
            f"http://{self.http_url}{path}",
            data=None if body is None else json.dumps(body).encode(),
            headers={ADMIN_HEADER: self.admin_key, "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()

    def reload(self, model: str) -> None:
        """Mark the model's files changed, then load it: Triton builds a new instance and swaps
        it in, and the ensemble stays loaded. (A load of an unchanged loaded model is a no-op;
        unload + load would unload the ensemble.)"""
        start = time.monotonic()
        os.utime(self.model_repository / model / "config.pbtxt")
        self._call(f"/v2/repository/models/{model}/load", {})
        self.reloads.append((model, time.monotonic() - start))
        log(f"watchdog: reloaded {model!r} in {time.monotonic() - start:.1f}s")

    def run(self) -> None:
        known = server_stubs(self.server_pid)
        # Models whose stub died and that are not reloaded yet: (when to try, the wait after a
        # failed try, doubling up to RELOAD_BACKOFF_MAX_S so a load that keeps failing is not
        # logged every second).
        pending: dict[str, tuple[float, float]] = {}
        # The dead stubs' shared memory, which Triton leaves behind: removed once the model is
        # reloaded (Triton has let go of the old instance by then).
        left: dict[str, list[str]] = {}
        while not self.stopping.wait(self.interval_s):
            alive = server_stubs(self.server_pid)
            dead = [stub for pid, stub in known.items() if pid not in alive]
            for stub in dead:
                left.setdefault(stub.model, []).append(stub.region)
            for model in sorted({stub.model for stub in dead} - pending.keys()):
                why = self.oom.since()
                died = f"died ({why})" if why else "died"
                log(f"watchdog: a Python stub of {model!r} {died}; reloading it")
                pending[model] = (0.0, self.interval_s)
            reloading = False
            for model, (due, wait) in sorted(pending.items()):
                if self.stopping.is_set():
                    return
                if time.monotonic() < due:
                    continue
                reloading = True
                try:
                    self.reload(model)
                    del pending[model]
                    remove_regions(left.pop(model, []))
                except OSError as e:  # the server shutting down, a load that failed: later
                    said = e.read().decode(errors="replace") if isinstance(e, HTTPError) else ""
                    log(f"watchdog: reloading {model!r} failed: {e} {said}".rstrip())
                    pending[model] = (time.monotonic() + wait, min(2 * wait, RELOAD_BACKOFF_MAX_S))
            # after a reload, its new stubs; a newly dead model is always tried at once
            known = server_stubs(self.server_pid) if reloading else alive


def edited_configs(model_repository: Path, edit: Edit) -> dict[str, ModelConfig]:
    """The repository's model configs, by model name, as `edit` leaves them."""
    configs = repository_configs(model_repository)
    for name, config in configs.items():
        edit(name, config)
    return configs


def facts_ahead(configs: dict[str, ModelConfig]) -> Callable[..., dict]:
    """The facts of every tokenizer and encoder of `configs` (edited_configs'), worked out at
    once; publish_facts' `facts` (a lookup of them). An encoder's facts name its route, which
    takes torch to find: they are worked out in a child process, so that the launcher, alive
    as long as the server, stays without torch; the tokenizers' here meanwhile, so the
    checkpoints' files are hashed while the child imports torch."""
    questions = [q for c in configs.values() if (q := facts_question(c)) is not None]

    def key(params: dict, kind: str, tokenizer: bool) -> str:
        return json.dumps([params, kind, tokenizer], sort_keys=True)

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        later = {key(*q): child.submit(model_facts, *q) for q in questions if not q[2]}
        answers = {key(*q): model_facts(*q) for q in questions if q[2]}
        answers |= {k: future.result() for k, future in later.items()}
    return lambda *question: answers[key(*question)]


class Floor(NamedTuple):
    """An encoder's instances, the host memory its weights take at least per instance, and
    the elements they hold (engine.host_weights)."""

    instances: int
    each: int
    elements: int


def weights_floor(
    configs: dict[str, ModelConfig], facts: Callable[..., dict], loaded: list[str]
) -> dict[str, Floor]:
    """Each loaded encoder's Floor, those whose weights take any host memory; `configs` and
    `facts` as facts_ahead's."""
    floors = {}
    for name, config in sorted(configs.items()):
        question = facts_question(config)
        if name not in loaded or question is None or question[2]:
            continue
        instances = sum(g.count or 1 for g in config.instance_group) or 1
        said = facts(*question)
        if each := said.get("host_weight_bytes", 0):
            floors[name] = Floor(instances, each, said["host_weight_elements"])
    return floors


def weights_room(
    floors: dict[str, Floor],
    limit: tuple[int, str] | None,
    available: int | None,
    reranking: set[str],
) -> tuple[bool, str] | None:
    """(True, an error) where the encoders' weights alone (`floors`: weights_floor's) need
    more memory than the host or container has at all (`limit`: host.memory_limit's, None:
    not known): the load could only end in the OOM killer, minutes later; (False, a warning)
    where they need more than the host has available now; None where they fit. The error
    names the ways out that apply (fewer instances where a model has several, dtype bfloat16
    where a model holds its weights wider, --no-rerank where a reranker adds)."""
    need = sum(f.instances * f.each for f in floors.values())
    said = ", ".join(
        f"{name} {f.instances} x {f.each / 2**30:.1f} GiB" for name, f in floors.items()
    )
    what = f"the encoders' weights alone need at least {need / 2**30:.1f} GiB of memory ({said})"
    ways = (
        ["fewer encoder instances (--cpu-instances)"]
        if any(f.instances > 1 for f in floors.values())
        else []
    )
    if any(f.each > 2 * f.elements for f in floors.values()):
        ways.append("dtype=bfloat16 (2 bytes a weight instead of 4)")
    ways += ["quantization=int8"] + (["--no-rerank"] if reranking & set(floors) else [])
    if limit is not None and need > limit[0]:
        return True, (
            f"{what}, more than {limit[1]} ({limit[0] / 2**30:.1f} GiB): "
            f"{', '.join(ways)}, or a larger machine"
        )
    if available is not None and need > available:
        return False, (
            f"warning: {what}, and this host has {available / 2**30:.1f} GiB available now: "
            "the load may end in the OOM killer"
        )
    return None


def log(message: str) -> None:
    print(f"[qwen-embed launcher] {message}", file=sys.stderr, flush=True)


def wait_ready(http_url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return True
        except (OSError, http.client.HTTPException):  # the latter: another server's port
            pass
        time.sleep(READY_POLL_S)
    return False


def served_model_names(model_dir: str, name: str = "embed") -> list[str] | None:
    """The gateway's names of a model (the embed model's `embed`, the reranker's `rerank`)
    where none are asked for: `name`, and for a model Ollama pulled (`ollama:NAME`) the names
    Ollama's clients send for it."""
    if model_dir.startswith(ollama_store.PREFIX):
        names = ollama_store.client_names(model_dir.removeprefix(ollama_store.PREFIX))
        return list(dict.fromkeys([name, *names]))  # `ollama:embed` names `embed` once
    return None


def gateway_models(model_repository: Path, rerank: bool) -> tuple[list[str], list[str]]:
    """The ensembles the gateway serves: the repository's embedders, and its rerankers where
    they are loaded."""
    embedders, rerankers = ensembles(model_repository)
    return embedders, rerankers if rerank else []


def gateway_model_flags(
    models: tuple[list[str], list[str]],
    names: list[str] | None = None,
    first_names: list[str] | None = None,
    first_rerank_names: list[str] | None = None,
    embed_reranks: bool = False,
) -> list[str]:
    """The gateway's flags for `models` (gateway_models), each ensemble with its names:
    `names`, --served-model-name's items, give the first embedder's (plain names) and another
    ensemble's (ENSEMBLE=NAME[,ALIAS...]); else the first embedder's are `first_names`, the
    first reranker's `first_rerank_names` (a model Ollama pulled: served_model_names), any
    other's its own name. `embed_reranks`: the rerank routes ask the embed model (an
    embedder's rerank_recipe). ValueError for an ENSEMBLE the gateway does not serve, the
    first embedder named both ways, or a name given to two models (the gateway would refuse
    it only once the server is up)."""
    embedders, rerankers = models
    plain = [n for n in names or [] if "=" not in n]
    named = {}
    for item in names or []:
        if "=" in item:
            ensemble, _, aliases = item.partition("=")
            if ensemble not in (*embedders, *rerankers):
                serves = ", ".join([*embedders, *rerankers])
                raise ValueError(
                    f"--served-model-name {item}: the gateway serves no model {ensemble!r} "
                    f"(it serves {serves})"
                )
            named[ensemble] = [a for a in aliases.split(",") if a]
    if plain and embedders and embedders[0] in named:
        raise ValueError(f"--served-model-name names {embedders[0]} twice: plainly and with '='")

    def names_of(ensemble: str, first: list[str] | None = None) -> list[str]:
        return named.get(ensemble) or first or [ensemble]

    embed_names = {
        e: names_of(e, (plain or first_names) if i == 0 else None) for i, e in enumerate(embedders)
    }
    rerank_names = {
        r: names_of(r, first_rerank_names if i == 0 else None) for i, r in enumerate(rerankers)
    }
    _distinct_names(embed_names, rerank_names)

    def served(names: dict[str, list[str]]) -> list[str]:
        return [f"{ensemble}={','.join(n)}" for ensemble, n in names.items()]

    flags = []
    if embedders:
        flags += ["--triton-model", *served(embed_names)]
    if embed_reranks:
        flags += ["--triton-rerank-model", "embed"]
    elif not rerankers:
        flags += ["--rerank-model-name", ""]
    else:
        flags += ["--triton-rerank-model", *served(rerank_names)]
    return flags


def _distinct_names(embedders: dict[str, list[str]], rerankers: dict[str, list[str]]) -> None:
    """ValueError where a name is given to two models, as the gateway refuses it; the first
    embedder and the first reranker answer together and may share one."""
    firsts = {next(iter(embedders), None), next(iter(rerankers), None)}
    owner: dict[str, str] = {}
    for ensemble, names in [*embedders.items(), *rerankers.items()]:
        for name in names:
            other = owner.setdefault(name, ensemble)
            if other != ensemble and {other, ensemble} != firsts:
                raise ValueError(
                    f"--served-model-name: {name!r} is given to two models ({other}, {ensemble})"
                )


def start_gateway(
    host: str,
    port: int,
    grpc_port: int,
    models: tuple[list[str], list[str]],
    model_flags: list[str],
    otlp_endpoint: str | None = None,
    embed_reranks: bool = False,
) -> subprocess.Popen:
    """The HTTP gateway (OpenAI, NIM, TEI and Cohere APIs) in front of this server's gRPC port
    (same interpreter), serving `models` (gateway_models) by `model_flags`
    (gateway_model_flags); `embed_reranks`: its rerank routes ask the embed model."""
    embedders, rerankers = models
    cmd = [
        sys.executable,
        "-m",
        "qwen_embed_client.gateway",
        "--host",
        host,
        "--port",
        str(port),
        "--triton-url",
        f"127.0.0.1:{grpc_port}",
        *model_flags,
    ]
    if otlp_endpoint:
        cmd += ["--otlp-endpoint", otlp_endpoint]
    scheme = "https" if os.environ.get("QWEN_EMBED_SSL_CERTFILE") else "http"
    reranks = bool(rerankers) or embed_reranks
    others = [*embedders[1:], *rerankers[1:]]
    log(
        f"gateway: {scheme}://{host}:{port} (OpenAI /v1/embeddings, TEI /embed, Cohere /v2/embed"
        + (", and their rerank routes)" if reranks else ")")
        + (f"; beside them, for requests that name them: {', '.join(others)}" if others else "")
    )
    return subprocess.Popen(cmd, preexec_fn=_die_with_parent)


class Gateway:
    """The gateway's process (start_gateway's), started again when it exits unasked, as the
    server is: a gateway that died would leave its port closed beside a healthy server."""

    def __init__(self, start: Callable[[], subprocess.Popen]):
        self._start = start
        self.proc = start()
        self.restarts: list[float] = []

    def keep_up(self) -> bool:
        """Start it again if it exited; False where it exited too often (may_restart)."""
        if self.proc.poll() is None:
            return True
        status = exit_status(self.proc.returncode)
        if not may_restart(self.restarts, time.monotonic()):
            log(f"gateway exited unasked ({status}), restarted too often: stopping the server")
            return False
        log(f"gateway exited unasked ({status}): starting it again")
        self.restarts.append(time.monotonic())
        self.proc = self._start()
        return True

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def close(self, timeout_s: float = 10) -> None:
        """Stopped, and waited for: its requests in flight finish within `timeout_s`, else
        they are cut."""
        self.stop()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # requests it was still sending again
            self.proc.kill()
            self.proc.wait()


def _die_with_parent() -> None:
    # tritonserver runs in its own session (so a signal to our group reaches it only through
    # us, once); this makes it exit if this process is killed outright.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def check_ports(host: str, ports: dict[str, int]) -> None:
    """Each port (by its flag; 0: off) free on `host` and none given twice, else ValueError:
    Triton binds its ports only once every model has loaded, minutes into a large model's
    start."""
    taken: dict[int, str] = {}
    for flag, port in ports.items():
        if not port:
            continue
        if port in taken:
            raise ValueError(f"{flag} and {taken[port]} are both port {port}")
        taken[port] = flag
        family, kind, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
            try:
                s.bind(address)
            except OSError as e:
                raise ValueError(f"{flag} {port} on {host}: {e.strerror}") from None


def shared_memory_warning(shared: int | None) -> str | None:
    """What a small /dev/shm (Docker's and Kubernetes' default: 64 MiB) costs, where it costs
    anything: the models pass every request's tensors through it, so each may return less."""
    limit = answer_bytes_limit(shared)
    if shared is None or limit >= MAX_ANSWER_BYTES:
        return None
    return (
        f"warning: /dev/shm holds {shared >> 20} MiB, through which the models pass every "
        f"request's tensors: one request may return {limit >> 20} MiB of vectors here "
        f"({MAX_ANSWER_BYTES >> 20} MiB from {4 * MAX_ANSWER_BYTES >> 20} MiB up); give it "
        "more (docker run --shm-size=2g; in Kubernetes an emptyDir of medium Memory there)"
    )


def loads_rerank(args: argparse.Namespace) -> bool:
    """Whether the reranking models load: not with --no-rerank, nor where a recipe reranks on
    the embed model."""
    return not (args.no_rerank or args.rerank_recipe)


def _deployment(args: argparse.Namespace, gpus: int) -> tuple:
    """What the deployment asks for, read before any server starts: the repository's edit, the
    models' facts and what is said of the served copy. A setting out of range, or encoders
    whose weights cannot fit in memory (weights_room), raises ValueError, a checkpoint not
    found FileNotFoundError."""
    check_ports(
        args.host,
        {
            "--http-port": args.http_port,
            "--grpc-port": args.grpc_port,
            "--metrics-port": args.metrics_port,
            "--gateway-port": args.gateway_port,
        },
    )
    count = cpu_instances(args.cpu_instances, len(read_topology()), gpus > 0)
    per_gpu = gpu_instances(args.gpu_instances) if gpus else None
    groups, what = None, []
    if count is not None:
        what.append(f"{count} CPU encoder instance(s)")
    elif per_gpu is not None:
        cpus = len(os.sched_getaffinity(0))
        groups = tuple(map(instance_group, gpu_instance_groups(gpus, cpus, per_gpu)))
        what.append(f"{per_gpu} encoder instance(s) on each of {gpus} GPU(s)")
    if args.response_cache_mb:
        what.append("the response cache on")
    cache = args.response_cache_mb > 0
    recipe = args.rerank_recipe or ""
    if recipe:
        what.append(f"{recipe}'s reranking on the embed model")
    edit = served_edits(count, args.cpu_instances == "auto", groups, cache, recipe)
    configs = edited_configs(args.model_repository, edit)
    facts = facts_ahead(configs)
    rerank = loads_rerank(args)
    loaded = repository_models(args.model_repository, rerank)
    floors = weights_floor(configs, facts, loaded)
    reranking = rerank_models(args.model_repository)
    room = weights_room(floors, memory_limit(), memory_available(), reranking)
    if room is not None and room[0]:
        raise ValueError(room[1])
    if room is not None:
        log(room[1])
    return edit, facts, what


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-repository", type=Path, default=MODEL_REPOSITORY)
    p.add_argument(
        "--host",
        default=os.environ.get("QWEN_EMBED_HOST", "0.0.0.0"),
        help="address the HTTP, gRPC and metrics endpoints bind to",
    )
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument(
        "--admin-key",
        default=os.environ.get("QWEN_EMBED_ADMIN_KEY") or None,
        help="opens the restricted APIs to requests with header admin-key",
    )
    p.add_argument("--exit-timeout-secs", type=int, default=30)
    p.add_argument("--watchdog-interval", type=float, default=1.0, help="0 turns it off")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=600,
        help="seconds a server may take to be ready before the launcher stops it and exits 1",
    )
    p.add_argument(
        "--status-file",
        type=Path,
        help="JSON with the server pid, the repository it serves and the watchdog's reloads",
    )
    p.add_argument(
        "--cpu-instances",
        default="auto",
        help="encoder instances without GPUs: auto (one per NUMA node), config "
        "(the repository's), or a count",
    )
    p.add_argument(
        "--gpu-instances",
        default="auto",
        help="encoder instances per GPU on a host with GPUs: auto (1, KIND_GPU, tokenizers "
        "scaled to the CPUs), config (the repository's), or a count",
    )
    p.add_argument(
        "--gateway-port",
        type=int,
        default=0,
        help="also serve the HTTP gateway (OpenAI, NIM, TEI, Cohere APIs) on this port (0: off)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        help="the gateway's names of the embed model, one or more (default: embed, and for "
        "MODEL_DIR ollama:NAME the names Ollama's clients send); the first is the one responses "
        "give; ENSEMBLE=NAME[,ALIAS...] names another model of the repository (default: its "
        "own name)",
    )
    p.add_argument("--no-rerank", action="store_true", help="do not load the rerank models")
    p.add_argument(
        "--rerank-recipe",
        choices=RERANK_RECIPES,
        help="the embed model reranks as its authors do (e2rank: E2Rank's pseudo query); the "
        "rerank models are not loaded and the gateway's rerank routes use the embed model",
    )
    p.add_argument(
        "--response-cache-mb",
        type=int,
        default=int(os.environ.get("RESPONSE_CACHE_MB") or 0),
        help="Triton's response cache for the encoders, in MiB (0: off; $RESPONSE_CACHE_MB)",
    )
    p.add_argument(
        "--otlp-endpoint",
        default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None,
        help="OTLP/HTTP collector base URL: traces from Triton and the gateway "
        "($OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    p.add_argument(
        "--trace-rate",
        type=int,
        default=1,
        help="with --otlp-endpoint, Triton traces one request in N (0: only requests that "
        "carry a trace context)",
    )
    p.add_argument("extra", nargs="*", help="more tritonserver flags, after --")
    args = p.parse_args(argv)

    admin_key = args.admin_key or secrets.token_urlsafe(24)
    ports = (args.http_port, args.grpc_port, args.metrics_port)
    gpus = gpu_count()
    try:
        edit, facts, what = _deployment(args, gpus)
        models = gateway_models(args.model_repository, loads_rerank(args))
        model_flags = gateway_model_flags(
            models,
            args.served_model_name,
            served_model_names(os.environ.get(MODEL_DIR_ENV, "")),
            served_model_names(os.environ.get(RERANK_MODEL_DIR_ENV, ""), "rerank"),
            args.rerank_recipe is not None,
        )
    except (ValueError, FileNotFoundError) as e:  # a setting or checkpoint: said, no traceback
        log(f"error: {e}")
        return 2
    if (warning := shared_memory_warning(shared_memory_bytes())) is not None:
        log(warning)
    served = edited_copy(args.model_repository, edit, partial(publish_facts, facts=facts))
    if served != args.model_repository:
        what = ", ".join(["the models' facts", *what])
        log(f"serving a copy with {what}: {served}")
        atexit.register(shutil.rmtree, served.parent, ignore_errors=True)
        args.model_repository = served
    cmd, env = server_command()
    rerank = loads_rerank(args)
    shm_prefix = f"qwen_embed_{os.getpid()}_"  # this server's own, to remove after a crash
    cmd += triton_args(
        args.model_repository,
        args.host,
        ports,
        admin_key,
        args.exit_timeout_secs,
        rerank,
        shm_prefix,
    )
    cmd += cache_args(args.response_cache_mb)
    cmd += trace_args(args.otlp_endpoint, args.trace_rate)

    def start_server() -> subprocess.Popen:
        return subprocess.Popen(
            cmd + args.extra, env=env, start_new_session=True, preexec_fn=_die_with_parent
        )

    oom = OomKills()
    proc = start_server()
    watchdog = None
    gateway = None
    asked_to_stop = threading.Event()

    def stop(why: str) -> None:
        if asked_to_stop.is_set():  # passed on once
            return
        asked_to_stop.set()
        if watchdog is not None:
            watchdog.stopping.set()  # stubs exit on shutdown: that is no reason to reload
        if gateway is not None and gateway.proc.poll() is None:
            # first: a draining Triton refuses new requests, and a gateway request of many
            # texts may still have chunks to send
            log(f"{why}: the gateway finishing its requests, then the server")
            gateway.close(args.exit_timeout_secs)
        if proc.poll() is None:
            log(f"{why}: draining in-flight requests, then exiting")
            proc.send_signal(signal.SIGTERM)

    def forward(signum, _frame):
        stop(f"signal {signum}")

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    local = f"127.0.0.1:{args.http_port}"
    reloads: list[tuple[str, float]] = []
    restarts: list[tuple[float, float]] = []  # (when, seconds until ready again)

    def start_watchdog() -> Watchdog | None:
        if args.watchdog_interval <= 0:
            return None
        dog = Watchdog(
            proc.pid, local, admin_key, args.watchdog_interval, args.model_repository, reloads
        )
        dog.start()
        return dog

    ready = wait_ready(local, proc, args.startup_timeout)
    if ready:
        watchdog = start_watchdog()
        if watchdog:
            log(f"watchdog on: checking the Python stubs every {args.watchdog_interval}s")
    if ready and args.gateway_port:
        gateway = Gateway(
            partial(
                start_gateway,
                args.host,
                args.gateway_port,
                args.grpc_port,
                models,
                model_flags,
                args.otlp_endpoint,
                args.rerank_recipe is not None,
            )
        )
    gateway_failed = False
    while ready:
        while proc.poll() is None:
            if args.status_file:
                write_status(args.status_file, proc.pid, args.model_repository, reloads, restarts)
            if gateway is not None and not asked_to_stop.is_set() and not gateway.keep_up():
                gateway_failed = True
                stop("the gateway keeps exiting")
            time.sleep(0.5)
        if asked_to_stop.is_set():
            break
        status = "; ".join(filter(None, [exit_status(proc.returncode), oom.since()]))
        if not may_restart([when for when, _ in restarts], time.monotonic()):
            log(f"tritonserver exited unasked ({status}), restarted too often: giving up")
            break
        log(f"tritonserver exited unasked ({status}): starting it again")
        if watchdog is not None:
            watchdog.stopping.set()
        clear_dead_server(shm_prefix)
        began = time.monotonic()
        proc = start_server()
        ready = wait_ready(local, proc, args.startup_timeout)
        if ready:
            restarts.append((began, round(time.monotonic() - began, 1)))
            log(f"tritonserver ready again in {restarts[-1][1]}s")
            watchdog = start_watchdog()
    failed = not ready and not asked_to_stop.is_set()
    if failed:
        if proc.poll() is None:  # a server nobody watches would serve without its gateway
            said = f"tritonserver not ready in {args.startup_timeout:g}s: stopped it"
            proc.terminate()
        else:
            status, why = exit_status(proc.returncode), oom.since()
            cause = f"({status}; {why})" if why else f"({status}): its log above says why"
            said = f"tritonserver exited before it was ready {cause}"
    if gateway is not None:
        gateway.close()
    returncode = proc.wait()
    clear_dead_server(shm_prefix)
    if failed:  # the last line, once nothing of the server is left to write after it
        log(said)
    return max(returncode, 1) if failed or gateway_failed else returncode


def may_restart(restarted_at: list[float], now: float) -> bool:
    """Whether a server that died may start again: fewer than RESTART_LIMIT restarts in the last
    RESTART_WINDOW_S, so one that keeps dying is left to the orchestrator."""
    return sum(when > now - RESTART_WINDOW_S for when in restarted_at) < RESTART_LIMIT


def exit_status(returncode: int) -> str:
    if returncode >= 0:
        return f"exit status {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:  # a number Python has no name for
        return f"signal {-returncode}"


def write_status(
    path: Path,
    server_pid: int,
    model_repository: Path,
    reloads: list[tuple[str, float]],
    restarts: list[tuple[float, float]],
) -> None:
    unfinished = path.with_suffix(".partial")  # never read half written
    status = {
        "server_pid": server_pid,
        "model_repository": str(model_repository),
        "reloads": reloads,
        "restarts": [seconds for _, seconds in restarts],
    }
    unfinished.write_text(json.dumps(status))
    os.replace(unfinished, path)


if __name__ == "__main__":
    sys.exit(main())
