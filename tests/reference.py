"""Tiny seeded checkpoints and the transformers reference every parity test compares against."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch
from transformers import (
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2Model,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
)

from qwen_embed import native
from qwen_embed.attention import choose_backend
from qwen_embed.attention.torch_varlen import KEYWORDS, flash_problem, varlen_problem
from qwen_embed.config import ModelConfig
from qwen_embed.route import choose_route
from qwen_embed.settings import EncoderSettings
from qwen_embed_deploy.demo import DEFAULT_LAYERS, DEMO_CONFIG

# Shapes chosen to exercise each path while staying fast on 2 CPU cores.
TINY_CONFIGS = {
    # Qwen2 with q/k/v biases and Qwen2-0.5B's 14 query / 2 kv heads.
    "qwen2": dict(
        family="qwen2",
        hidden_size=112,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=160,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=512,
        rope_theta=1000000.0,
    ),
    # Qwen3 with head_dim (32) != hidden / heads (96 / 4 = 24), GQA 4:2.
    "qwen3": dict(
        family="qwen3",
        hidden_size=96,
        num_attention_heads=4,
        head_dim=32,
        num_key_value_heads=2,
        intermediate_size=192,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=512,
        rope_theta=1000000.0,
    ),
    # Qwen3 with a single kv head: tp_size 2 must replicate it.
    "qwen3_kv1": dict(
        family="qwen3",
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        num_key_value_heads=1,
        intermediate_size=128,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=512,
        rope_theta=10000.0,
    ),
    # gte-Qwen2 style: bidirectional attention.
    "gte_qwen2": dict(
        family="qwen2",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=512,
        rope_theta=1000000.0,
        is_causal=False,
    ),
}


def model_config(**changes) -> ModelConfig:
    """A ModelConfig without a checkpoint, for what is a pure function of it (choose_route)."""
    base = dict(
        family="qwen3",
        vocab_size=512,
        hidden_size=96,
        intermediate_size=192,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=512,
        has_qkv_bias=False,
        has_qk_norm=True,
        is_causal=True,
        checkpoint_dtype=None,
    )
    return ModelConfig(**{**base, **changes})


def route_for(
    features,
    device="cpu",
    checkpoint_dtype=None,
    onednn=True,
    gpu_bf16=True,
    native_isa=native.isa,
    avx2_f32=True,
    **settings,
):
    """choose_route for settings given as keywords, on the tiny config's shape (a GPU device
    has bf16 and fp8, compute capability 9.0, unless told otherwise: 7.5; no attention wheels; the
    native bf16 operator runs where oneDNN does; the native AVX2 fp32 one unless avx2_f32 is
    False)."""
    capability = (9, 0) if gpu_bf16 else (7, 5)

    def attention(device, head_dim, dtype):
        def gpu_problem(*args):
            return varlen_problem(*args, capability=lambda d: capability, keywords=lambda: KEYWORDS)

        return choose_backend(
            device,
            head_dim,
            dtype=dtype,
            import_problem=lambda module: f"no {module} here",
            gpu_problem=gpu_problem,
            flash_attn_problem=lambda *args: flash_problem(*args, lambda d: capability),
        )

    return choose_route(
        EncoderSettings(**settings),
        model_config(checkpoint_dtype=checkpoint_dtype),
        device,
        features,
        onednn,
        choose_attention=attention,
        gpu_bf16=lambda device: gpu_bf16,
        gpu_fp8=lambda device: capability >= (8, 9),
        brgemm_runs=lambda: onednn,
        native_isa=native_isa,
        avx2_f32_runs=lambda: avx2_f32,
    )


# The GPU tests' head sizes (64: flash-attn only, flashinfer ships no prebuilt kernels for it;
# 128), not the CPU suite.
GPU_CONFIGS = {
    f"qwen3_head{d}" + ("" if layers == 2 else f"_{layers}layers"): dict(
        family="qwen3",
        hidden_size=256,
        num_attention_heads=4,
        head_dim=d,
        num_key_value_heads=2,
        intermediate_size=384,
        num_hidden_layers=layers,
        vocab_size=512,
        max_position_embeddings=2048,
        rope_theta=1000000.0,
    )
    for d in (64, 128)
    for layers in (2, 4)  # 4: launches per layer, counted as the difference
}

# The demo model's widths (Qwen3-Embedding-0.6B's) with a small vocabulary: GEMMs of the real
# shapes in a checkpoint that loads in a fraction of the demo model's time.
WIDE_CONFIGS = {
    "demo_widths": dict(
        family="qwen3",
        **{
            k: DEMO_CONFIG[k]
            for k in (
                "hidden_size",
                "num_attention_heads",
                "head_dim",
                "num_key_value_heads",
                "intermediate_size",
                "max_position_embeddings",
                "rope_theta",
            )
        },
        num_hidden_layers=DEFAULT_LAYERS,
        vocab_size=2048,
    )
}

_CLASSES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, Qwen2Model),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, Qwen3Model),
}


def _base_model_class(family: str):
    """transformers' base model of a family (Qwen3.5's imported only when asked for: the GPU
    machines' transformers may predate it)."""
    if family == "qwen3_5":
        from transformers import Qwen3_5TextModel

        return Qwen3_5TextModel
    return _CLASSES[family][2]


