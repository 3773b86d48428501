"""perf_analyzer --input-data files from the seeded text mix of perf/workload.py.

    python perf/perf_analyzer/make_inputs.py [--texts 1024] [--seed 0] [--out DIR]

Writes, under --out (default .cache/perf_analyzer/inputs):
- embed.json: one entry ("step") per text, TEXT as a UTF-8 string. perf_analyzer fills a
  request of `-b n` from n consecutive steps (each step is one batch-1 tensor of shape [1]), so
  the same file serves 1, 8 and 32 texts per request and consecutive requests carry other texts.
- encoder.json: the same texts as the tokenizer model would hand the encoder: TOKEN_IDS is one
  BYTES element of packed little-endian int32 ids. perf_analyzer copies a {"b64": ...} value
  verbatim as the tensor's serialized bytes, and Triton serializes BYTES as a 4-byte
  little-endian length before each element, so the blob carries that prefix itself.
- lengths.json: tokens per text (the appended <|endoftext|> included) and their percentiles.
"""

from __future__ import annotations

import argparse
import base64
import json
import struct
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/workload.py
from qwen_embed_client.contract import EmbedOptions, pack_ids  # noqa: E402
from qwen_embed_deploy.serving.config import DEMO_MODEL_DIR, REPO  # noqa: E402
from qwen_embed_deploy.serving.tokenizer import TextTokenizer  # noqa: E402

from workload import LONG_FRACTION, LONG_WORDS, SHORT_WORDS, make_texts  # noqa: E402

DEFAULT_OUT = REPO / ".cache" / "perf_analyzer" / "inputs"
PERCENTILES = (5, 25, 50, 75, 90, 95, 99)


def bytes_element(blob: bytes) -> dict:
    return {"b64": base64.b64encode(struct.pack("<I", len(blob)) + blob).decode()}


def length_stats(counts: list[int]) -> dict:
    arr = np.asarray(counts)
    return {
        "texts": len(counts),
        "mix": f"{100 - 100 * LONG_FRACTION:.0f}% {SHORT_WORDS[0]}-{SHORT_WORDS[1]} words, "
        f"{100 * LONG_FRACTION:.0f}% {LONG_WORDS[0]}-{LONG_WORDS[1]} words",
        "mean_tokens": float(arr.mean()),
        "min_tokens": int(arr.min()),
        "max_tokens": int(arr.max()),
        "percentiles": {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES},
        "share_over_256_tokens": float((arr > 256).mean()),
    }


def write_inputs(texts: int, seed: int, out: Path, model_dir: Path = DEMO_MODEL_DIR) -> dict:
    items = make_texts(texts, seed)
    # The server's own tokenizer code and default options, so the encoder gets what
    # the tokenizer model would send it.
    ids = TextTokenizer(model_dir, max_input_tokens=8192).encode(items, EmbedOptions())
    out.mkdir(parents=True, exist_ok=True)
    embed = {"data": [{"TEXT": [t]} for t in items]}
    encoder = {"data": [{"TOKEN_IDS": bytes_element(pack_ids(x))} for x in ids]}
    (out / "embed.json").write_text(json.dumps(embed))
    (out / "encoder.json").write_text(json.dumps(encoder))
    stats = {"seed": seed, **length_stats([len(x) for x in ids])}
    (out / "lengths.json").write_text(json.dumps(stats, indent=2))
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--texts", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path, default=DEMO_MODEL_DIR)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    stats = write_inputs(args.texts, args.seed, args.out, args.model_dir)
    print(json.dumps(stats, indent=2))
    print(f"wrote {args.out}/embed.json, encoder.json, lengths.json")


if __name__ == "__main__":
    main()
