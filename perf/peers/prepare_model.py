"""Per-peer views of one checkpoint directory, each with the small edits that peer needs.

    python perf/peers/prepare_model.py MODEL_DIR OUT_ROOT [--peers vllm infinity naive]

Every file is a symlink to the original except the ones a peer needs changed, so the weights
are shared and all peers read exactly the same tensors. Writes OUT_ROOT/NAME-PEER/.
- vllm: `architectures: ["Qwen3ForCausalLM"]`, the name its pooling runner converts to an
  embedding model (Qwen3-Embedding checkpoints ship that already; `Qwen3Model` ones do not).
- infinity: transformers 4.x reads `rope_theta` only at the top of config.json (without it it
  silently uses 10000) and needs a `tokenizer_class` it knows; its torch engine is
  sentence-transformers, which takes pooling from module files: last token, then normalise.
- llama (llama.cpp's convert_hf_to_gguf.py): the Qwen3 class is chosen by architecture name
  (a Qwen3-VL checkpoint's own name kept: its text model's and its tower's classes), and its
  transformers 4.x does not know tokenizer class TokenizersBackend.
- llama-rerank: llama's, and a README whose title names a Qwen3-Reranker: the converter keeps
  the output head's "yes" and "no" rows and its rerank template only for a name, a README or
  an architecture that says so.
- st: sentence-transformers itself (in process), the module files as for infinity.
- naive: unchanged.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PEERS = ("vllm", "infinity", "naive", "llama", "llama-rerank", "st")

# sentence-transformers pipeline: transformer -> last-token pooling -> L2 normalisation.
ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {
        "idx": 2,
        "name": "2",
        "path": "2_Normalize",
        "type": "sentence_transformers.models.Normalize",
    },
]


def qwen3_family(config: dict) -> bool:
    return config.get("model_type") == "qwen3" or any(
        a.startswith("Qwen3") for a in config.get("architectures", [])
    )


def edited_files(peer: str, src: Path) -> dict[str, dict | str]:
    """Relative path -> content (JSON, or a text) for the files this peer needs different from
    src."""
    config = json.loads((src / "config.json").read_text())
    arch = "Qwen3ForCausalLM" if qwen3_family(config) else "Qwen2ForCausalLM"
    if peer == "vllm":
        return {"config.json": {**config, "architectures": [arch]}}
    tok_path = src / "tokenizer_config.json"
    tok_config = json.loads(tok_path.read_text()) if tok_path.exists() else {}
    if peer in ("llama", "llama-rerank"):
        named = {} if "vision_config" in config else {"architectures": [arch]}
        edits = {
            "config.json": {**config, **named},
            "tokenizer_config.json": {**tok_config, "tokenizer_class": "PreTrainedTokenizerFast"},
        }
        if peer == "llama-rerank":
            edits["README.md"] = "# Qwen3-Reranker (a replica of its layout)\n"
        return edits
    if peer not in ("infinity", "st"):
        return {}
    rope = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    dtype = config.get("torch_dtype", config.get("dtype", "float32"))
    hidden = config["hidden_size"]
    return {
        "config.json": {**config, "rope_theta": theta, "torch_dtype": dtype},
        "tokenizer_config.json": {**tok_config, "tokenizer_class": "PreTrainedTokenizerFast"},
        "modules.json": ST_MODULES,
        "sentence_bert_config.json": {"max_seq_length": 8192, "do_lower_case": False},
        "1_Pooling/config.json": {
            "word_embedding_dimension": hidden,
            "pooling_mode_lasttoken": True,
            "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": False,
            "pooling_mode_max_tokens": False,
            "include_prompt": True,
        },
        "2_Normalize/.keep": {},
    }


def prepare(model_dir: str | Path, out_root: str | Path, peer: str) -> Path:
    """Build (or refresh) OUT_ROOT/<model name>-<peer> and return it."""
    src = Path(model_dir).resolve()
    dest = Path(out_root) / f"{src.name}-{peer}"
    dest.mkdir(parents=True, exist_ok=True)
    edits = edited_files(peer, src)
    for item in src.iterdir():
        link = dest / item.name
        if item.name in edits or not item.is_file():
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(item)
    for rel, content in edits.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            path.unlink()
        text = content if isinstance(content, str) else json.dumps(content, indent=2)
        path.write_text("" if rel.endswith(".keep") else text)
    return dest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("out_root")
    p.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    args = p.parse_args()
    for peer in args.peers:
        print(prepare(args.model_dir, args.out_root, peer))


if __name__ == "__main__":
    main()
