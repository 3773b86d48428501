"""One frozen description of a Qwen2/Qwen3 checkpoint, read once from config.json (and what
follows the transformer, from its sentence-transformers modules: sentence_modules.py).

Every difference between the architectures becomes an explicit field here, so the model code
never probes the Hugging Face config with scattered `getattr` defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from .adapters import adapter_names
from .loader import read_json
from .sentence_modules import TOKEN_PROJECTIONS, SentenceModules

GME = "GmeQwen2VL"
# GME's script, which its first saves (architecture Qwen2VLForConditionalGeneration) ship
GME_SCRIPT = "gme_inference.py"


# architecture name in config.json -> model family registered in qwen_embed.models
SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2Model": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3Model": "qwen3",
    # pplx-embed-v1: Qwen3Model with bidirectional attention (use_bidirectional_attention)
    "PPLXQwen3Model": "qwen3",
    # pplx-embed-context-v1: the same model; its remote code embeds a document's chunks
    # joined by its tokenizer's sep_token, one mean per chunk (late chunking by separator)
    "PPLXQwen3ContextualModel": "qwen3",
    # jina-embeddings-v5-text-small: a causal Qwen3 with LoRA adapters per task (adapters.py)
    "JinaEmbeddingsV5Model": "qwen3",
    # jina-reranker-v3: a causal Qwen3 reading a query and its documents in one sequence, a
    # projector over the hidden states at marker tokens (heads.ListwiseHead; rerank only)
    "JinaForRanking": "qwen3",
    # Converted cross-encoders: a `score` head of one row on the last token (rerank only).
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
    # Qwen3-VL-Embedding / -Reranker: a Qwen3 text model (`text_config`) and a vision tower
    "Qwen3VLForConditionalGeneration": "qwen3",
    "Qwen3VLModel": "qwen3",
    # ColQwen2 as transformers ports it (vidore/colqwen2-v1.0-hf): Qwen2-VL (a Qwen2 text model,
    # the tower before Qwen3-VL's, multimodal rotary in sections) or Qwen2.5-VL (colqwen2.5)
    # in `vlm_config`, tensors under `vlm.`, a projection of every token
    # (`embedding_proj_layer`). Qwen2-VL's own
    # architectures are not listed: the embedders saved as them number an image's tokens
    # differently (GME's script in sequence, DSE's on three axes); GME is told apart by its
    # script beside the weights (`gme_architectures`), DSE is not served.
    "ColQwen2ForRetrieval": "qwen2",
    # ColQwen2 and ColQwen2.5 as colpali-engine, which trained them, saves them
    # (vidore/colqwen2-base, colqwen2.5-base, and the LoRA fine-tunes over them: colqwen2-v1.0,
    # colqwen2.5-v0.2; finetunes.py): the same Qwen2(.5)-VL in its flat layout and a
    # projection of every token (`custom_text_proj`)
    "ColQwen2": "qwen2",
    "ColQwen2_5": "qwen2",
    # GME (gme-Qwen2-VL-2B/7B-Instruct): a Qwen2-VL whose script feeds the text model token
    # embeddings alone, so every token, an image's too, takes the next position on all three
    # axes (plain rotary); the last token's state. Its later saves name their own class.
    GME: "qwen2",
    # jina-embeddings-v4: Qwen2.5-VL (its flat layout: `model.`, `visual.`), LoRA adapters of
    # three tasks in one file (adapters.py), a mean (of an image's span for a text with one,
    # VISUAL_SPAN_MEAN) and a projection of every token (`multi_vector_projector`) for its
    # multi-vector side
    "JinaEmbeddingsV4Model": "qwen2",
    # jina-reranker-m0: Qwen2-VL (its flat layout) scoring a (document, query) pair by an MLP on
    # the last token's hidden state (heads.MlpScoreHead; rerank only)
    "JinaVLForRanking": "qwen2",
    # tomoro-colqwen3-embed: Qwen3-VL (tensors under `vlm.`) and a projection of every token
    # (sentence_modules.TOKEN_PROJECTIONS): a multi-vector retriever, for late interaction
    "ColQwen3": "qwen3",
    # nemotron-colembed-vl-v2: Qwen3-VL attending both ways, each token's last-layer output
    # before the final norm (its remote code skips it): a multi-vector retriever
    "Qwen3VLNemotronEmbedModel": "qwen3",
    # C2LLM-0.5B/7B (Qwen2.5-Coder) and CodeFuse-CGE-Large (CodeQwen1.5): a causal Qwen2
    # (tensors under `plm_model.`) pooled by attention from a learned seed (`mha_pma.`:
    # attention_pooling.py), as their remote code's `embedding_method: pma` does
    "C2LLMForEmbedding": "qwen2",
    "CodeFuse_CGE_Large": "qwen2",
    # Qwen3.5's text model (Qwen3_5ForCausalLM, as Prism-Qwen3.5-Reranker and the embedders
    # fine-tuned from it save it): linear-attention layers (Gated DeltaNet) between gated
    # full-attention ones (models/qwen3_5.py)
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5TextModel": "qwen3_5",
    # ColQwen3.5 as colpali-engine saves it (colqwen3.5-4.5B-v3, the Vultron retrievers):
    # Qwen3.5's multimodal model (`language_model.`, `visual.`: Qwen3-VL's tower without
    # DeepStack) and a projection of every token (`custom_text_proj`)
    "ColQwen3_5": "qwen3_5",
}


def has_linear_attention(architectures) -> bool:
    """Whether a checkpoint of these architectures has Qwen3.5's linear-attention layers."""
    return any(SUPPORTED_ARCHITECTURES.get(a) == "qwen3_5" for a in architectures)


