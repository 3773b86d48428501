"""llama.cpp's llama-server as a benchmark peer (install with perf/peers/install_llama_cpp.sh).

    sys.path.insert(0, "perf/peers"); import llama_cpp
    model = llama_cpp.gguf(Path(".cache/bench-model-4l"), "bf16")  # f32 bf16 q8_0 q4_k_m, cached
    tower = llama_cpp.gguf(Path(".cache/bench-qwen3-vl"), "f16", mmproj=True)  # Qwen3-VL's
    cmd = llama_cpp.server_command("patched", model, port)          # "stock" | "patched"
    # ready when GET HEALTH answers 200; POST ENDPOINT {"model": "x", "input": [texts]}

Two builds of the same llama.cpp commit: "stock", and "patched" with
llama_cpp_skip_output_head.patch, which skips qwen3's 151k-wide output head in embedding mode
(stock computes it for every token and throws it away). The GGUF files are converted by
llama.cpp's own convert_hf_to_gguf.py from a view of the checkpoint (symlinks plus two edited
JSON files) under .cache/peers/llama/hf/; q4_k_m (Ollama's default type: Q4_K with Q6_K for the
embedding table and some layers) is the bf16 file quantised by the stock build's llama-quantize,
as llama.cpp's and Ollama's users make it. The converter reads the tokenizer.json post-processor,
so the GGUF appends <|endoftext|> as the Qwen3-Embedding tokenizer does (usage.prompt_tokens
equals our token count).

Run as a script to print the command:  python perf/peers/llama_cpp.py MODEL_DIR bf16 patched
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from prepare_model import prepare

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / ".cache" / "peers" / "llama"
VENV_PYTHON = ROOT / "venv" / "bin" / "python"
CONVERTER = ROOT / "stock" / "llama.cpp" / "convert_hf_to_gguf.py"
BUILDS = ("stock", "patched")
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # the converter's
QUANTIZED = {"q4_k_m": "Q4_K_M"}  # llama-quantize's, from the bf16 file
ENDPOINT = "/v1/embeddings"
RERANK_ENDPOINT = "/v1/rerank"  # Cohere's form: query, documents -> results, relevance_score
HEALTH = "/health"

# Tuned on 2 cores (4-layer Qwen3-0.6B shape, texts of 17-1025 tokens): one thread per core;
# 16 slots so a request's texts and concurrent requests share a decode; every text must fit
# in one micro-batch (-ub, here the longest text is 1025 tokens) and in its slot's share of the
# context (-c / --parallel). In embedding mode the server sets -b to -ub, so they are one knob.
# Measured (patched, bf16, 8 clients x 8 texts): --parallel 4/8/16/32 and -ub 2048/4096/8192
# all within noise of each other (~1000-1150 tok/s); flash attention (auto = on) a little
# ahead of -fa off; q8_0 gets no CPU_REPACK buffer here, so --no-repack changes nothing.
THREADS = os.cpu_count() or 2
PARALLEL = 16
UBATCH = 2048
SLOT_TOKENS = 2048


def binary(build: str, tool: str = "llama-server") -> Path:
    if build not in BUILDS:
        raise ValueError(f"build is one of {BUILDS}, not {build!r}")
    path = ROOT / f"build-{build}" / "bin" / tool
    if not path.exists():
        raise FileNotFoundError(f"{path}: run perf/peers/install_llama_cpp.sh")
    return path


def converter_view(model_dir: Path, reranker: bool = False) -> Path:
    """ROOT/hf/NAME-llama: symlinks to model_dir plus the JSON edits the converter needs
    (prepare_model.py's "llama" view; a Qwen3-Reranker's: "llama-rerank")."""
    src = Path(model_dir).resolve()
    return prepare(src, ROOT / "hf" / _digest(src), "llama-rerank" if reranker else "llama")


def gguf(model_dir: Path, outtype: str, reranker: bool = False, mmproj: bool = False) -> Path:
    """The GGUF of model_dir in outtype, converted on first use (seconds to a minute);
    `reranker`: a Qwen3-Reranker's, with its head's "yes"/"no" rows and rerank template;
    `mmproj`: a Qwen3-VL checkpoint's vision tower (llama-server's --mmproj file)."""
    if outtype not in (*OUTTYPES, *QUANTIZED):
        raise ValueError(f"outtype is one of {OUTTYPES + tuple(QUANTIZED)}, not {outtype!r}")
    src = Path(model_dir).resolve()
    kind = "-rerank" if reranker else "-mmproj" if mmproj else ""
    out = ROOT / "models" / f"{src.name}-{_digest(src)}{kind}-{outtype}.gguf"
    newest = max(p.stat().st_mtime for p in src.iterdir() if p.is_file())
    if out.exists() and out.stat().st_mtime >= newest:
        return out
    if not VENV_PYTHON.exists() or not CONVERTER.exists():
        raise FileNotFoundError(f"{VENV_PYTHON}, {CONVERTER}: run perf/peers/install_llama_cpp.sh")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    if outtype in QUANTIZED:
        source = gguf(src, "bf16", reranker)
        cmd = [str(binary("stock", "llama-quantize")), str(source), str(tmp), QUANTIZED[outtype]]
    else:
        view = converter_view(src, reranker)
        cmd = [str(VENV_PYTHON), str(CONVERTER), str(view), "--outtype", outtype]
        cmd += ["--outfile", str(tmp), *(["--mmproj"] if mmproj else [])]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")
    tmp.replace(out)
    return out


def server_command(
    build: str,
    gguf: Path,
    port: int,
    *,
    threads: int = THREADS,
    parallel: int = PARALLEL,
    ubatch: int = UBATCH,
    slot_tokens: int = SLOT_TOKENS,
    rerank: bool = False,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """llama-server serving gguf's last-token embeddings on 127.0.0.1:port (`rerank`: its
    reranking endpoint, RERANK_ENDPOINT, over a reranker's file)."""
    mode = ["--reranking"] if rerank else ["--embedding", "--pooling", "last"]
    return [
        str(binary(build)),
        "-m",
        str(gguf),
        *mode,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--parallel",
        str(parallel),
        "-c",
        str(parallel * slot_tokens),
        "-b",
        str(ubatch),
        "-ub",
        str(ubatch),
        "--no-webui",
        "--log-disable",
        *extra,
    ]


def versions() -> str:
    path = ROOT / "versions.txt"
    return path.read_text().strip() if path.exists() else "not installed"


def _digest(src: Path) -> str:
    """Short key of the checkpoint's path, so two folders of the same name do not collide."""
    return hashlib.sha1(str(src).encode()).hexdigest()[:8]


if __name__ == "__main__":
    model, outtype, build = sys.argv[1], sys.argv[2], sys.argv[3]
    print(" ".join(server_command(build, gguf(Path(model), outtype), 8080)))
