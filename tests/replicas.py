"""Small replicas of real embedding checkpoints, laid out file for file as users download them.

Shapes are tiny (random weights, 2 layers, hidden 64) so the suite stays fast; everything the
server reads is as in the real repositories: config.json's architecture and flags, tensor names
(prefixed or not), dtype and sharding, tokenizer.json's post-processor, tokenizer_config.json's
special-token flags, and the sentence-transformers files (modules.json, pooling, prompts).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3Model

from qwen_embed_deploy.demo import make_listwise, write_tokenizer

QWEN3_QUERY = (
    "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
)
TINY = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=32768,
)


def hub_snapshot(cache: Path, model_id: str, directory: Path | None = None) -> Path:
    """A snapshot of `model_id` as the Hugging Face cache `cache` holds it (refs/main naming
    it): a copy of `directory`, else empty for the caller to fill."""
    repo = cache / f"models--{model_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    if directory is None:
        snapshot.mkdir(parents=True)
    else:
        shutil.copytree(directory, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return snapshot


def _noise(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                1.0 + 0.1 * torch.randn_like(p)
                if name.endswith("norm.weight")
                else 0.05 * torch.randn_like(p)
            )


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def _modules(directory: Path, *types: tuple[str, str]) -> None:
    """modules.json listing (path, type) after the Transformer."""
    modules = [{"path": "", "type": "sentence_transformers.models.Transformer"}]
    modules += [{"path": path, "type": kind} for path, kind in types]
    _write_json(
        directory / "modules.json",
        [{"idx": i, "name": str(i), **module} for i, module in enumerate(modules)],
    )


def _pooling(directory: Path, mode: str, width: int) -> None:
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")
    modes += ("weightedmean_tokens", "lasttoken")
    _write_json(
        directory / "1_Pooling" / "config.json",
        {"word_embedding_dimension": width}
        | {f"pooling_mode_{m}": m == mode for m in modes}
        | {"include_prompt": True},
    )


POOLING = ("1_Pooling", "sentence_transformers.models.Pooling")
NORMALIZE = ("2_Normalize", "sentence_transformers.models.Normalize")


def _sentence_transformers_files(directory: Path, prompts: dict, default: str | None) -> None:
    """Transformer -> last-token Pooling -> Normalize, as both real models ship it."""
    _modules(directory, POOLING, NORMALIZE)
    _pooling(directory, "lasttoken", TINY["hidden_size"])
    (directory / "2_Normalize").mkdir(exist_ok=True)
    _write_json(
        directory / "sentence_bert_config.json", {"max_seq_length": 8192, "do_lower_case": False}
    )
    _write_json(
        directory / "config_sentence_transformers.json",
        {
            "prompts": prompts,
            "default_prompt_name": default,
            "similarity_fn_name": "cosine",
        },
    )


def qwen3_embedding(
    directory: Path,
    *,
    prompts: dict | None = None,
    default_prompt_name: str | None = None,
    seed: int = 0,
) -> Path:
    """Qwen3-Embedding-0.6B's layout: Qwen3ForCausalLM config, tied embeddings, bf16 tensors
    saved from the base model (no `model.` prefix, no lm_head), a tokenizer.json whose
    post-processor appends <|endoftext|>, left padding, its two prompts."""
    config = Qwen3Config(
        **TINY,
        head_dim=16,
        vocab_size=151669,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=151643,
        eos_token_id=151643,
    )
    model = Qwen3Model(config)
    _noise(model, seed)
    model.to(torch.bfloat16).save_pretrained(directory)
    hf = json.loads((directory / "config.json").read_text())
    hf["architectures"] = ["Qwen3ForCausalLM"]
    _write_json(directory / "config.json", hf)
    write_tokenizer(directory, append_eos=True)
    _sentence_transformers_files(
        directory, prompts or {"query": QWEN3_QUERY, "document": ""}, default_prompt_name
    )
    return directory


# Qwen3's chat template as it renders user and assistant turns and the generation prompt
# (tools, system prompts and reasoning histories left out: E2Rank's recipe has none of them).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def e2rank(directory: Path, *, seed: int = 15) -> Path:
    """E2Rank-0.6B's layout as its training code saves it (`AutoModel`: Qwen3Model, tied
    embeddings, no `model.` prefix), Qwen3's tokenizer with its chat template and without
    the post-processor's <|endoftext|> (its README appends that to each text itself)."""
    config = Qwen3Config(
        **TINY,
        head_dim=16,
        vocab_size=151669,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    model = Qwen3Model(config)
    _noise(model, seed)
    model.to(torch.bfloat16).save_pretrained(directory)
    write_tokenizer(directory, append_eos=False)
    path = directory / "tokenizer_config.json"
    _write_json(path, {**json.loads(path.read_text()), "chat_template": QWEN3_CHAT_TEMPLATE})
    return directory


def gte_qwen2(directory: Path, *, seed: int = 1) -> Path:
    """gte-Qwen2-1.5B-instruct's layout: Qwen2ForCausalLM with `is_causal: false`, float32
    tensors with `model.` prefixes and an lm_head, sharded with an index; a tokenizer.json that
    appends nothing while tokenizer_config.json says `add_eos_token: true` (its own remote-code
    tokenizer appends <|endoftext|>); its query prompt ends with a space."""
    config = Qwen2Config(
        **TINY,
        vocab_size=151646,
        is_causal=False,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=151643,
        eos_token_id=151643,
    )
    model = Qwen2ForCausalLM(config)
    _noise(model, seed)
    model.save_pretrained(directory, max_shard_size="8MB")
    assert (directory / "model.safetensors.index.json").is_file()
    write_tokenizer(directory, append_eos=False)
    _write_json(
        directory / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_eos_token": True,
            "bos_token": None,
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": 32768,
            "tokenizer_class": "Qwen2Tokenizer",
            "auto_map": {
                "AutoTokenizer": [
                    "tokenization_qwen.Qwen2Tokenizer",
                    "tokenization_qwen.Qwen2TokenizerFast",
                ]
            },
        },
    )
    _sentence_transformers_files(directory, {"query": QWEN3_QUERY + " "}, None)
    return directory