# Whose remote code tokenizes a text without the tokenizer's special tokens
# (`add_special_tokens=False`): the attention-pooled code embedders.
PLAIN_TOKENS_ARCHITECTURES = frozenset({"C2LLMForEmbedding", "CodeFuse_CGE_Large"})


def gme_architectures(model_dir: str | Path, architectures: list[str]) -> list[str]:
    """A checkpoint's architectures, GME's first saves (Qwen2-VL's own class, with GME's
    script beside the weights) named as GME."""
    if list(architectures) == ["Qwen2VLForConditionalGeneration"]:
        if (Path(model_dir) / GME_SCRIPT).is_file():
            return [GME]
    return list(architectures)


# pplx-embed's remote code (both its models) attends both ways whatever the config says. Where
# a checkpoint's files name no pooling (no modules.json, or jina-embeddings-v4's one custom
# module, which pools inside), what follows its transformer is the remote code's own (pooling,
# final activation): the means, and pplx-embed's quantizer's tanh.
REMOTE_CODE_HEADS = {
    "PPLXQwen3Model": ("mean", "tanh"),
    "PPLXQwen3ContextualModel": ("mean", "tanh"),
    "JinaEmbeddingsV4Model": ("mean", "identity"),
}
# Whose remote code pools a text with an image over the image's span alone (its vision start
# to its vision end token, both in), a text without one over every token: jina-embeddings-v4.
VISUAL_SPAN_MEAN = frozenset({"JinaEmbeddingsV4Model"})
BIDIRECTIONAL_ARCHITECTURES = frozenset(
    {"PPLXQwen3Model", "PPLXQwen3ContextualModel", "Qwen3VLNemotronEmbedModel"}
)
# Whose recipe embeds a document's chunks joined by the tokenizer's sep_token (one vector per
# chunk): the request option chunk_by_separator. Another checkpoint's sep_token joins nothing.
CONTEXTUAL_ARCHITECTURES = frozenset({"PPLXQwen3ContextualModel"})
# Whose vectors are one per token only (ColPali's late interaction): no pooled vector; those
# of the first set through a projection of every token, each its own (its tensors' prefix,
# sentence_modules.TOKEN_PROJECTIONS): the one whose processor's forms serve it.
PROJECTED_TOKEN_ARCHITECTURES = {
    "ColQwen3": "embedding_proj_layer.",
    "ColQwen2ForRetrieval": "embedding_proj_layer.",
    "ColQwen2": "custom_text_proj.",
    "ColQwen2_5": "custom_text_proj.",
    "ColQwen3_5": "custom_text_proj.",
}
MULTI_VECTOR_ARCHITECTURES = frozenset(PROJECTED_TOKEN_ARCHITECTURES) | {
    "Qwen3VLNemotronEmbedModel"
}
# Whose vectors are the last layer's output before the final norm.
PRE_NORM_ARCHITECTURES = frozenset({"Qwen3VLNemotronEmbedModel"})
MULTI_VECTOR_ONLY = (
    "this model is a multi-vector retriever: its vectors are one per token (for late "
    "interaction, MaxSim); ask for them with parameter 'per_token'"
)

