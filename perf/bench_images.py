"""Images beside llama.cpp: Qwen3-VL-Embedding served from the GGUF files llama.cpp writes.

    cd perf && python bench_images.py [--inputs 48] [--clients 4] [--seconds 40] [--rounds 2]
        [--dtype auto] [--systems triton-gguf llama-best llama] [--out results/images-llama]

The model: bench_engine.py's small Qwen3-VL replica (`.cache/bench-qwen3-vl`: the published
models' patch and merge sizes and a 1024-wide tower of 4 blocks, 4 text layers of
Qwen3-VL-Embedding-2B's head shape, random weights) with Qwen's tokenizer and its processor's
settings beside it, converted by llama.cpp's own convert_hf_to_gguf.py into its text model (at
the run's dtype) and its vision tower's mmproj file (F16, as the published GGUF repositories
ship it). Each request is one input: a caption of 8-40 words and one PNG of drawn shapes, its
sides multiples of 32 within Qwen3-VL-Embedding's pixel budget (so both servers keep the image
at its own size: the same tokens), `--clients` requests in flight. Systems, taking turns in
each round:
- triton-gguf: our ensemble with MODEL_DIR the folder of the two files (gRPC TEXT and IMAGES);
- llama / llama-best: llama-server --embedding --pooling last --mmproj, as built and with its
  output head skipped (perf/peers/llama_cpp.py), its /embedding with the input written in
  Qwen3-VL-Embedding's chat turn and the image at its media marker.
Every vector is checked against our engine in fp32 on the same files (cosine). Token counts
are ours (llama.cpp's /embedding reports none).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
from pathlib import Path

import numpy as np
from harness import (
    RESULTS,
    cosine_check,
    drive,
    fmt,
    markdown_table,
    new_record,
    triton_sender,
    write_report,
)

from qwen_embed import ModelConfig
from qwen_embed.cpu import cpu_features
from qwen_embed.route import choose_route
from qwen_embed.settings import EncoderSettings
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.triton import TritonServer, free_port

from bench_engine import vl_replica
from bench_peers import PeerServer, llama_cpp
from workload import make_texts

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / ".cache" / "bench-qwen3-vl"
SYSTEMS = {
    "triton-gguf": "ours: Triton ensemble on llama.cpp's two GGUF files",
    "llama-best": "llama.cpp, output head skipped",
    "llama": "llama.cpp as built",
}
# sides that are multiples of 32 (16-pixel patches merged 2 x 2): kept as they are
SIZES = [(224, 224), (320, 256), (448, 352), (512, 384)]
SYSTEM_TURN = "<|im_start|>system\nRepresent the user's input.<|im_end|>\n<|im_start|>user\n"
END_TURN = "<|im_end|>\n<|im_start|>assistant\n"
LLAMA_OUTTYPES = {"float32": "f32", "bfloat16": "bf16"}


def with_files(model_dir: Path) -> Path:
    """The replica with what a published checkpoint carries besides its weights: Qwen's
    tokenizer (the vision tokens; no EOS appended, as Qwen3-VL's) and the processor's
    settings."""
    from qwen_embed_deploy.demo import write_tokenizer

    vl_replica(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        write_tokenizer(model_dir, append_eos=False)
    processor = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    path, text = model_dir / "preprocessor_config.json", json.dumps(processor, indent=2)
    # Written only when it differs: llama_cpp.gguf converts again after a newer file.
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return model_dir


def make_inputs(n: int, seed: int) -> list[tuple[str, bytes]]:
    """n (caption, PNG) pairs: short texts of the perf mix and drawn images of SIZES."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    captions = [" ".join(t.split()[:40]) for t in make_texts(n, seed)]
    inputs = []
    for i, caption in enumerate(captions):
        width, height = SIZES[i % len(SIZES)]
        image = Image.new("RGB", (width, height), tuple(int(c) for c in rng.integers(0, 255, 3)))
        draw = ImageDraw.Draw(image)
        for _ in range(6):
            x, y = int(rng.integers(0, width - 16)), int(rng.integers(0, height - 16))
            box = (
                x,
                y,
                x + int(rng.integers(8, width // 2)),
                y + int(rng.integers(8, height // 2)),
            )
            color = tuple(int(c) for c in rng.integers(0, 255, 3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=color)
        out = io.BytesIO()
        image.save(out, "PNG")
        inputs.append((caption, out.getvalue()))
    return inputs


def ours_sender(url: str, inputs: list[tuple[str, bytes]]):
    """gRPC to our `embed` ensemble: each caption with its image."""
    captions, images = [c for c, _ in inputs], [[png] for _, png in inputs]
    return triton_sender(url, captions, images=images)


def llama_sender(port: int, inputs: list[tuple[str, bytes]], marker: str):
    """llama-server's /embedding, one input per request, written as Qwen3-VL-Embedding's
    script writes it (the image before the caption)."""
    import httpx

    def make():
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=1800)

        def send(idx):
            (i,) = idx
            caption, png = inputs[i]
            content = {
                "prompt_string": f"{SYSTEM_TURN}{marker}{caption}{END_TURN}",
                "multimodal_data": [base64.b64encode(png).decode()],
            }
            answer = client.post("/embedding", json={"content": content})
            answer.raise_for_status()
            vector = np.asarray(answer.json()[0]["embedding"], dtype=np.float32).reshape(1, -1)
            return vector, None

        return send

    return make


def serve_ours(folder: Path, dtype: str, where: Path) -> TritonServer:
    repo = render(where / f"repo-{dtype}", {"embed": folder}, {"encoder": {"dtype": dtype}})
    return TritonServer(repo, log_path=where / f"triton-{dtype}.log")


def reference(folder: Path, inputs, where: Path) -> tuple[np.ndarray, np.ndarray]:
    """Our fp32 vectors of every input and their token counts."""
    with serve_ours(folder, "float32", where) as server:
        send = ours_sender(server.grpc_url, inputs)()
        vectors, counts = [], []
        for i in range(len(inputs)):
            vector, count = send([i])
            vectors.append(vector[0])
            counts.append(count)
    return np.stack(vectors), np.array(counts)


def run_llama(name: str, files: tuple[Path, Path], inputs, counts, check, args, where) -> dict:
    import httpx

    port = free_port()
    build = "patched" if name == "llama-best" else "stock"
    cmd = llama_cpp.server_command(
        build, files[0], port, parallel=args.clients, extra=("--mmproj", str(files[1]))
    )
    server = PeerServer(cmd, {}, port, llama_cpp.HEALTH, where / f"{name}.log")
    server.start(timeout=300)
    try:
        marker = httpx.get(f"http://127.0.0.1:{port}/props", timeout=30).json()["media_marker"]
        make = llama_sender(port, inputs, marker)
        make()([0])  # warm-up
        return drive(make, counts, check, clients=args.clients, per_request=1, seconds=args.seconds)
    finally:
        server.stop()


def run_ours(folder: Path, dtype: str, inputs, counts, check, args, where) -> dict:
    with serve_ours(folder, dtype, where) as server:
        make = ours_sender(server.grpc_url, inputs)
        make()([0])  # warm-up
        return drive(make, counts, check, clients=args.clients, per_request=1, seconds=args.seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--inputs", type=int, default=48)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seconds", type=float, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS / "images-llama"))
    args = p.parse_args()
    if any(s.startswith("llama") for s in args.systems) and llama_cpp.versions() == "not installed":
        sys.exit("llama.cpp is not installed: perf/peers/install_llama_cpp.sh")
    model_dir = with_files(MODEL)
    config = ModelConfig.from_dir(model_dir)
    dtype = choose_route(EncoderSettings(dtype=args.dtype), config, "cpu", cpu_features()).dtype
    text = llama_cpp.gguf(model_dir, LLAMA_OUTTYPES[dtype])
    tower = llama_cpp.gguf(model_dir, "f16", mmproj=True)
    where = REPO / ".cache" / "bench-images"
    folder = where / f"gguf-{dtype}"
    folder.mkdir(parents=True, exist_ok=True)
    for link, target in (("model.gguf", text), ("mmproj.gguf", tower)):
        (folder / link).unlink(missing_ok=True)
        (folder / link).symlink_to(target)
    inputs = make_inputs(args.inputs, args.seed)
    vectors, counts = reference(folder, inputs, where)
    check = cosine_check(vectors)
    rounds = {name: [] for name in args.systems}
    for r in range(args.rounds):
        order = args.systems[r % len(args.systems) :] + args.systems[: r % len(args.systems)]
        for name in order:
            print(f"round {r + 1}: {name}", flush=True)
            if name == "triton-gguf":
                result = run_ours(folder, dtype, inputs, counts, check, args, where)
            else:
                result = run_llama(name, (text, tower), inputs, counts, check, args, where)
            rounds[name].append(result)
    record = new_record(
        model=str(MODEL),
        dtype=dtype,
        inputs=args.inputs,
        clients=args.clients,
        seconds=args.seconds,
        llama_cpp=llama_cpp.versions(),
        files={"text": text.name, "tower": tower.name},
        tokens_per_input=counts.tolist(),
        rounds=rounds,
    )
    notes, table = report(record)
    write_report(args.out, record, "Images beside llama.cpp (Qwen3-VL-Embedding)", notes, table)


def median_round(results: list[dict]) -> dict:
    return sorted(results, key=lambda r: r["texts_per_s"])[len(results) // 2]


def report(record: dict) -> tuple[list[str], list[str]]:
    rounds = record["rounds"]
    counts = np.array(record["tokens_per_input"])
    notes = [
        f"model: {record['model']} (bench_engine.py's small Qwen3-VL replica, random weights), "
        f"dtype {record['dtype']}; files by llama.cpp's converter: {record['files']['text']} "
        f"(text model), {record['files']['tower']} (vision tower, F16)",
        f"llama.cpp: {'; '.join(record['llama_cpp'].splitlines())}",
        f"load: {record['clients']} clients, one input per request (a caption of up to 40 words "
        f"and one PNG of {', '.join(f'{w}x{h}' for w, h in SIZES)}), {record['seconds']:.0f} s "
        f"per system and round; {record['inputs']} inputs of {counts.min()}-{counts.max()} tokens "
        f"(mean {counts.mean():.0f}, image tokens included)",
        "min cosine: against our engine in fp32 on the same two files",
    ]
    per_round = {name: [r["texts_per_s"] for r in results] for name, results in rounds.items()}
    notes.append(
        "images/s per round: "
        + "; ".join(f"{n}: {', '.join(f'{v:.2f}' for v in vs)}" for n, vs in per_round.items())
    )
    ours = per_round.get("triton-gguf")
    rows = []
    for name, results in rounds.items():
        m = median_round(results)
        ratio = None
        if ours and name != "triton-gguf":
            ratio = statistics.median(a / b for a, b in zip(ours, per_round[name], strict=True))
        rows.append(
            [
                SYSTEMS[name],
                fmt(m["texts_per_s"], ".2f"),
                fmt(m["tokens_per_s"], ".0f"),
                fmt(m["p50_s"], ".2f"),
                fmt(m["p99_s"], ".2f"),
                m["requests"],
                m["failed_requests"],
                fmt(m["min_check"], ".5f"),
                fmt(ratio, ".2f") + "x" if ratio else "",
            ]
        )
    header = [
        "system",
        "images/s",
        "tokens/s",
        "p50 s",
        "p99 s",
        "requests",
        "failed",
        "min cosine",
        "ours over it (median of rounds)",
    ]
    return notes, markdown_table(header, rows)


if __name__ == "__main__":
    main()