def _tied_qwen3() -> Qwen3Config:
    """The vendor replicas' Qwen3: TINY with the real vocabulary, tied embeddings and head_dim
    32 (128 in the real models: one the native attention operator has)."""
    return Qwen3Config(
        **TINY,
        head_dim=32,
        vocab_size=151669,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


VOYAGE_PROMPTS = {
    "query": "Represent the query for retrieving supporting documents: ",
    "document": "Represent the document for retrieval: ",
}


def voyage_4_nano(directory: Path, *, seed: int = 2, projection: int = 96) -> Path:
    """voyage-4-nano's layout: a Qwen3ForCausalLM config with `use_bidirectional_attention:
    true` and `num_labels` (the projection's width; 2048 in the real model), tied embeddings,
    bf16 tensors prefixed `model.` plus a top-level `linear.weight` [num_labels, hidden] (its
    remote code applies it to every token after the final norm, before pooling); a tokenizer
    that appends nothing; sentence-transformers' mean Pooling (over the projected width) and
    Normalize; its query and document prompts; `auto_map` naming its remote code."""
    config = _tied_qwen3()
    model = Qwen3ForCausalLM(config)
    _noise(model, seed)
    model.to(torch.bfloat16).save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    assert all(name.startswith("model.") for name in tensors)
    generator = torch.Generator().manual_seed(seed)
    linear = torch.randn(projection, TINY["hidden_size"], generator=generator) * 0.1
    tensors["linear.weight"] = linear.to(torch.bfloat16)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((directory / "config.json").read_text())
    hf |= {
        "architectures": ["Qwen3ForCausalLM"],
        "use_bidirectional_attention": True,
        "num_labels": projection,
        "auto_map": {"AutoModel": "modeling_qwen3_bidirectional.Qwen3BidirectionalModel"},
    }
    _write_json(directory / "config.json", hf)
    write_tokenizer(directory, append_eos=False)
    _modules(directory, POOLING, NORMALIZE)
    _pooling(directory, "mean_tokens", projection)
    _write_json(directory / "sentence_bert_config.json", {"max_seq_length": 32768})
    _write_json(directory / "config_sentence_transformers.json", {"prompts": VOYAGE_PROMPTS})
    return directory


def pplx_embed(directory: Path, *, seed: int = 3) -> Path:
    """pplx-embed-v1's layout: architecture PPLXQwen3Model (model_type
    bidirectional_pplx_qwen3, remote code), `use_bidirectional_attention: true`, float32
    tensors of the bare Qwen3Model (no prefix); a tokenizer that appends nothing; mean Pooling
    then its `st_quantize.FlexibleQuantizer` module (int8 codes round(127 tanh(x))), no
    Normalize, no prompts file."""
    config = _tied_qwen3()
    model = Qwen3Model(config)
    _noise(model, seed)
    model.save_pretrained(directory)
    hf = json.loads((directory / "config.json").read_text())
    hf |= {
        "architectures": ["PPLXQwen3Model"],
        "model_type": "bidirectional_pplx_qwen3",
        "use_bidirectional_attention": True,
        "auto_map": {
            "AutoConfig": "configuration.PPLXQwen3Config",
            "AutoModel": "modeling.PPLXQwen3Model",
        },
    }
    _write_json(directory / "config.json", hf)
    write_tokenizer(directory, append_eos=False)
    _modules(directory, POOLING, ("", "st_quantize.FlexibleQuantizer"))
    _pooling(directory, "mean_tokens", TINY["hidden_size"])
    return directory


PPLX_SEPARATOR = "<|endoftext|>"


def pplx_embed_context(directory: Path, *, seed: int = 6) -> Path:
    """pplx-embed-context-v1's layout: pplx-embed-v1's model (model_type
    bidirectional_pplx_qwen3, float32 tensors of the bare Qwen3Model) under architecture
    PPLXQwen3ContextualModel, whose remote code's `encode` takes documents as lists of chunks,
    joins each document's chunks with the tokenizer's sep_token, means each chunk's tokens
    (the separators in none) and applies its quantizer's tanh; no sentence-transformers
    modules, no prompts; the tokenizer appends nothing and names <|endoftext|> its sep_token
    (tokenizer_config.json and special_tokens_map.json)."""
    pplx_embed(directory, seed=seed)
    hf = json.loads((directory / "config.json").read_text())
    hf["architectures"] = ["PPLXQwen3ContextualModel"]
    hf["auto_map"]["AutoModel"] = "modeling.PPLXQwen3ContextualModel"
    _write_json(directory / "config.json", hf)
    for name in ("modules.json", "1_Pooling/config.json"):
        (directory / name).unlink()
    (directory / "1_Pooling").rmdir()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    _write_json(directory / "tokenizer_config.json", config | {"sep_token": PPLX_SEPARATOR})
    _write_json(directory / "special_tokens_map.json", {"sep_token": PPLX_SEPARATOR})
    return directory


def with_dense(directory: Path, out_features: int, *, seed: int = 4) -> Path:
    """A sentence-transformers Dense module (bias, Tanh) between a replica's Pooling and
    Normalize, as `2_Dense/` holds it: config.json and model.safetensors (linear.weight,
    linear.bias)."""
    width = json.loads((directory / "1_Pooling" / "config.json").read_text())
    width = width["word_embedding_dimension"]
    generator = torch.Generator().manual_seed(seed)
    (directory / "2_Dense").mkdir()
    save_file(
        {
            "linear.weight": torch.randn(out_features, width, generator=generator) * 0.2,
            "linear.bias": torch.randn(out_features, generator=generator) * 0.1,
        },
        directory / "2_Dense" / "model.safetensors",
    )
    _write_json(
        directory / "2_Dense" / "config.json",
        {
            "in_features": width,
            "out_features": out_features,
            "bias": True,
            "activation_function": "torch.nn.modules.activation.Tanh",
        },
    )
    dense = ("2_Dense", "sentence_transformers.models.Dense")
    _modules(directory, POOLING, dense, ("3_Normalize", NORMALIZE[1]))
    return directory


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
JINA_TASKS = ("retrieval", "text-matching", "classification", "clustering")


def jina_embeddings_v5(directory: Path, *, seed: int = 5, rank: int = 4) -> Path:
    """jina-embeddings-v5-text-small's layout: a Qwen3 base model (architecture
    JinaEmbeddingsV5Model, model_type jina_embeddings_v5, remote code, its `task_names`), bf16,
    and beside it one LoRA adapter per task under adapters/{task}/ as peft saves them (the
    checkpoint's code selects one at run time); a tokenizer that appends nothing; one custom
    sentence-transformers module (last-token pooling and normalisation inside it) and its
    "Query: " / "Document: " prompts."""
    from peft import LoraConfig, get_peft_model

    config = _tied_qwen3()
    model = Qwen3Model(config)
    _noise(model, seed)
    model.to(torch.bfloat16).save_pretrained(directory)
    for i, task in enumerate(JINA_TASKS):
        lora = LoraConfig(r=rank, lora_alpha=rank, target_modules=LORA_TARGETS, lora_dropout=0.1)
        adapted = get_peft_model(Qwen3Model(config), lora)
        generator = torch.Generator().manual_seed(seed * 100 + i)
        with torch.no_grad():
            for name, p in adapted.named_parameters():
                if "lora_" in name:  # trained: B is no longer zero
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        adapted.save_pretrained(directory / "adapters" / task)
    hf = json.loads((directory / "config.json").read_text())
    hf |= {
        "architectures": ["JinaEmbeddingsV5Model"],
        "model_type": "jina_embeddings_v5",
        "task_names": list(JINA_TASKS),
        "auto_map": {
            "AutoConfig": "configuration_jina_embeddings_v5.JinaEmbeddingsV5Config",
            "AutoModel": "modeling_jina_embeddings_v5.JinaEmbeddingsV5Model",
        },
    }
    _write_json(directory / "config.json", hf)
    write_tokenizer(directory, append_eos=False)
    _write_json(
        directory / "modules.json",
        [{"idx": 0, "name": "transformer", "path": "", "type": "custom_st.Transformer"}],
    )
    _write_json(
        directory / "config_sentence_transformers.json",
        {"prompts": {"query": "Query: ", "document": "Document: "}, "default_prompt_name": None},
    )
    return directory


def lora_finetune(
    directory: Path,
    base: Path,
    *,
    seed: int = 9,
    rank: int = 4,
    cross_encoder: bool = False,
    targets=LORA_TARGETS,
) -> Path:
    """A LoRA fine-tune of `base` as sentence-transformers saves one (of a SentenceTransformer,
    or of a CrossEncoder): the adapter (peft's files, `base_model_name_or_path` the base's
    path), the tokenizer and the sentence-transformers files in version 6's format, no
    config.json and no base weights."""
    from peft import LoraConfig
    from sentence_transformers import CrossEncoder, SentenceTransformer

    model = (CrossEncoder if cross_encoder else SentenceTransformer)(str(base), device="cpu")
    model.add_adapter(LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    _trained(model, seed)
    model.save_pretrained(str(directory))
    return directory


def lora_model(
    directory: Path, base: Path, cls=None, *, targets=LORA_TARGETS, seed: int = 10, rank: int = 4
) -> Path:
    """A LoRA fine-tune of `cls` (default a causal LM, as a Qwen3-Reranker) as peft saves one:
    the adapter alone, `base_model_name_or_path` the base's path."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)
    model = get_peft_model((cls or AutoModelForCausalLM).from_pretrained(base), lora)
    _trained(model, seed)
    model.save_pretrained(directory)
    return directory


def _trained(model: torch.nn.Module, seed: int) -> None:
    """Seeded LoRA B matrices: peft starts them at zero, training moves them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


# Qwen3-VL's special tokens as the real vocabulary numbers them; a tiny-vocabulary replica
# puts them at its end (qwen3_vl's `vocab_size`).
QWEN3_VL_TOKENS = {
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "image_token_id": 151655,
    "video_token_id": 151656,
}


def _vision_tokens(vocab_size: int) -> dict[str, int]:
    """The vision tokens' ids: the real vocabulary's, or below its size a tiny vocabulary's
    last ids."""
    tokens = dict(QWEN3_VL_TOKENS)
    if vocab_size <= max(tokens.values()):
        tokens = {name: vocab_size - 10 + i for i, name in enumerate(tokens)}
    return tokens


def _near_one_norms(model: torch.nn.Module) -> None:
    """Every norm's scale near 1 (the towers' norm1, norm2, ln_q too), the rest N(0, 0.1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = ("norm" in name or "ln_q" in name) and name.endswith("weight")
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if scale else 0.1 * torch.randn_like(p))


# Qwen3-VL's chat template (Qwen3-VL-2B-Instruct's), the parts an embedder's inputs reach: a
# system turn (a string or text parts), user turns of images, videos and text in their order,
# the assistant's turn begun on add_generation_prompt; it adds no system turn of its own.
QWEN3_VL_CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' -%}
{{- '<|im_start|>system\\n' -}}
{%- if messages[0].content is string -%}{{- messages[0].content -}}
{%- else -%}{%- for c in messages[0].content -%}{%- if 'text' in c -%}{{- c.text -}}{%- endif -%}
{%- endfor -%}{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}{%- if message.role == 'user' -%}
{{- '<|im_start|>user\\n' -}}
{%- if message.content is string -%}{{- message.content -}}
{%- else -%}{%- for c in message.content -%}
{%- if c.type == 'image' or 'image' in c or 'image_url' in c -%}
{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- elif c.type == 'video' or 'video' in c -%}
{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
{%- elif 'text' in c -%}{{- c.text -}}
{%- endif -%}
{%- endfor -%}{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endif -%}{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

# Qwen3-VL-Reranker's pairs written by a chat template, as a CrossEncoder's template carries
# sentence-transformers' `query` and `document` roles: the reranker script's system prompt,
# `<Instruct>: ` and the system message (the instruction), `<Query>:` and the query's content,
# `\n<Document>:` and the document's (images before text), the assistant's turn begun.
QWEN3_VL_RERANKER_CHAT_TEMPLATE = """\
{%- macro part(message) -%}
{%- if message.content is string -%}{{- message.content -}}
{%- else -%}{%- for c in message.content -%}
{%- if c.type == 'image' or 'image' in c -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- elif 'text' in c -%}{{- c.text -}}{%- endif -%}
{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- set system = messages | selectattr('role', 'eq', 'system') | first -%}
{{- '<|im_start|>system\\nJudge whether the Document meets the requirements based on the Query '
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\\n'
    '<|im_start|>user\\n<Instruct>: ' -}}
{%- if system -%}{{- part(system) -}}{%- endif -%}
{{- '<Query>:' + part(messages | selectattr('role', 'eq', 'query') | first) -}}
{{- '\\n<Document>:' + part(messages | selectattr('role', 'eq', 'document') | first) -}}
{{- '<|im_end|>\\n' -}}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""


# Qwen3-VL's tower in the replicas: 3 blocks of one head, DeepStack after each, 4 x 4 patches
QWEN3_VL_TOWER = dict(
    depth=3,
    hidden_size=64,
    num_heads=1,
    intermediate_size=128,
    out_hidden_size=64,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 1, 2],
)


def _qwen3_vl_processor(directory: Path, least: int, most: int) -> None:
    """Qwen3-VL's image processor (Qwen3.5's too) for the replicas' 4 x 4 patches, images of
    `least` to `most` pixels."""
    processor = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "patch_size": 4,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": least, "longest_edge": most},
    }
    _write_json(directory / "preprocessor_config.json", processor)