# jina-reranker-v3's marker tokens (document, query): its hidden states are read after each
# document and after the query (heads.ListwiseHead, serving/listwise.py).
LISTWISE_MARKERS = ("<|embed_token|>", "<|rerank_token|>")


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Qwen3.5's linear-attention layers (Gated DeltaNet, gated_delta.py): which layers they
    are (config.json's `layer_types`) and their heads. Keys and queries have their own heads,
    each serving value_heads // key_heads consecutive value heads."""

    layers: tuple[bool, ...]  # per layer: linear attention (else full attention)
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int  # the causal depthwise convolution over q|k|v before the recurrence

    @classmethod
    def from_hf(cls, hf: dict) -> LinearAttentionSpec:
        types = hf.get("layer_types")
        if types is None:  # transformers' default: every full_attention_interval-th is full
            interval = hf.get("full_attention_interval", 4)
            types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(hf["num_hidden_layers"])
            ]
        unknown = sorted(set(types) - {"linear_attention", "full_attention"})
        if unknown or len(types) != hf["num_hidden_layers"]:
            raise UnsupportedModelError(
                f"layer_types {unknown or len(types)}: Qwen3.5's layers are linear_attention "
                f"or full_attention, one per layer ({hf['num_hidden_layers']})"
            )
        spec = cls(
            layers=tuple(t == "linear_attention" for t in types),
            key_heads=hf["linear_num_key_heads"],
            value_heads=hf["linear_num_value_heads"],
            key_head_dim=hf["linear_key_head_dim"],
            value_head_dim=hf["linear_value_head_dim"],
            conv_kernel=hf.get("linear_conv_kernel_dim", 4),
        )
        if spec.value_heads % spec.key_heads:
            raise UnsupportedModelError(
                f"linear_num_value_heads {spec.value_heads} is not a multiple of "
                f"linear_num_key_heads {spec.key_heads}"
            )
        return spec

    @property
    def key_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim


@dataclass(frozen=True)
class AttentionPoolingSpec:
    """Pooling by multi-head attention (PMA, CodeFuse's embedders): one learned seed attends
    over a text's final hidden states (attention_pooling.py). Read from config.json's
    `embedding_method: pma` and its `pma_*` keys."""

    width: int  # the seed's and the vector's size: compress_dim (CGE), compressed_dim (C2LLM)
    num_heads: int
    layer_norm: bool  # pma_ln: LayerNorms after the attention and after the feed-forward

    @classmethod
    def from_hf(cls, hf: dict) -> AttentionPoolingSpec | None:
        method = hf.get("embedding_method")
        if method is None or "pma_num_heads" not in hf:
            return None
        if method != "pma":
            raise UnsupportedModelError(
                f"embedding_method {method!r}: of CodeFuse's poolings only 'pma' is served"
            )
        mode = hf.get("pma_norm_mode", "post_normal")
        if mode != "post_normal":  # every published checkpoint's; the others are unseen
            raise UnsupportedModelError(
                f"pma_norm_mode {mode!r}: only 'post_normal' attention pooling is implemented"
            )
        layer = hf.get("keep_max_layer", hf["num_hidden_layers"])
        if layer != hf["num_hidden_layers"]:
            raise UnsupportedModelError(
                f"keep_max_layer {layer}: pooling an inner layer's hidden states is not "
                f"served (num_hidden_layers {hf['num_hidden_layers']})"
            )
        width = hf.get("compressed_dim", hf.get("compress_dim"))
        heads = hf["pma_num_heads"]
        if not width or width % heads:
            raise UnsupportedModelError(
                f"attention pooling of width {width} in {heads} heads: the width must be a "
                "multiple of pma_num_heads"
            )
        return cls(width=width, num_heads=heads, layer_norm=bool(hf.get("pma_ln", True)))