def make_checkpoint(
    directory: Path,
    name: str,
    *,
    seed: int = 0,
    dtype=torch.float32,
    max_shard_size: str | None = None,
) -> Path:
    """Save a seeded random model; every weight (norms and biases too) gets noise."""
    spec = dict({**TINY_CONFIGS, **GPU_CONFIGS, **WIDE_CONFIGS}[name])
    family = spec.pop("family")
    config_cls, lm_cls, _ = _CLASSES[family]
    rope_theta = spec.pop("rope_theta")
    config = config_cls(
        **spec,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = lm_cls(config)
    with torch.no_grad():
        for p_name, p in model.named_parameters():
            if p_name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def reference_embeddings(
    model_dir: Path,
    sequences,
    *,
    pooling: str = "last",
    normalize: bool = True,
    dimensions: int | None = None,
    dtype=torch.float32,
) -> np.ndarray:
    """transformers' base model, one unpadded sequence at a time, then pooling."""
    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    family = {"qwen3_5_text": "qwen3_5", "qwen3": "qwen3"}.get(model_type, "qwen2")
    model = (
        _base_model_class(family)
        .from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
        .eval()
    )
    rows = []
    with torch.no_grad():
        for seq in sequences:
            hidden = model(input_ids=torch.tensor([list(seq)])).last_hidden_state[0].float()
            rows.append(hidden[-1] if pooling == "last" else hidden.mean(0))
    out = torch.stack(rows)
    if dimensions is not None:
        out = out[:, :dimensions]
    if normalize:
        out = torch.nn.functional.normalize(out, dim=-1)
    return out.numpy()


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def random_sequences(lengths, vocab_size: int = 512, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]


# A reranker replica: a real Qwen vocabulary (the template and "yes"/"no" need real ids),
# everything else tiny.
RERANKER_CONFIG = dict(
    hidden_size=64,
    num_attention_heads=4,
    head_dim=16,
    num_key_value_heads=2,
    intermediate_size=128,
    num_hidden_layers=2,
    vocab_size=151669,
    max_position_embeddings=2048,
)


def make_reranker(
    directory: Path, *, classifier: bool = False, seed: int = 0, family: str = "qwen3"
) -> Path:
    """A seeded Qwen3ForCausalLM (tied head, like Qwen3-Reranker-0.6B) or a converted
    Qwen3ForSequenceClassification (one-label `score` head), with the real Qwen tokenizer;
    family "qwen2": the same as mxbai-rerank-v2's Qwen2ForCausalLM (tied, q/k/v biases)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3ForSequenceClassification

    config = (Qwen2Config if family == "qwen2" else Qwen3Config)(
        **RERANKER_CONFIG,
        tie_word_embeddings=not classifier,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        num_labels=1,
        pad_token_id=151643,
    )
    if family == "qwen2":
        cls = Qwen2ForCausalLM
    else:
        cls = Qwen3ForSequenceClassification if classifier else Qwen3ForCausalLM
    return _save_seeded(directory, cls, config, seed)


def _save_seeded(directory: Path, cls, config, seed: int) -> Path:
    """`cls(config)` built after seeding, seeded noise on every weight (a `score` head's
    larger), saved with the real Qwen tokenizer (appending nothing)."""
    from qwen_embed_deploy.demo import write_tokenizer

    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        for p_name, p in model.named_parameters():
            if p_name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_((0.5 if "score" in p_name else 0.05) * torch.randn_like(p))
    model.save_pretrained(directory)
    write_tokenizer(directory, append_eos=False)
    return directory


def make_classifier(directory: Path, labels=("negative", "neutral", "positive"), seed=0) -> Path:
    """A seeded Qwen3ForSequenceClassification of several labels (id2label), with the real
    Qwen tokenizer (appending nothing)."""
    from transformers import Qwen3ForSequenceClassification

    config = Qwen3Config(
        **RERANKER_CONFIG,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
        pad_token_id=151643,
    )
    return _save_seeded(directory, Qwen3ForSequenceClassification, config, seed)


@functools.cache
def auto_tokenizer(model_dir: Path):
    """transformers' tokenizer of a checkpoint, loaded once per session (only read here)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def reference_scores(
    model_dir: Path,
    sequences,
    dtype=torch.float32,
    answers=("yes", "no"),
    adapter=None,
    probability=True,
) -> np.ndarray:
    """transformers, one sequence at a time: P(answers[0]) from the softmax over the logits of
    the two answer tokens from the full output head at the last position (Qwen3-Reranker's
    model card: "yes"/"no"; mxbai-rerank-v2's: "1"/"0", the sigmoid of its logit difference),
    or the sigmoid of a sequence-classification head (without `probability`, the head's
    logit); with peft's `adapter` directory over the model (unmerged)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    classifier = "SequenceClassification" in (Path(model_dir) / "config.json").read_text()
    cls = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    model = cls.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    tok = auto_tokenizer(model_dir)
    yes, no = tok.convert_tokens_to_ids(list(answers))
    scores = []
    with torch.no_grad():
        for seq in sequences:
            logits = model(input_ids=torch.tensor([list(seq)])).logits.float()
            if classifier:  # [1, num_labels]: the model pooled the last token itself
                scores.append(torch.sigmoid(logits[0, 0]) if probability else logits[0, 0])
            else:
                logits = logits[0, -1]
                scores.append(torch.softmax(torch.stack([logits[no], logits[yes]]), 0)[1])
    return torch.stack(scores).numpy()


def model_card_pairs(
    model_dir: Path, query: str, documents, *, instruction: str, max_length: int = 8192
) -> list[list[int]]:
    """Token ids exactly as Qwen3-Reranker's model card builds them (written out here, apart
    from the server's code): prefix + tokenizer(pairs, truncation) + suffix."""
    tok = auto_tokenizer(model_dir)
    prefix = (
        "<|im_start|>system\nJudge whether the Document meets the requirements based on "
        'the Query and the Instruct provided. Note that the answer can only be "yes" or '
        '"no".<|im_end|>\n<|im_start|>user\n'
    )
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    prefix_ids = tok.encode(prefix, add_special_tokens=False)
    suffix_ids = tok.encode(suffix, add_special_tokens=False)
    pairs = [f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {d}" for d in documents]
    enc = tok(
        pairs,
        padding=False,
        truncation="longest_first",
        return_attention_mask=False,
        max_length=max_length - len(prefix_ids) - len(suffix_ids),
    )
    return [prefix_ids + ids + suffix_ids for ids in enc["input_ids"]]


def mxbai_pairs(model_dir: Path, query: str, documents, *, instruction=None) -> list[list[int]]:
    """Token ids as mxbai-rerank-v2's library (mxbai_rerank.MxbaiRerankV2.prepare_inputs)
    builds them, written out here apart from the server's code: every part tokenized alone,
    without special tokens, and joined: chat prefix + query side + separator + document side
    + separator + task + chat suffix (no truncation: the documents here are short)."""
    tok = auto_tokenizer(model_dir)

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    sep = "\n"
    task = (
        "You are a search relevance expert who evaluates how well documents match search "
        "queries. For each query-document pair, carefully analyze the semantic relationship "
        "between them, then provide your binary relevance judgment (0 for not relevant, 1 for "
        "relevant).\nRelevance:"
    )
    prefix = (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\n"
    )
    suffix = "<|im_end|>\n<|im_start|>assistant\n"
    side = f"query: {query}"
    if instruction:
        side = f"instruction: {instruction}{sep}{side}"
    return [
        ids(prefix)
        + ids(side)
        + ids(sep)
        + ids(f"document: {d}")
        + ids(sep)
        + ids(task)
        + ids(suffix)
        for d in documents
    ]


def jina_blocks(model_dir: Path, query: str, documents, instruction=None) -> list[list[int]]:
    """jina-reranker-v3's `rerank` written out here apart from the server's code (its model
    card's recipe), up to its forwards: texts cut (query 512 tokens, documents 2,048, decoded
    back), blocks of up to 125 documents while more than 2,048 of model_max_length is left
    after twice the query, one prompt per block; each block's token ids."""
    tok = auto_tokenizer(model_dir)
    markers = {"doc": "<|embed_token|>", "query": "<|rerank_token|>"}

    def cut(text, limit):
        ids = tok(text, truncation=True, max_length=limit)["input_ids"]
        return (tok.decode(ids) if len(ids) >= limit else text), len(ids)

    def clean(text):
        return text.replace(markers["doc"], "").replace(markers["query"], "")

    def prompt(docs):
        q = clean(query)
        text = (
            f"I will provide you with {len(docs)} passages, each indicated by a numerical "
            f"identifier. Rank the passages based on their relevance to query: {q}\n"
        )
        if instruction:
            text += f"<instruct>\n{instruction}\n</instruct>\n"
        text += "\n".join(
            f'<passage id="{i}">\n{clean(d)}{markers["doc"]}\n</passage>'
            for i, d in enumerate(docs)
        )
        text += f"\n<query>\n{q}{markers['query']}\n</query>"
        return (
            "<|im_start|>system\nYou are a search relevance expert who can determine a ranking "
            "of the passages based on how relevant they are to the query. If the query is a "
            "question, how relevant a passage is depends on how well it answers the question. "
            "If not, try to analyze the intent of the query and assess how well each passage "
            "satisfies the intent. If an instruction is provided, you should follow the "
            "instruction when determining the ranking.<|im_end|>\n<|im_start|>user\n"
            + text
            + "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )

    query, query_length = cut(query, 512)
    cut_docs = [cut(d, 2048) for d in documents]
    blocks, block, room = [], [], tok.model_max_length - 2 * query_length
    for doc, length in cut_docs:
        block.append(doc)
        room -= length
        if len(block) >= 125 or room <= 2048:
            blocks.append(block)
            block, room = [], tok.model_max_length - 2 * query_length
    blocks += [block] if block else []
    return [tok(prompt(docs))["input_ids"] for docs in blocks]


def jina_rerank(model_dir: Path, query: str, documents, instruction=None, adapter=None):
    """jina_blocks, then its forwards: transformers' Qwen3Model in fp32 (with peft's LoRA
    `adapter` folder, unmerged, where given), its projector at the markers, cosines, the
    blocks' query vectors averaged by their best (1 + cosine) / 2. Returns (scores [n], each
    block's token ids)."""
    from safetensors import safe_open

    tok = auto_tokenizer(model_dir)
    model = Qwen3Model.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        w0, w2 = f.get_tensor("projector.0.weight"), f.get_tensor("projector.2.weight")
    doc_id, query_id = tok.convert_tokens_to_ids(["<|embed_token|>", "<|rerank_token|>"])
    block_ids = jina_blocks(model_dir, query, documents, instruction)
    doc_vectors, query_vectors, weights = [], [], []
    with torch.no_grad():
        for ids in block_ids:
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            ids = torch.tensor(ids)
            projected = torch.relu(hidden @ w0.float().T) @ w2.float().T
            d, q = projected[ids == doc_id], projected[ids == query_id]
            scores = torch.nn.functional.cosine_similarity(d, q.expand_as(d), dim=-1)
            doc_vectors.append(d.numpy())
            query_vectors.append(q[0].numpy())
            weights.append(float(((1.0 + scores) / 2.0).max()))
    merged = np.average(np.stack(query_vectors), axis=0, weights=weights)
    docs = np.concatenate(doc_vectors)
    scores = docs @ merged / (np.linalg.norm(merged) * np.linalg.norm(docs, axis=1))
    return scores, block_ids


def gated_as_silu_mul(layer, x: torch.Tensor) -> torch.Tensor:
    """A gate|up projection's kernel that gates in its GEMM's store (int8.Int8Weight,
    onednn.NativeBf16Weight with `gates`) against the row ops' SiLU gating on its plain output,
    bitwise, for all of x and for its first rows; returns that expected output."""
    assert layer.gates
    expected = torch.ops.qwen_embed.silu_mul(layer(x))
    out = layer.silu_gated(x)
    assert out.shape == (x.shape[0], layer.out_features // 2) and torch.equal(out, expected)
    for m in (1, 17):
        assert torch.equal(layer.silu_gated(x[:m]), expected[:m]), m
    return expected