def qwen3_vl(
    directory: Path,
    *,
    vocab_size: int = 1000,
    seed: int = 6,
    layers: int = 4,
    files: bool = False,
    tied: bool = True,
    chat_template: str = "",
) -> Path:
    """Qwen3-VL-Embedding's layout (`Qwen3VLForConditionalGeneration`: `text_config` and
    `vision_config`, tensors under `model.language_model.` and `model.visual.`, tied
    embeddings as the 2B), tiny: text hidden 64 with head_dim 64 (the native CPU attention's
    size), a 3-block vision tower with DeepStack after each block, 4x4 patches. Below the
    real vocabulary's size the vision tokens are its last ids. `files`: what a server reads
    besides the weights, as published: Qwen's tokenizer (the real vocabulary, its vision
    tokens) and preprocessor_config.json, with `chat_template` (QWEN3_VL_CHAT_TEMPLATE, or a
    reranker's) its chat_template.jinja: what sentence-transformers writes its inputs with.
    `tied=False`: an output head of its own, as the 8B (a reranker reads its "yes" and "no"
    rows)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    if files:
        vocab_size = 151936
    tokens = _vision_tokens(vocab_size)
    text = dict(
        TINY,
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        head_dim=64,
        rope_theta=5e6,
        rope_scaling={"rope_type": "default", "mrope_section": [12, 10, 10]},
        tie_word_embeddings=tied,
    )
    config = Qwen3VLConfig(
        text_config=text, vision_config=QWEN3_VL_TOWER, tie_word_embeddings=tied, **tokens
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    _near_one_norms(model)
    model.save_pretrained(directory)
    if files:
        write_tokenizer(Path(directory), append_eos=False)  # as Qwen3-VL's: no <|endoftext|>
        _qwen3_vl_processor(Path(directory), 4096, 1843200)
        if chat_template:
            (Path(directory) / "chat_template.jinja").write_text(chat_template)
    return Path(directory)


COLQWEN3_WIDTH = 24  # tomoro-colqwen3-embed's projection is 320 wide


def colqwen3(directory: Path, *, seed: int = 9, files: bool = False) -> Path:
    """tomoro-colqwen3-embed's layout: a Qwen3-VL (replicas.qwen3_vl's tiny shape) whose
    tensors sit under `vlm.` (`vlm.model.language_model.`, `vlm.model.visual.`), a top-level
    `embedding_proj_layer` (weight and bias: an nn.Linear) from the hidden size to `embed_dim`,
    config.json's `ColQwen3` architecture and `colqwen3` model type beside Qwen3-VL's own
    fields; its tokenizer's pad token (<|endoftext|>) is the queries' augmentation token."""
    qwen3_vl(directory, seed=seed, files=files)
    tensors = load_file(directory / "model.safetensors")
    tensors = {f"vlm.{name}": t for name, t in tensors.items()}
    generator = torch.Generator().manual_seed(seed)
    width, hidden = COLQWEN3_WIDTH, TINY["hidden_size"]
    tensors["embedding_proj_layer.weight"] = torch.randn(width, hidden, generator=generator) * 0.1
    tensors["embedding_proj_layer.bias"] = torch.randn(width, generator=generator) * 0.1
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((directory / "config.json").read_text())
    hf |= {
        "architectures": ["ColQwen3"],
        "model_type": "colqwen3",
        "embed_dim": width,
        "padding_side": "left",
        "auto_map": {
            "AutoConfig": "configuration_colqwen3.ColQwen3Config",
            "AutoModel": "modeling_colqwen3.ColQwen3",
        },
    }
    _write_json(directory / "config.json", hf)
    return directory


COLQWEN2_WIDTH = 16  # vidore/colqwen2-v1.0-hf's projection is 128 wide
# Qwen2-VL's image processor (CLIP's mean and std); a tiny replica's 4 x 4 patches
QWEN2_VL_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 4,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 8 * 8 * 4,
    "max_pixels": 8 * 8 * 60,
}


# Qwen2-VL's and Qwen2.5-VL's shapes in the replicas of their checkpoints: a text model of
# hidden 128 in two heads of 64 (sectioned multimodal rotary 8/12/12), 2-block towers of one
# head with 4 x 4 patches; Qwen2.5-VL's a head of 80 (the published size, which the native CPU
# attention runs padded), RMSNorms, a gated MLP of 96, windows of 16 pixels (2 x 2 merge
# blocks) in every block but the second.
QWEN2_VL_TEXT = dict(
    TINY,
    rms_norm_eps=1e-6,  # the published configs' (transformers' default is 1e-5)
    hidden_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]},
)
QWEN2_VL_TOWER = dict(
    depth=2,
    embed_dim=64,
    hidden_size=128,
    mlp_ratio=2,
    num_heads=1,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
)
QWEN2_5_VL_TOWER = dict(
    depth=2,
    hidden_size=80,
    intermediate_size=96,
    out_hidden_size=128,
    num_heads=1,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=16,
    fullatt_block_indexes=[1],
)


def colqwen2(directory: Path, *, seed: int = 11, files: bool = False, vlm=None) -> Path:
    """vidore/colqwen2-v1.0-hf's layout as transformers saves `ColQwen2ForRetrieval`: Qwen2-VL
    in `vlm_config` (`text_config`, a `vision_config` with its `embed_dim` and `mlp_ratio`),
    tensors under `vlm.language_model.` and `vlm.visual.`, `embedding_proj_layer` (weight and
    bias) to `embedding_dim`. Tiny: text hidden 128 in two heads of 64 (sectioned multimodal
    rotary 8/12/12), a 2-block tower of one 64-wide head, 4x4 patches. `files`: Qwen's
    tokenizer (its vision tokens at their real ids; <|endoftext|> the pad token) and
    preprocessor_config.json (a budget of 4 to 60 text-model tokens per image). `vlm`: (the
    VLM's config class, its vision_config) in place of Qwen2-VL's."""
    from transformers import ColQwen2Config, ColQwen2ForRetrieval, Qwen2VLConfig

    vocab_size = 151936 if files else 1000
    tokens = _vision_tokens(vocab_size)
    text = dict(QWEN2_VL_TEXT, vocab_size=vocab_size)
    vision = QWEN2_VL_TOWER
    vlm_class, vision = vlm or (Qwen2VLConfig, vision)
    config = vlm_class(text_config=text, vision_config=vision, **tokens)
    config = ColQwen2Config(vlm_config=config.to_dict(), embedding_dim=COLQWEN2_WIDTH)
    torch.manual_seed(seed)
    model = ColQwen2ForRetrieval(config).eval()
    _near_one_norms(model)
    model.save_pretrained(directory)
    if files:
        write_tokenizer(Path(directory), append_eos=False)
        _write_json(Path(directory) / "preprocessor_config.json", QWEN2_VL_PROCESSOR)
    return Path(directory)


def colqwen2_5(directory: Path, *, seed: int = 12, files: bool = False) -> Path:
    """A ColQwen2ForRetrieval over Qwen2.5-VL (colqwen2.5 in transformers' format): replicas.
    colqwen2's shape with Qwen2.5-VL's tower: one head of 80 (the published size, which the
    native CPU attention runs padded), RMSNorms, a gated MLP of 96, attention windows of 16
    pixels (2 x 2 merge blocks) in every block but the second."""
    from transformers import Qwen2_5_VLConfig

    vision = QWEN2_5_VL_TOWER
    return colqwen2(directory, seed=seed, files=files, vlm=(Qwen2_5_VLConfig, vision))


def _first_layout(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A Qwen2(.5)-VL's tensors in the layout transformers 4.x saved (and its from_pretrained
    still maps): `model.` the text model, `visual.` the tower; no output head."""
    out = {}
    for key, tensor in model.state_dict().items():
        if key.startswith("model.visual."):
            out[key.removeprefix("model.")] = tensor
        elif key != "lm_head.weight":
            out[key.replace("model.language_model.", "model.")] = tensor
    return out


def _saved_as_4x(
    directory: Path, tensors: dict, vision: dict, tokens: dict, files: bool, **fields
) -> None:
    """A Qwen2(.5)-VL checkpoint as transformers 4.x saved it, with `fields` (its
    architecture, remote code): `tensors` (_first_layout's) in bf16, config.json flat (the
    text model's fields at the top, `vision_config` inside, multimodal rotary named mrope),
    and with `files` Qwen's tokenizer and preprocessor_config.json (4 to 60 text-model
    tokens per image)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: t.contiguous().to(torch.bfloat16) for k, t in tensors.items()}
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    text = {k: v for k, v in QWEN2_VL_TEXT.items() if k != "rope_parameters"}
    rope = QWEN2_VL_TEXT["rope_parameters"]
    hf = {
        **text,
        "vocab_size": 151936 if files else 1000,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
        "vision_config": {**vision, "in_chans": 3, "model_type": fields["model_type"]},
        "torch_dtype": "bfloat16",
        **tokens,
        **fields,
    }
    _write_json(directory / "config.json", hf)
    if files:
        write_tokenizer(directory, append_eos=False)
        _write_json(directory / "preprocessor_config.json", QWEN2_VL_PROCESSOR)


JINA_V4_TASKS = ("retrieval", "text-matching", "code")
JINA_V4_WIDTH = 16  # jina-embeddings-v4's multi-vector projector is 128 wide
# its adapter_config.json's targets: the text model's and (the modules' names holding `model`
# in transformers' layout since 4.52) the tower's MLPs, and the projector
JINA_V4_TARGETS = (
    "(.*(model).*(down_proj|gate_proj|up_proj|k_proj|q_proj|v_proj|o_proj).*$|"
    ".*(single_vector_projector|multi_vector_projector).*$)"
)


def jina_embeddings_v4(
    directory: Path, *, seed: int = 13, files: bool = False, rank: int = 4
) -> Path:
    """jina-embeddings-v4's layout: a Qwen2.5-VL (replicas.colqwen2_5's shape: windows, a head
    of 80 in the tower), config.json flat as transformers 4.x saved Qwen2.5-VL (the text
    model's fields at the top, `vision_config` inside, `rope_scaling` of type mrope) with its
    architecture JinaEmbeddingsV4Model, remote code and `task_names`; tensors in Qwen2.5-VL's
    first layout (`model.` the text model, `visual.` the tower: its from_pretrained maps them),
    bf16, and its top-level `multi_vector_projector` (weight and bias, hidden -> 128); one LoRA
    adapter under adapters/ holding every task's pairs (its MultiAdapterLinear's
    `lora_A.{task}.weight`, keyed as peft saves them from the model's tree: `model.
    language_model.`, `model.visual.`), on the text model's linear layers, the tower's MLPs
    and the projector. `files`: Qwen's tokenizer and preprocessor_config.json (a budget of 4
    to 60 text-model tokens per image)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab_size = 151936 if files else 1000
    text = dict(QWEN2_VL_TEXT, vocab_size=vocab_size)
    vision = QWEN2_5_VL_TOWER
    tokens = _vision_tokens(vocab_size)
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True, **tokens
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    _near_one_norms(model)
    generator = torch.Generator().manual_seed(seed)
    hidden = text["hidden_size"]
    tensors = _first_layout(model)
    tensors["multi_vector_projector.weight"] = (
        torch.randn(JINA_V4_WIDTH, hidden, generator=generator) * 0.1
    )
    tensors["multi_vector_projector.bias"] = torch.randn(JINA_V4_WIDTH, generator=generator) * 0.1
    pairs = {}
    names = dict(model.named_modules())
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapted = [n for n in names if n.endswith(targets) and "model" in n]
    for name in [*adapted, "multi_vector_projector"]:
        module = names.get(name)
        out_features, in_features = (
            (module.out_features, module.in_features) if module else (JINA_V4_WIDTH, hidden)
        )
        for task in JINA_V4_TASKS:
            key = f"base_model.model.{name}"
            pairs[f"{key}.lora_A.{task}.weight"] = (
                torch.randn(rank, in_features, generator=generator) * 0.05
            )
            pairs[f"{key}.lora_B.{task}.weight"] = (
                torch.randn(out_features, rank, generator=generator) * 0.05
            )
    _saved_as_4x(
        directory,
        tensors,
        vision,
        tokens,
        files,
        architectures=["JinaEmbeddingsV4Model"],
        model_type="qwen2_5_vl",
        auto_map={
            "AutoConfig": "configuration_jina_embeddings_v4.JinaEmbeddingsV4Config",
            "AutoModel": "modeling_jina_embeddings_v4.JinaEmbeddingsV4Model",
        },
        tie_word_embeddings=True,
        task_names=list(JINA_V4_TASKS),
        matryoshka_dims=[4, 8, 16, 32, 64],
        multi_vector_projector_dim=JINA_V4_WIDTH,
        single_vector_pool_strategy="mean",
        truncate_dim=None,
    )
    adapters = directory / "adapters"
    adapters.mkdir()
    save_file(pairs, adapters / "adapter_model.safetensors", metadata={"format": "pt"})
    _write_json(
        adapters / "adapter_config.json",
        _lora_config("jinaai/jina-embeddings-v4", rank, JINA_V4_TARGETS),
    )
    return directory


COLPALI_WIDTH = 128  # colpali-engine's ColQwen2 and ColQwen2_5 fix their projection's width
# its trainers' adapter_config.json targets: the text model's linear layers (the names
# holding `model`, the tower's not) and the projection, all LoRA pairs
COLPALI_TARGETS = (
    "(.*(model).*(down_proj|gate_proj|up_proj|k_proj|q_proj|v_proj|o_proj).*$|"
    ".*(custom_text_proj).*$)"
)


def colpali_engine(
    directory: Path, *, qwen2_5: bool = False, seed: int = 16, files: bool = False
) -> Path:
    """A base checkpoint as colpali-engine published its ColQwen2 and ColQwen2.5
    (vidore/colqwen2-base, colqwen2.5-base): a Qwen2-VL (replicas.colqwen2's shape) or
    Qwen2.5-VL (colqwen2_5's tower) saved as transformers 4.x saved them (config.json flat,
    its architecture `ColQwen2` or `ColQwen2_5`; tensors `model.` the text model, `visual.`
    the tower) and the top-level `custom_text_proj` (weight and bias, hidden -> 128); bf16.
    `files`: Qwen's tokenizer and preprocessor_config.json."""
    model, tokens = _qwen2_vl(seed, files, qwen2_5=qwen2_5)
    generator = torch.Generator().manual_seed(seed)
    hidden = QWEN2_VL_TEXT["hidden_size"]
    tensors = _first_layout(model)
    tensors["custom_text_proj.weight"] = torch.randn(COLPALI_WIDTH, hidden, generator=generator)
    tensors["custom_text_proj.weight"] *= 0.1
    tensors["custom_text_proj.bias"] = torch.randn(COLPALI_WIDTH, generator=generator) * 0.1
    _saved_as_4x(
        directory,
        tensors,
        QWEN2_5_VL_TOWER if qwen2_5 else QWEN2_VL_TOWER,
        tokens,
        files,
        architectures=["ColQwen2_5" if qwen2_5 else "ColQwen2"],
        model_type="qwen2_5_vl" if qwen2_5 else "qwen2_vl",
        tie_word_embeddings=True,
    )
    return directory


def colpali_adapter(directory: Path, base: Path, *, seed: int = 17, rank: int = 4) -> Path:
    """A ColQwen2(.5) as colpali-engine's trainers publish it (vidore/colqwen2-v1.0,
    colqwen2.5-v0.2): a peft LoRA adapter over `base` (replicas.colpali_engine's), keyed as
    peft saved them from the 4.x model's tree (`base_model.model.model.layers.`,
    `base_model.model.custom_text_proj`), on the text model's linear layers and the
    projection, beside the base's tokenizer and processor files; no weights of its own."""
    directory.mkdir(parents=True, exist_ok=True)
    hidden = QWEN2_VL_TEXT["hidden_size"]
    heads, kv_heads = QWEN2_VL_TEXT["num_attention_heads"], QWEN2_VL_TEXT["num_key_value_heads"]
    head_dim = hidden // heads
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (QWEN2_VL_TEXT["intermediate_size"], hidden),
        "mlp.up_proj": (QWEN2_VL_TEXT["intermediate_size"], hidden),
        "mlp.down_proj": (hidden, QWEN2_VL_TEXT["intermediate_size"]),
    }
    modules = {
        f"model.layers.{i}.{name}": shape
        for i in range(QWEN2_VL_TEXT["num_hidden_layers"])
        for name, shape in shapes.items()
    }
    modules["custom_text_proj"] = (COLPALI_WIDTH, hidden)
    generator = torch.Generator().manual_seed(seed)
    pairs = {}
    for name, (out_features, in_features) in modules.items():
        key = f"base_model.model.{name}"
        pairs[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.1
        pairs[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.1
    save_file(pairs, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    _write_json(
        directory / "adapter_config.json",
        _lora_config(
            str(base),
            rank,
            COLPALI_TARGETS,
            init_lora_weights="gaussian",
            modules_to_save=None,
            inference_mode=True,
        ),
    )
    for path in base.iterdir():
        if path.name not in ("config.json", "model.safetensors"):
            shutil.copy(path, directory / path.name)
    return directory


def _lora_config(base: str, rank: int, targets: str, **fields) -> dict:
    """peft's adapter_config.json of a LoRA adapter over `base` (alpha twice the rank) on
    `targets`, with its other `fields`."""
    return {
        "peft_type": "LORA",
        "task_type": "FEATURE_EXTRACTION",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.1,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "target_modules": targets,
        **fields,
    }


def _qwen2_vl(seed: int, files: bool, qwen2_5: bool = False):
    """A Qwen2-VL of replicas.colqwen2's shape, or with `qwen2_5` a Qwen2.5-VL of
    colqwen2_5's (Qwen's vocabulary with `files`), its norms near one: (the model, its vision
    tokens' ids)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    vocab_size = 151936 if files else 1000
    tokens = _vision_tokens(vocab_size)
    text = dict(QWEN2_VL_TEXT, vocab_size=vocab_size)
    if qwen2_5:
        config = Qwen2_5_VLConfig(text_config=text, vision_config=QWEN2_5_VL_TOWER, **tokens)
        model_class = Qwen2_5_VLForConditionalGeneration
    else:
        config = Qwen2VLConfig(text_config=text, vision_config=QWEN2_VL_TOWER, **tokens)
        model_class = Qwen2VLForConditionalGeneration
    torch.manual_seed(seed)
    model = model_class(config).eval()
    _near_one_norms(model)
    return model, tokens


def jina_reranker_m0(directory: Path, *, seed: int = 14, files: bool = False) -> Path:
    """jina-reranker-m0's layout: a Qwen2-VL (replicas.colqwen2's shape) saved as transformers
    4.x saved Qwen2-VL (config.json flat: the text model's fields at the top, `vision_config`
    with its `embed_dim`, `rope_scaling` of type mrope; tensors `model.` the text model,
    `visual.` the tower) with its architecture JinaVLForRanking and remote code, and its
    score MLP (`score.0`: hidden -> hidden, ReLU, `score.2`: hidden -> 1, both with biases);
    bf16. `files`: Qwen's tokenizer and preprocessor_config.json."""
    model, tokens = _qwen2_vl(seed, files)
    hidden = QWEN2_VL_TEXT["hidden_size"]
    generator = torch.Generator().manual_seed(seed)
    tensors = _first_layout(model)  # its modeling replaces the output head by an identity
    tensors |= {
        "score.0.weight": torch.randn(hidden, hidden, generator=generator) / hidden**0.5,
        "score.0.bias": torch.randn(hidden, generator=generator) * 0.1,
        "score.2.weight": torch.randn(1, hidden, generator=generator) / hidden**0.5,
        "score.2.bias": torch.randn(1, generator=generator) * 0.1 + 2.65,
    }
    _saved_as_4x(
        directory,
        tensors,
        QWEN2_VL_TOWER,
        tokens,
        files,
        architectures=["JinaVLForRanking"],
        model_type="qwen2_vl",
        auto_map={"AutoModel": "modeling.JinaVLForRanking"},
        tie_word_embeddings=False,
    )
    return directory


def gme(
    directory: Path, *, seed: int = 15, files: bool = False, image_tokens: tuple | None = None
) -> Path:
    """GME's layout (gme-Qwen2-VL-Instruct): a Qwen2-VL (replicas.colqwen2's shape) saved as
    transformers 4.x saved Qwen2-VL, no head of its own. Without `image_tokens` as first
    published: architecture Qwen2VLForConditionalGeneration, its script gme_inference.py beside
    the weights (a stand-in: it is never run); with them (min, max) as its later saves:
    architecture GmeQwen2VL, its config's min_image_tokens and max_image_tokens. bf16.
    `files`: Qwen's tokenizer and preprocessor_config.json."""
    model, tokens = _qwen2_vl(seed, files)
    fields = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl"}
    if image_tokens is not None:
        least, most = image_tokens
        fields = {
            "architectures": ["GmeQwen2VL"],
            "model_type": "qwen2_vl",
            "auto_map": {"AutoModel": "modeling_gme_qwen2vl.GmeQwen2VL"},
            "min_image_tokens": least,
            "max_image_tokens": most,
        }
    _saved_as_4x(directory, _first_layout(model), QWEN2_VL_TOWER, tokens, files, **fields)
    if image_tokens is None:
        (directory / "gme_inference.py").write_text("# GME's script (a stand-in: never run)\n")
    return directory


def nemotron_colembed(directory: Path, *, seed: int = 10, files: bool = False) -> Path:
    """nemotron-colembed-vl-v2's layout: Qwen3-VL's tensors as Qwen3-VL-Embedding saves them
    (`model.language_model.`, `model.visual.`), config.json's `Qwen3VLNemotronEmbedModel`
    architecture and `qwen3_vl_nemotron_embed` model type with its `pooling: colbert`; with
    `files`, processor_config.json's query and passage prefixes as its processor saves them."""
    qwen3_vl(directory, seed=seed, files=files)
    hf = json.loads((directory / "config.json").read_text())
    hf |= {
        "architectures": ["Qwen3VLNemotronEmbedModel"],
        "model_type": "qwen3_vl_nemotron_embed",
        "pooling": "colbert",
        "auto_map": {
            "AutoConfig": "modeling_nemotron_colembed.Qwen3VLNemotronEmbedConfig",
            "AutoModel": "modeling_nemotron_colembed.Qwen3VLNemotronEmbedModel",
        },
    }
    _write_json(directory / "config.json", hf)
    if files:
        processor = {
            "processor_class": "Qwen3VLNemotronEmbedProcessor",
            "q_max_length": 512,
            "p_max_length": 10240,
            "query_prefix": "query:",
            "passage_prefix": "passage:",
            "reserve_tokens_for_images": 100,
        }
        _write_json(directory / "processor_config.json", processor)
    return directory


def jina_reranker_v3(directory: Path, *, seed: int = 8, length: int = 2800) -> Path:
    """jina-reranker-v3's layout: `JinaForRanking`, a tied Qwen3 with `model.` tensors plus its
    projector (`projector.0.weight` [hidden / 2, hidden], `projector.2.weight` [512, hidden /
    2]), and the Qwen tokenizer with its two marker tokens added. The tokenizer's
    model_max_length (its blocks' length) is small, so a few documents make several blocks."""
    config = _tied_qwen3()
    config.max_position_embeddings = 4096
    model = Qwen3ForCausalLM(config)
    _noise(model, seed)
    model.save_pretrained(directory)
    write_tokenizer(directory, append_eos=False)
    make_listwise(directory, seed)
    path = directory / "tokenizer_config.json"
    _write_json(path, {**json.loads(path.read_text()), "model_max_length": length})
    return directory


# Qwen3-Reranker's model card prompt as a chat template over sentence-transformers' pair roles
# (`query`, `document`; a prompt comes as the `system` message): the form a CrossEncoder of it
# takes. Jinja drops one newline at a template's end, hence the last line's three.
QWEN3_RERANKER_TEMPLATE = """{%- set ns = namespace(task="Given a web search query, \
retrieve relevant passages that answer the query") -%}
{%- for m in messages if m.role == "system" -%}{%- set ns.task = m.content -%}{%- endfor -%}
<|im_start|>system
Judge whether the Document meets the requirements based on the Query and the Instruct \
provided. Note that the answer can only be "yes" or "no".<|im_end|>
<|im_start|>user
<Instruct>: {{ ns.task }}
<Query>: {{ (messages | selectattr("role", "eq", "query") | first).content }}
<Document>: {{ (messages | selectattr("role", "eq", "document") | first).content }}<|im_end|>
<|im_start|>assistant
<think>

</think>


"""
# zerank's form: the query as the system turn, the document as the user's, then the
# assistant's turn begins (add_generation_prompt)
QUERY_AS_SYSTEM_TEMPLATE = """{%- for m in messages -%}
{%- if m.role == "query" -%}<|im_start|>system
{{ m.content }}<|im_end|>
{% elif m.role == "document" -%}<|im_start|>user
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% endif -%}"""


# ctxl-rerank-v2's prompt as a chat template: the document before the query, an instruction
# after it, no special tokens; its score is the logit of token 0 ("!") at the last position.
DOCUMENT_FIRST_TEMPLATE = """{%- set ns = namespace(query="", document="", instruction="") -%}
{%- for m in messages -%}
{%- if m.role == "query" %}{% set ns.query = m.content %}
{%- elif m.role == "document" %}{% set ns.document = m.content %}
{%- elif m.role == "system" %}{% set ns.instruction = " " + m.content %}{% endif -%}
{%- endfor -%}
Check whether a given document contains information helpful to answer the query.
<Document> {{ ns.document }}
<Query> {{ ns.query }}{{ ns.instruction }} ??"""


def cross_encoder(
    directory: Path,
    base: Path,
    template: str,
    answers: tuple[str, str | None] = ("yes", "no"),
    generation_prompt: bool = False,
    raw_logit: bool = False,
) -> Path:
    """A causal-LM reranker as sentence-transformers 6 saves a CrossEncoder of it: the base's
    weights and tokenizer with `template` as its chat template, the Transformer module's
    `text-generation` task (with `add_generation_prompt` among its chat-template arguments
    where asked), a LogitScore module on the rows of `answers` (relevant, not relevant or
    None: that row's logit alone) and, with `raw_logit`, no activation (`predict` answers the
    logit, not its sigmoid)."""
    import shutil

    from sentence_transformers import CrossEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.cross_encoder.modules import LogitScore
    from torch import nn

    source = directory.with_name(directory.name + "-source")
    shutil.copytree(base, source)
    (source / "chat_template.jinja").write_text(template)
    kwargs = {"chat_template": {"add_generation_prompt": True}} if generation_prompt else None
    transformer = Transformer(
        str(source), transformer_task="text-generation", processing_kwargs=kwargs
    )
    true, false = (
        None if a is None else transformer.tokenizer.convert_tokens_to_ids(a) for a in answers
    )
    activation = nn.Identity() if raw_logit else None
    model = CrossEncoder(
        modules=[transformer, LogitScore(true, false)], device="cpu", activation_fn=activation
    )
    model.save_pretrained(str(directory))
    shutil.rmtree(source)
    return directory


def multi_vector_encoder(
    directory: Path,
    base: Path,
    *,
    prompts: dict | None = None,
    query_expansion: dict | None = None,
    query_length: int | None = None,
    document_length: int | None = None,
    projection: int = 24,
    normalize: bool = True,
    skiplist: dict | None = None,
    seed: int = 11,
) -> Path:
    """A ColBERT-style model over a Qwen3 backbone as sentence-transformers 6.3 saves a
    MultiVectorEncoder of it: the base's files with the Transformer module's lengths and query
    expansion (sentence_bert_config.json), a Dense projection of every token (no bias, seeded),
    a MultiVectorMask (with `skiplist`, its skiplist_words and skiplist_tasks), and Normalize
    per token where asked."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    transformer = Transformer(
        str(base),
        query_expansion=query_expansion,
        query_length=query_length,
        document_length=document_length,
    )
    width = transformer.get_embedding_dimension()
    dense = Dense(width, projection, bias=False, module_input_name="token_embeddings")
    torch.manual_seed(seed)
    with torch.no_grad():
        dense.linear.weight.copy_(torch.randn(projection, width) / width**0.5)
    modules = [transformer, dense, MultiVectorMask(**(skiplist or {}))]
    if normalize:
        modules.append(Normalize(module_input_name="token_embeddings"))
    MultiVectorEncoder(modules=modules, prompts=prompts or {}, device="cpu").save_pretrained(
        str(directory)
    )
    return directory


def _attention_pooling_tensors(width: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """CodeFuse's `mha_pma` tensors (its PMA with MAB_POST and LayerNorms), random."""
    torch.manual_seed(seed)
    tensors = {"mha_pma.S": torch.randn(1, 1, width) * 0.5}
    for name, size in (("fc_q", width), ("fc_k", hidden), ("fc_v", hidden), ("fc_o", width)):
        tensors[f"mha_pma.mab.{name}.weight"] = torch.randn(width, size) / size**0.5
        tensors[f"mha_pma.mab.{name}.bias"] = 0.1 * torch.randn(width)
    for name in ("ln0", "ln1"):
        tensors[f"mha_pma.mab.{name}.weight"] = 1.0 + 0.1 * torch.randn(width)
        tensors[f"mha_pma.mab.{name}.bias"] = 0.1 * torch.randn(width)
    return tensors


def _codefuse(directory: Path, config: dict, *, width: int, seed: int, shards: int = 1) -> Path:
    """A causal Qwen2 saved as CodeFuse's embedders save it: `plm_model.` around the causal
    LM's own names (its lm_head too), `mha_pma.` beside it; bf16, in `shards` files (an
    index with more than one)."""
    # two heads of 32 (Qwen2's head size is hidden / heads): one the native attention has
    qwen = Qwen2Config(
        **(TINY | {"num_attention_heads": 2, "num_key_value_heads": 1}),
        vocab_size=151936,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    model = Qwen2ForCausalLM(qwen)
    _noise(model, seed)
    tensors = {f"plm_model.{k}": v for k, v in model.state_dict().items()}
    tensors |= _attention_pooling_tensors(width, qwen.hidden_size, seed + 1)
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        file = file if shards > 1 else "model.safetensors"
        part = names[i::shards]
        save_file({k: tensors[k] for k in part}, str(directory / file))
        weight_map |= dict.fromkeys(part, file)
    if shards > 1:
        _write_json(directory / "model.safetensors.index.json", {"weight_map": weight_map})
    hf = {k: v for k, v in qwen.to_dict().items() if k not in ("architectures", "model_type")}
    _write_json(directory / "config.json", hf | config)
    write_tokenizer(directory, append_eos=False)
    return directory


def c2llm(directory: Path, *, seed: int = 16) -> Path:
    """C2LLM-0.5B's layout (codefuse-ai, Qwen2.5-Coder): architecture C2LLMForEmbedding,
    model_type c2llm, `embedding_method: pma` with `compressed_dim` (its hidden size, as the
    real 896), 32 heads there (8 here), LayerNorms, left padding; bf16 tensors in one file;
    Qwen's tokenizer, which appends nothing."""
    config = {
        "architectures": ["C2LLMForEmbedding"],
        "auto_map": {
            "AutoConfig": "configuration_c2llm.C2LLMConfig",
            "AutoModel": "modeling_c2llm.C2LLMForEmbedding",
        },
        "model_type": "c2llm",
        "compressed_dim": 64,
        "embedding_method": "pma",
        "padding_side": "left",
        "pma_ln": True,
        "pma_norm": False,
        "pma_norm_mode": "post_normal",
        "pma_num_heads": 8,
        "dtype": "bfloat16",
    }
    return _codefuse(directory, config, width=64, seed=seed)


def codefuse_cge_large(directory: Path, *, seed: int = 18) -> Path:
    """CodeFuse-CGE-Large's layout (CodeQwen1.5-7B): architecture CodeFuse_CGE_Large,
    model_type qwen2, `compress_dim` narrower than the hidden size (1024 of 4096 there, 48 of
    64 here), `keep_max_layer` its layer count, right padding; tensors sharded with an index.
    Its tokenizer_config asks for a BOS token, which its remote code's `encode` leaves out
    (`add_special_tokens=False`)."""
    config = {
        "architectures": ["CodeFuse_CGE_Large"],
        "auto_map": {
            "AutoConfig": "configuration_codefuse_cge_large.CodeFuseCGELargeConfig",
            "AutoModel": "modeling_codefuse_cge_large.CodeFuse_CGE_Large",
        },
        "model_type": "qwen2",
        "compress_dim": 48,
        "embedding_method": "pma",
        "inf_seq_length": 1024,
        "keep_max_layer": TINY["num_hidden_layers"],
        "padding_side": "right",
        "pma_ln": True,
        "pma_norm": False,
        "pma_norm_mode": "post_normal",
        "pma_num_heads": 4,
        "torch_dtype": "bfloat16",
    }
    directory = _codefuse(directory, config, width=48, seed=seed, shards=2)
    path = directory / "tokenizer_config.json"
    bos = {"add_bos_token": True, "bos_token": "<|endoftext|>"}
    _write_json(path, {**json.loads(path.read_text()), **bos})
    return directory


QWEN3_5_TINY = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # rotary turns its first quarter (8 values)
    intermediate_size=128,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads per key head, as Qwen3.5's 16 / 32
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_conv_kernel_dim=4,
    vocab_size=151669,
    max_position_embeddings=32768,
)


def qwen3_5(
    directory: Path,
    *,
    seed: int = 19,
    layer_types: tuple[str, ...] = ("linear_attention",) * 2 + ("full_attention",),
    dtype=torch.bfloat16,
    append_eos: bool = True,
    sentence: bool = False,
) -> Path:
    """Qwen3.5's text model as Qwen3_5ForCausalLM saves it (Prism-Qwen3.5-Reranker's layout):
    `model.` tensors, tied embeddings, the multi-token-prediction layers under `mtp.` (which
    only generation reads), rotary on a quarter of each head in multimodal sections, the real
    Qwen tokenizer (Qwen3.5's own vocabulary is not available here; the engine reads every id
    from the checkpoint's tokenizer.json), appending <|endoftext|> as an embedder's does
    (`append_eos`; a reranker's appends nothing); with `sentence`, an embedder's
    sentence-transformers files (last token, Normalize, Qwen3-Embedding's prompts). Norms that
    scale by (1 + weight) get noise around zero, the linear attention's output norm around
    one."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        **QWEN3_5_TINY,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 2],
            "mrope_interleaved": True,
        },
        pad_token_id=151643,
        eos_token_id=151643,
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config)
    _qwen3_5_noise(model, 0.05)
    model.to(dtype).save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.randn(64, 128, dtype=dtype)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    write_tokenizer(directory, append_eos=append_eos)
    if sentence:
        _sentence_transformers_files(directory, {"query": QWEN3_QUERY, "document": ""}, None)
    return directory


def _qwen3_5_noise(model: torch.nn.Module, scale: float) -> None:
    """Seeded weights (N(0, scale)) of a Qwen3.5 model: the norms that scale by (1 + weight)
    near zero, the linear attention's output norm and a tower's LayerNorms near one, decays as
    transformers draws them, the convolutions' larger."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            near_one = name.endswith("linear_attn.norm.weight") or (
                name.startswith("visual.") and "norm" in name and name.endswith("weight")
            )
            if near_one:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 16).log())
            else:
                p.copy_((0.3 if "conv1d" in name else scale) * torch.randn_like(p))


# Every linear layer of Qwen3.5's text model, as colpali-engine's ColQwen3.5 trainer targets
QWEN3_5_LORA_TARGETS = LORA_TARGETS + [
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
]


COLQWEN3_5_WIDTH = 32  # the projection's `dim` (colqwen3.5-4.5B-v3's is 320; the class's, 128)
# Qwen3.5's tower in the replica: Qwen3-VL's without DeepStack, of 2 blocks; its text model
# qwen3_5()'s with heads of 64 (rotary on 16 values: sections 3/3/2)
QWEN3_5_TOWER = {k: v for k, v in QWEN3_VL_TOWER.items() if k != "deepstack_visual_indexes"}
QWEN3_5_TOWER["depth"] = 2


def colqwen3_5(directory: Path, *, seed: int = 21, files: bool = False) -> Path:
    """ColQwen3.5 as colpali-engine saves it (athrael-soju/colqwen3.5-4.5B-v3): Qwen3.5's
    multimodal model (`Qwen3_5Model`: `text_config`, `vision_config`; tensors `language_model.`
    and `visual.`), the architecture `ColQwen3_5`, its projection `custom_text_proj` (weight and
    bias, hidden -> `dim`), fp32. `files`: Qwen's tokenizer (its vision tokens' ids in the
    config) and Qwen3-VL's image processor, as Qwen3.5 ships them."""
    from transformers import Qwen3_5Config, Qwen3_5Model

    text = dict(
        QWEN3_5_TINY,
        vocab_size=151936,
        head_dim=64,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_hidden_layers=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
    )
    config = Qwen3_5Config(text_config=text, vision_config=QWEN3_5_TOWER, **QWEN3_VL_TOKENS)
    torch.manual_seed(seed)
    model = Qwen3_5Model(config).eval()
    _qwen3_5_noise(model, 0.1)
    model.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    width, hidden = COLQWEN3_5_WIDTH, text["hidden_size"]
    tensors["custom_text_proj.weight"] = torch.randn(width, hidden, generator=generator) * 0.1
    tensors["custom_text_proj.bias"] = torch.randn(width, generator=generator) * 0.1
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((directory / "config.json").read_text())
    _write_json(directory / "config.json", hf | {"architectures": ["ColQwen3_5"], "dim": width})
    if files:
        write_tokenizer(Path(directory), append_eos=False)
        _qwen3_vl_processor(Path(directory), 8 * 8 * 4, 8 * 8 * 60)
    return Path(directory)


def as_gguf(
    path: Path,
    source: Path,
    kind: str = "Q8_0",
    *,
    pooling: str | None = "LAST",
    causal: bool = True,
    architecture: str | None = None,
    pre: str = "qwen2",
    tokens: bool = True,
    reranker: bool = False,
) -> Path:
    """The checkpoint in `source` written as llama.cpp's convert_hf_to_gguf.py writes it: its
    hyper-parameters under the architecture's keys, its vocabulary (`_gguf_vocabulary`; with
    `tokens` False the tokenizer is named alone: a file refused before that is read), tensors
    named by the `gguf` package's TensorNameMap, the matrices in `kind` (quantised by its numpy
    code) and the vectors in F32; `pooling` None writes none, as the converter wrote a causal
    LM's before it read rerankers (the Qwen3-Reranker files Ollama's users pull are such).
    `reranker`: a Qwen3-Reranker's, as the converter's Qwen3Model writes it now: pooling rank,
    labels yes and no, the output head's rows of those tokens as `cls.output` and no output
    head. A Qwen3-VL checkpoint's text model as its Qwen3VLTextModel writes it (architecture
    qwen3vl, the rotary's sections, the DeepStack layers' count; no pooling): its tower is
    `as_gguf_tower`'s."""
    import gguf
    from tokenizers import Tokenizer

    hf = json.loads((source / "config.json").read_text())
    vision = hf.get("vision_config")
    arrays = _float_arrays(source)
    if vision is not None:
        hf = {**hf["text_config"], "model_type": "qwen3vl"}
        arrays = {
            key.replace("model.language_model.", "model."): array
            for key, array in arrays.items()
            if not key.startswith("model.visual.")
        }
    architecture = architecture or hf["model_type"]
    writer = gguf.GGUFWriter(path, architecture)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base((hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    if reranker or pooling is not None:
        writer.add_pooling_type(gguf.PoolingType["RANK" if reranker else pooling])
    if not causal:
        writer.add_causal_attention(False)
    if vision is not None:
        writer.add_rope_dimension_sections([*hf["rope_parameters"]["mrope_section"], 0])
        writer.add_num_deepstack_layers(len(vision["deepstack_visual_indexes"]))

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    if tokens:
        _gguf_vocabulary(writer, source, hf["vocab_size"])
    names = gguf.TensorNameMap(gguf.MODEL_ARCH[hf["model_type"].upper()], hf["num_hidden_layers"])
    quant = gguf.GGMLQuantizationType[kind]
    tensors = {
        names.get_name(key, try_suffixes=(".weight", ".bias")): array
        for key, array in arrays.items()
    }
    if reranker:
        writer.add_classifier_output_labels(["yes", "no"])
        vocab = Tokenizer.from_file(str(source / "tokenizer.json")).get_vocab()
        head = tensors.pop("output.weight", tensors["token_embd.weight"])
        tensors["cls.output.weight"] = head[[vocab["yes"], vocab["no"]]]
    return _write_gguf(writer, tensors, quant, path)


def as_gguf_tower(path: Path, source: Path, projector: str = "QWEN3VL") -> Path:
    """The vision tower of the Qwen3-VL checkpoint in `source` as llama.cpp's converter writes
    it with --mmproj (Qwen3VLVisionModel over MmprojModel): architecture clip, projector
    qwen3vl_merger, its widths, image size, patch and merge sizes, the processor's mean and
    std, which blocks feed DeepStack; the blocks and position embedding named by the `gguf`
    package's TensorNameMap, the DeepStack mergers by their blocks, the merger as mm.0, mm.2
    and v.post_ln, the patch embedding's Conv3D as one Conv2D weight per time step; in F32.
    `projector`: another projector's type named in its metadata (a file refused)."""
    import gguf

    hf = json.loads((source / "config.json").read_text())
    vision, text = hf["vision_config"], hf["text_config"]
    processor = json.loads((source / "preprocessor_config.json").read_text())
    depth, deepstack = vision["depth"], vision["deepstack_visual_indexes"]
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(text["hidden_size"])
    patch = vision["patch_size"]
    writer.add_vision_image_size(int(vision["num_position_embeddings"] ** 0.5 * patch))
    writer.add_vision_patch_size(patch)
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(depth)
    writer.add_vision_head_count(vision["num_heads"])
    writer.add_vision_image_mean(processor["image_mean"])
    writer.add_vision_image_std(processor["image_std"])
    writer.add_clip_projector_type(getattr(gguf.VisionProjectorType, projector))
    writer.add_vision_use_gelu(True)
    writer.add_vision_spatial_merge_size(vision["spatial_merge_size"])
    writer.add_vision_attention_layernorm_eps(text["rms_norm_eps"])
    writer.add_vision_is_deepstack_layers([i in deepstack for i in range(depth)])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, depth)
    named = gguf.TENSOR_NAMES
    parts = {
        "norm": gguf.MODEL_TENSOR.V_DS_NORM,
        "linear_fc1": gguf.MODEL_TENSOR.V_DS_FC1,
        "linear_fc2": gguf.MODEL_TENSOR.V_DS_FC2,
    }
    merger = {
        "norm": named[gguf.MODEL_TENSOR.V_POST_NORM],
        "linear_fc1": named[gguf.MODEL_TENSOR.V_MMPROJ].format(bid=0),
        "linear_fc2": named[gguf.MODEL_TENSOR.V_MMPROJ].format(bid=2),
    }
    patch_name = named[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH]
    tensors = {}
    for key, array in _float_arrays(source).items():
        if not key.startswith("model.visual."):
            continue
        key = key.removeprefix("model.")
        base, _, suffix = key.rpartition(".")
        fields = base.split(".")
        if base == "visual.patch_embed.proj" and suffix == "weight":
            tensors[f"{patch_name}.weight"] = array[:, :, 0].copy()
            tensors[f"{patch_name}.weight.1"] = array[:, :, 1].copy()
        elif base == "visual.patch_embed.proj":
            tensors[f"{patch_name}.{suffix}"] = array
        elif fields[1] == "deepstack_merger_list":
            block = deepstack[int(fields[2])]
            tensors[f"{named[parts[fields[3]]].format(bid=block)}.{suffix}"] = array
        elif fields[1] == "merger":
            tensors[f"{merger[fields[2]]}.{suffix}"] = array
        else:
            tensors[names.get_name(key, try_suffixes=(".weight", ".bias"))] = array
    return _write_gguf(writer, tensors, gguf.GGMLQuantizationType.F32, path)


def _write_gguf(writer, tensors: dict, quant, path: Path) -> Path:
    """The file: `tensors` in name order, the matrices quantised to `quant` by the `gguf`
    package (the vectors, and everything at F32, as they are)."""
    import gguf

    for name, array in sorted(tensors.items()):
        if array.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_vocabulary(writer, source: Path, vocab_size: int) -> None:
    """The tokens as convert_hf_to_gguf.py lists them (in id order: added ones CONTROL or
    USER_DEFINED, ids the tokenizer lacks UNUSED pads), merges and special tokens by the `gguf`
    package's SpecialVocab."""
    import gguf
    from tokenizers import Tokenizer

    tokenizer = json.loads((source / "tokenizer.json").read_text())
    special = {t["id"]: t["special"] for t in tokenizer["added_tokens"]}
    vocab = Tokenizer.from_file(str(source / "tokenizer.json")).get_vocab()
    by_id = {token_id: token for token, token_id in vocab.items()}
    tokens, types = [], []
    for token_id in range(vocab_size):
        if token_id not in by_id:
            tokens.append(f"[PAD{token_id}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[token_id])
            types.append(
                gguf.TokenType.NORMAL
                if token_id not in special
                else gguf.TokenType.CONTROL
                if special[token_id]
                else gguf.TokenType.USER_DEFINED
            )
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(source, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer)


def gguf_weights(source: Path, out: Path, kind: str = "Q8_0", keys: str = "") -> Path:
    """`source` with the weights a GGUF file of it (`as_gguf`, `kind`) holds: each matrix
    (whose key starts with `keys`: a Qwen3-VL text model's, beside its F32 tower) quantised
    and dequantised by the `gguf` package, every tensor in fp32, one file; the other files as
    they are. What transformers and sentence-transformers read as the model the GGUF file
    is."""
    import gguf

    quant = gguf.GGMLQuantizationType[kind]
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors = {}
    for key, array in _float_arrays(source).items():
        if array.ndim == 2 and key.startswith(keys) and quant != gguf.GGMLQuantizationType.F32:
            array = gguf.quants.dequantize(gguf.quants.quantize(array, quant), quant)
        tensors[key] = torch.from_numpy(array.copy())
    save_file(tensors, out / "model.safetensors")
    return out


def _float_arrays(source: Path) -> dict:
    """Every tensor of the checkpoint in `source` by its key, as an fp32 array."""
    return {
        key: tensor.float().numpy()
        for file in sorted(source.glob("*.safetensors"))
        for key, tensor in load_file(file).items()
    }