Grid = tuple[int, int, int]  # an image's or video's (temporal patches, rows, columns) of patches


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower (models/vision.py): Qwen3-VL's, or the Qwen2-VL tower it grew from
    (`generation` "qwen2_vl": no position table, no DeepStack, its modules' own names), or
    Qwen2.5-VL's ("qwen2_5_vl": Qwen2-VL's with RMSNorms, a gated MLP and windows)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int  # the text model's hidden size
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    hidden_act: str
    num_position_embeddings: int = 0  # 0: no learned position table (Qwen2(.5)-VL)
    deepstack_visual_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    generation: str = "qwen3_vl"  # | "qwen2_vl" | "qwen2_5_vl"
    window_size: int = 0  # Qwen2.5-VL: attention windows of this many pixels a side
    fullatt_block_indexes: tuple[int, ...] = ()  # the blocks that attend to whole frames

    @classmethod
    def from_hf(cls, hf: dict) -> VisionConfig:
        rope = hf.get("rope_parameters") or {}
        common = dict(
            depth=hf["depth"],
            num_heads=hf["num_heads"],
            patch_size=hf["patch_size"],
            temporal_patch_size=hf["temporal_patch_size"],
            spatial_merge_size=hf["spatial_merge_size"],
            in_channels=hf.get("in_channels", hf.get("in_chans", 3)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )
        if "embed_dim" in hf:  # Qwen2-VL: hidden_size is the text model's, the MLP a ratio
            return cls(
                **common,
                hidden_size=hf["embed_dim"],
                intermediate_size=int(hf["embed_dim"] * hf.get("mlp_ratio", 4)),
                out_hidden_size=hf["hidden_size"],
                hidden_act=hf.get("hidden_act", "quick_gelu"),
                generation="qwen2_vl",
            )
        sizes = {k: hf[k] for k in ("hidden_size", "intermediate_size", "out_hidden_size")}
        if hf.get("window_size") and hf.get("fullatt_block_indexes"):  # Qwen2.5-VL's windows
            return cls(
                **common,
                **sizes,
                hidden_act=hf.get("hidden_act", "silu"),
                generation="qwen2_5_vl",
                window_size=hf["window_size"],
                fullatt_block_indexes=tuple(hf["fullatt_block_indexes"]),
            )
        return cls(
            **common,
            **sizes,
            num_position_embeddings=hf["num_position_embeddings"],
            deepstack_visual_indexes=tuple(hf.get("deepstack_visual_indexes") or ()),
            hidden_act=hf.get("hidden_act", "gelu_pytorch_tanh"),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """The values of one patch: channels x temporal_patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches per text token."""
        return self.spatial_merge_size**2

    @property
    def window_units(self) -> int:
        """Merge blocks per side of an attention window (Qwen2.5-VL)."""
        return self.window_size // self.patch_size // self.spatial_merge_size


@dataclass(frozen=True)
class MediaConfig:
    """What a multimodal checkpoint adds to its text model: the vision tower, the tokens that
    stand for images and video in the text, and multimodal rotary's sections (how many of
    the rotary frequencies turn with time, rows and columns). Interleaved (Qwen3-VL):
    frequency j turns with rows where j % 3 == 1, columns where j % 3 == 2, within three
    times each section; else (Qwen2-VL) the sections follow each other: time, rows, columns."""

    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool = True
    vision_end_token_id: int | None = None
    sequential_positions: bool = False  # GME: each token the next position on every axis

    @classmethod
    def from_hf(cls, hf: dict) -> MediaConfig | None:
        """`hf`: config.json, its architectures as `gme_architectures` names them."""
        if "vision_config" not in hf:
            return None
        vision = VisionConfig.from_hf(hf["vision_config"])
        text = hf.get("text_config") or hf  # Qwen2-VL's saves may keep it at the top level
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        return cls(
            vision=vision,
            image_token_id=hf["image_token_id"],
            video_token_id=hf["video_token_id"],
            vision_start_token_id=hf["vision_start_token_id"],
            mrope_section=tuple(rope.get("mrope_section", (24, 20, 20))),
            mrope_interleaved=rope.get("mrope_interleaved", vision.generation == "qwen3_vl"),
            vision_end_token_id=hf.get("vision_end_token_id"),
            sequential_positions=GME in (hf.get("architectures") or ()),
        )

    @property
    def reads_video(self) -> bool:
        """Qwen2(.5)-VL numbers a video's frames on the time axis its own way: not reproduced."""
        return self.vision.generation == "qwen3_vl"


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "qwen2" | "qwen3" | "qwen3_5"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    has_qkv_bias: bool
    has_qk_norm: bool
    is_causal: bool
    checkpoint_dtype: str | None  # e.g. "bfloat16"; None when config.json does not say
    is_classifier: bool = False  # *ForSequenceClassification: `score.weight` [num_labels, H]
    num_labels: int = 0
    labels: tuple[str, ...] = ()  # id2label's names in id order (classifiers)
    tie_word_embeddings: bool = False  # the output head is embed_tokens (no lm_head tensor)
    listwise: bool = False  # JinaForRanking: documents scored together (heads.ListwiseHead)
    sentence: SentenceModules = SentenceModules(None)  # pooling and projections (from_dir)
    adapters: tuple[str, ...] = ()  # task adapters beside the weights (adapters.py, from_dir)
    media: MediaConfig | None = None  # a multimodal checkpoint's vision side (Qwen3-VL)
    multi_vector: bool = False  # its vectors are one per token only (MULTI_VECTOR_ARCHITECTURES)
    final_norm: bool = True  # False: hidden states before the final norm (PRE_NORM_ARCHITECTURES)
    visual_span_mean: bool = False  # VISUAL_SPAN_MEAN's pooling of a text with an image
    mlp_score: bool = False  # JinaVLForRanking: its `score` MLP reads the last token
    attention_pooling: AttentionPoolingSpec | None = None  # a learned seed pools (PMA)
    # Qwen3.5: its linear-attention layers; None: every layer attends in full
    linear_attention: LinearAttentionSpec | None = None
    # the leading values of a head that rotary turns (from_hf: head_dim, Qwen3.5's a quarter)
    rotary_dim: int = 0

    @property
    def token_size(self) -> int:
        """The width of its per-token vectors: projected, or the final hidden states."""
        projection = self.sentence.token_projection
        return projection.out_features if projection is not None else self.hidden_size

    @property
    def score_kind(self) -> str:
        """What a reranker's scores are: "cosine" (a listwise reranker's), "logit" (a
        CrossEncoder whose activation_fn is none) or "probability"."""
        if self.listwise:
            return "cosine"
        return "logit" if self.sentence.score_activation() == "identity" else "probability"

    @property
    def embedding_size(self) -> int:
        """The width of the vectors an embedder returns (before Matryoshka truncation): a
        multi-vector model's are its tokens'."""
        if self.multi_vector:
            return self.token_size
        pooled = self.attention_pooling.width if self.attention_pooling else self.hidden_size
        return self.sentence.output_size or pooled

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        hf = read_json(path)
        hf["architectures"] = gme_architectures(model_dir, hf.get("architectures") or [])
        config = cls.from_hf(hf)
        sentence = SentenceModules.from_dir(model_dir, config.hidden_size, hf)
        architectures = hf.get("architectures") or ()
        remote = [REMOTE_CODE_HEADS[a] for a in architectures if a in REMOTE_CODE_HEADS]
        if remote and sentence.pooling is None:
            pooling, activation = remote[0]
            sentence = dataclasses.replace(sentence, pooling=pooling, final_activation=activation)
        if config.attention_pooling is not None:  # what its remote code's encode does
            sentence = dataclasses.replace(sentence, pooling="attention")
        wanted = {PROJECTED_TOKEN_ARCHITECTURES.get(a) for a in architectures} - {None}
        tokens = sentence.token_projection
        found = tokens.prefix if tokens and tokens.prefix in TOKEN_PROJECTIONS else None
        if wanted != {found} - {None}:
            owners = ", ".join(f"{a}: {p}weight" for a, p in PROJECTED_TOKEN_ARCHITECTURES.items())
            raise UnsupportedModelError(
                f"{model_dir}: a projection of every token belongs to its architecture, each "
                f"its own ({owners}): architectures {list(architectures)}, projection "
                + (f"found ({found}weight)" if found else "absent")
            )
        adapters = tuple(adapter_names(model_dir))
        multi_vector = config.multi_vector or sentence.late_interaction
        return dataclasses.replace(
            config, sentence=sentence, adapters=adapters, multi_vector=multi_vector
        )

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        architectures = hf.get("architectures") or []
        _refuse_quantized(hf)
        if "vlm_config" in hf:  # ColQwen2ForRetrieval: the model it wraps, with its own names
            outer = ("architectures", "dtype", "torch_dtype")
            hf = {**hf["vlm_config"], **{k: hf[k] for k in outer if k in hf}}
            _refuse_quantized(hf)
        media = MediaConfig.from_hf(hf)
        if "text_config" in hf:  # a multimodal checkpoint: its text model's own config
            top = {k: hf[k] for k in ("tie_word_embeddings", "dtype", "torch_dtype") if k in hf}
            hf = {**hf["text_config"], **top}
        family = next(
            (SUPPORTED_ARCHITECTURES[a] for a in architectures if a in SUPPORTED_ARCHITECTURES),
            None,
        )
        if family is None:
            gme = (
                f" (a GME checkpoint is read as published, with its {GME_SCRIPT}; other "
                "Qwen2-VL embedders number an image's tokens their own ways)"
                if "Qwen2VLForConditionalGeneration" in architectures
                else ""
            )
            raise UnsupportedModelError(
                f"unsupported architectures {architectures}{gme}; supported: "
                + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            )
        # Every layer attends to the whole sequence here (or is Qwen3.5's linear attention):
        # a checkpoint with sliding-window layers (jina-reranker-v3.5 lists them in
        # layer_types) would be silently wrong.
        hybrid = has_linear_attention(architectures)
        mixers = {"full_attention", "linear_attention"} if hybrid else {"full_attention"}
        windowed = sorted(set(hf.get("layer_types") or ()) - mixers)
        if hf.get("use_sliding_window") or windowed:
            raise UnsupportedModelError(
                "sliding-window attention is not supported (use_sliding_window="
                f"{bool(hf.get('use_sliding_window'))}, layer_types with {windowed})"
            )
        hidden = hf["hidden_size"]
        heads = hf["num_attention_heads"]
        # Qwen2 derives head_dim; Qwen3 states it and it may differ from hidden / heads.
        head_dim = hf.get("head_dim") or hidden // heads
        rope = hf.get("rope_parameters") or {}
        # Qwen3.5 turns a quarter of each head (its config class's default where unsaved)
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
        partial = partial if partial is not None else (0.25 if hybrid else 1.0)
        if partial != 1.0 and not hybrid:
            raise UnsupportedModelError(
                f"partial_rotary_factor {partial}: rotary on part of a head is Qwen3.5's only"
            )
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            # Qwen2 always has q/k/v biases; Qwen3 has them only if attention_bias says so.
            has_qkv_bias=True if family == "qwen2" else bool(hf.get("attention_bias", False)),
            has_qk_norm=family in ("qwen3", "qwen3_5"),
            # gte-Qwen2 says is_causal false; voyage-4-nano and pplx-embed, bidirectional
            is_causal=bool(hf.get("is_causal", True))
            and not hf.get("use_bidirectional_attention", False)
            and not BIDIRECTIONAL_ARCHITECTURES.intersection(architectures),
            checkpoint_dtype=hf.get("dtype") or hf.get("torch_dtype"),
            is_classifier=any(a.endswith("ForSequenceClassification") for a in architectures),
            num_labels=len(hf.get("id2label") or {}) or int(hf.get("num_labels", 0) or 0),
            labels=_labels(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            listwise="JinaForRanking" in architectures,
            media=media,
            multi_vector=bool(MULTI_VECTOR_ARCHITECTURES.intersection(architectures)),
            final_norm=not PRE_NORM_ARCHITECTURES.intersection(architectures),
            visual_span_mean=bool(media and VISUAL_SPAN_MEAN.intersection(architectures)),
            mlp_score="JinaVLForRanking" in architectures,
            attention_pooling=AttentionPoolingSpec.from_hf(hf),
            linear_attention=LinearAttentionSpec.from_hf(hf) if hybrid else None,
            rotary_dim=int(head_dim * partial),
        )


def _refuse_quantized(hf: dict) -> None:
    """A checkpoint saved quantized (fp8, GPTQ, AWQ, bitsandbytes...) holds codes whose scales
    only its own format gives: read as plain weights they would give wrong vectors."""
    quantized = hf.get("quantization_config") or (hf.get("text_config") or {}).get(
        "quantization_config"
    )
    if quantized:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else None
        raise UnsupportedModelError(
            f"quantized checkpoints are not read (quantization_config, quant_method {method!r}): "
            "serve the checkpoint it was made from, with the encoder setting quantization fp8 "
            "(GPU) or int8 (CPU) to quantise it at load"
        )


def _labels(hf: dict) -> tuple[str, ...]:
    """id2label ({"0": "negative", ...}) as names in id order; LABEL_i where it is absent."""
    id2label = {int(k): str(v) for k, v in (hf.get("id2label") or {}).items()}
    count = len(id2label) or int(hf.get("num_labels", 0) or 0)
    return tuple(id2label.get(i, f"LABEL_{i}") for i in range(count))


def _rope_theta(hf: dict) -> float:
    """rope_theta lives at the top level (transformers 4.x) or in rope_parameters (5.x)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):  # Qwen2-VL's saves name multimodal rotary mrope
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; only 'default' RoPE is implemented"
        )
    theta = params.get("rope_theta", hf.get("rope_theta"))
    return float(theta if theta is not None else 10000.0)
