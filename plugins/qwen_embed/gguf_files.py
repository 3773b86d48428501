"""A GGUF file (llama.cpp's and Ollama's format) served as a checkpoint.

Qwen publishes Qwen3-Embedding as GGUF files too, and llama.cpp and Ollama users hold their
models so. `checkpoint` lays out, once per version of the file, a directory that the rest of the
server reads as any other checkpoint: config.json from the file's metadata, tokenizer.json rebuilt
from its vocabulary, merges and special tokens (added as llama.cpp adds them), the pooling its
metadata names, and a link to the file itself, whose tensors `tensors` dequantizes one at a time
while the loader reads them (gguf_blocks.py: Q8_0 and the k-quants of Q4_K_M and Q5_K_M in
torch, the other types by the `gguf` package's numpy code, as transformers' GGUF loader does),
under the names transformers gives them. Nothing is written back as weights. The header is read here
(`read`): the `gguf` package's reader takes seconds over a 151K-token vocabulary.

Read: the `qwen2` and `qwen3` architectures with llama.cpp's `qwen2` pre-tokenizer (Qwen2,
Qwen2.5 and Qwen3 models, Qwen3-Embedding among them), every tensor type the `gguf` package
dequantizes; Qwen3-VL's (`qwen3vl`, Qwen3-VL-Embedding's) with its vision tower's file
beside it (gguf_vision.py). A Qwen3-Reranker's file (pooling `rank`: the converter keeps the
output head's "yes" and "no" rows as `cls.output`) is read as a one-label sequence classifier
whose `score` row is their difference: its sigmoid is the model card's P(yes) over the two.
Rotary scaling is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from . import gguf_vision
from .derived_dirs import made_once

SUFFIX = ".gguf"
MAGIC = b"GGUF"
FILE = "model.gguf"  # the file's link in the checkpoint directory
LAYOUT = 1  # of the directory `checkpoint` writes: a new one is made when this changes
ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    gguf_vision.TEXT_ARCHITECTURE: "Qwen3VLForConditionalGeneration",
}
# Qwen3-VL's vision tokens, by the config keys that name their ids
VISION_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
# a reranker's file (pooling rank): its head's rows, in the order the converter writes them
RERANKER = "Qwen3ForSequenceClassification"
RANK_LABELS = ["yes", "no"]
CLS_OUT = "cls.output.weight"
# llama.cpp's `tokenizer.ggml.pre` for Qwen2's byte-level BPE, and the split it names (Qwen2's
# tokenizer.json's)
QWEN2_PRE = "qwen2"
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's pooling types (gguf.PoolingType) -> sentence-transformers' Pooling mode; last
# token (and none said) is what a checkpoint without modules.json gets
POOLING = {1: "mean", 2: "cls"}
RANK_POOLING = 4
# llama.cpp's token types (gguf.TokenType) that are added tokens in transformers' tokenizer
CONTROL, USER_DEFINED = 3, 4
# tensor names: llama.cpp's -> transformers' (a layer's under blk.N. -> model.layers.N.)
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    CLS_OUT: "score.weight",
}
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


class GGUFError(ValueError):
    """A GGUF file not read here, named with why."""


def is_gguf(path: Path) -> bool:
    """A GGUF file (by its first bytes: Ollama's blobs have no suffix), or a folder of .gguf
    files without a checkpoint's config.json."""
    if path.is_file():
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    return path.is_dir() and not (path / "config.json").is_file() and any(path.glob("*" + SUFFIX))


def gguf_file(path: Path) -> Path:
    """The one .gguf model file `path` names or holds (a vision tower's file beside it is not
    one)."""
    if path.is_file():
        return path
    found = [
        p
        for p in sorted(path.glob("*" + SUFFIX))
        if architecture(p) != gguf_vision.TOWER_ARCHITECTURE
    ]
    if len(found) != 1:
        raise GGUFError(
            f"{path} holds {len(found)} GGUF model files ({', '.join(p.name for p in found)}): "
            "name the one to serve"
        )
    return found[0]


def checkpoint(path: Path, projector: Path | None = None) -> Path:
    """The GGUF file `path` names (or the one in that folder) as a checkpoint directory, made
    once per version of its files (processes that start together share it). A Qwen3-VL
    model's vision tower is the `projector` file, else the one tower file beside it."""
    named = gguf_file(path)
    source = named.resolve()  # the file itself, past any links to it
    sources = [source]
    if architecture(source) == gguf_vision.TEXT_ARCHITECTURE:
        sources.append((projector or _tower_beside(named)).resolve())
    parts = [str(LAYOUT)]
    for file in sources:
        stat = file.stat()
        parts += [str(file), str(stat.st_size), str(stat.st_mtime_ns)]
    version = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
    return made_once("qwen-embed-gguf", version, lambda directory: _write(directory, *sources))


def _tower_beside(text_file: Path) -> Path:
    """The one vision tower's file beside a Qwen3-VL text model's file."""
    found = [
        p
        for p in sorted(text_file.parent.glob("*" + SUFFIX))
        if p != text_file and architecture(p) == gguf_vision.TOWER_ARCHITECTURE
    ]
    if len(found) != 1:
        raise GGUFError(
            f"{text_file} is a Qwen3-VL text model, whose vision tower is a second GGUF file "
            f"(llama.cpp's mmproj); {len(found)} are beside it "
            f"({', '.join(p.name for p in found) or 'none'}): keep exactly one there"
        )
    return found[0]


def _write(directory: Path, source: Path, tower: Path | None = None) -> None:
    header = read(source)
    embedding = header.tensors.get("token_embd.weight")
    if embedding is None:
        raise GGUFError(f"{source} has no token_embd.weight tensor")
    config = _config(header.meta, set(header.tensors), embedding.shape[0])
    tokens = _Vocabulary(header.meta, source)
    if tower is not None:
        tower_meta = read(tower).meta
        config = _vision_language(config, tower_meta, tokens)
        processor = gguf_vision.processor_config(tower_meta)
        (directory / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
        (directory / gguf_vision.PROJECTOR).symlink_to(tower)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "tokenizer.json").write_text(tokens.tokenizer_json())
    limit = config.get("text_config", config)["max_position_embeddings"]
    tokenizer_config = tokens.tokenizer_config(limit)
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    pooling = header.meta.get(f"{header.meta['general.architecture']}.pooling_type")
    if pooling in POOLING:
        _write_pooling(directory, POOLING[pooling], config["hidden_size"])
    (directory / FILE).symlink_to(source)


def _vision_language(text: dict, tower_meta: dict, tokens: _Vocabulary) -> dict:
    """Qwen3-VL's config.json: the text model's (`text`, from its file) and the tower's."""
    if tower_meta.get("general.architecture") != gguf_vision.TOWER_ARCHITECTURE:
        raise GGUFError("the vision tower's file is not a GGUF tower file (architecture clip)")
    try:
        vision = gguf_vision.vision_config(tower_meta, text["hidden_size"])
    except gguf_vision.TowerError as e:
        raise GGUFError(str(e)) from None
    ids = {}
    for key, token in VISION_TOKENS.items():
        if token not in tokens.tokens:
            raise GGUFError(f"the vocabulary has no {token}: not a Qwen3-VL model's")
        ids[key] = tokens.tokens.index(token)
    return {
        "architectures": text["architectures"],
        "model_type": "qwen3_vl",
        "text_config": {k: v for k, v in text.items() if k != "architectures"}
        | {"model_type": "qwen3_vl_text"},
        "vision_config": vision,
        "tie_word_embeddings": text["tie_word_embeddings"],
        **ids,
    }


@dataclass(frozen=True)
class Tensor:
    kind: int  # ggml's type (gguf.GGMLQuantizationType)
    shape: tuple[int, ...]  # numpy's order: rows first
    offset: int  # from the file's start


@dataclass(frozen=True)
class Header:
    meta: dict
    tensors: dict[str, Tensor]


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_SCALARS |= {10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# ggml's float types, read as they are (the others are dequantised to float32)
_FLOATS = {0: "float32", 1: "float16", 30: "bfloat16"}


def read(path: Path) -> Header:
    """A GGUF file's metadata and tensor table (format version 2 or 3, little-endian)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            magic, version, count, kv_count = struct.unpack_from("<IIQQ", data, 0)
            if magic != int.from_bytes(MAGIC, "little") or version not in (2, 3):
                raise ValueError(f"magic {magic:#x}, version {version}")
            meta, at = _metadata(data, kv_count)
            table = []
            for _ in range(count):
                name, at = _string(data, at)
                (dims,), at = struct.unpack_from("<I", data, at), at + 4
                shape, at = struct.unpack_from(f"<{dims}Q", data, at), at + 8 * dims
                kind, offset = struct.unpack_from("<IQ", data, at)
                at += 12
                table.append((name, kind, tuple(reversed(shape)), offset))
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise GGUFError(f"{path} is not a GGUF file llama.cpp wrote: {e}") from None
    align = int(meta.get("general.alignment", 32))
    start = -(-at // align) * align
    tensors = {name: Tensor(kind, shape, start + offset) for name, kind, shape, offset in table}
    return Header(meta, tensors)


def architecture(path: Path) -> str | None:
    """A GGUF file's general.architecture, read from its first entries alone (the converter
    writes it first), or None."""
    key = "general.architecture"
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            (kv_count,) = struct.unpack_from("<Q", data, 16)
            return _metadata(data, kv_count, key)[0].get(key)
    except (struct.error, ValueError, UnicodeDecodeError):  # not a GGUF file (or empty)
        return None


def _metadata(data, count: int, last: str | None = None) -> tuple[dict, int]:
    """A header's `count` metadata entries (up to the key `last`) and the offset after them."""
    meta, at = {}, 24
    for _ in range(count):
        key, at = _string(data, at)
        (kind,), at = struct.unpack_from("<I", data, at), at + 4
        meta[key], at = _value(data, at, kind)
        if key == last:
            break
    return meta, at


def _string(data, at: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", data, at)
    end = at + 8 + n
    if end > len(data):
        raise ValueError("a string past the file's end")
    return data[at + 8 : end].decode("utf-8"), end


def _value(data, at: int, kind: int):
    if kind in _SCALARS:
        return struct.unpack_from(_SCALARS[kind], data, at)[0], at + struct.calcsize(_SCALARS[kind])
    if kind == _STRING:
        return _string(data, at)
    if kind != _ARRAY:
        raise ValueError(f"value type {kind}")
    item, n = struct.unpack_from("<IQ", data, at)
    at += 12
    if item in _SCALARS:
        width = struct.calcsize(_SCALARS[item])
        return list(struct.unpack_from(f"<{n}{_SCALARS[item][1]}", data, at)), at + n * width
    values = []
    for _ in range(n):
        value, at = _value(data, at, item)
        values.append(value)
    return values, at


def _config(meta: dict, names: set[str], vocab_size: int) -> dict:
    """transformers' config.json of the model the metadata describes."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"a GGUF file of architecture {arch!r}: GGUF files of {sorted(ARCHITECTURES)} are "
            "read (Qwen2, Qwen2.5 and Qwen3 text models); serve another's safetensors checkpoint"
        )

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"the file's metadata lacks {arch}.{name}")
        return value

    reranker = key("pooling_type", 0) == RANK_POOLING
    labels = meta.get(f"{arch}.classifier.output_labels")
    if reranker and (arch != "qwen3" or CLS_OUT not in names or labels != RANK_LABELS):
        raise GGUFError(
            f"a reranker's GGUF file (pooling rank) of architecture {arch!r}, labels {labels}: "
            f"Qwen3-Reranker's ({CLS_OUT} over the rows {RANK_LABELS}) is read"
        )
    if key("rope.scaling.type", "none") != "none":
        raise GGUFError(f"rotary scaling {key('rope.scaling.type')!r} in a GGUF file is not read")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    if key("attention.value_length", head_dim) != head_dim:
        raise GGUFError("keys and values of different sizes are not a Qwen model's")
    if key("rope.dimension_count", head_dim) != head_dim:
        raise GGUFError("rotary on part of a head is not a Qwen2/Qwen3 model's")
    rope = {"rope_type": "default", "rope_theta": key("rope.freq_base", 10000.0)}
    if arch == gguf_vision.TEXT_ARCHITECTURE:  # multimodal rotary: t, h, w sections
        rope["mrope_section"] = list(key("rope.dimension_sections"))[:3]
        rope["mrope_interleaved"] = True
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_parameters": rope,
        "max_position_embeddings": key("context_length"),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in names,
    }
    if not key("attention.causal", True):
        config["is_causal"] = False
    if reranker:
        config |= {"architectures": [RERANKER], "id2label": {"0": "LABEL_0"}}
    return config


def _write_pooling(directory: Path, mode: str, hidden: int) -> None:
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ]
    (directory / "modules.json").write_text(json.dumps(modules, indent=2))
    (directory / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": hidden, "pooling_mode": mode}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))


class _Vocabulary:
    """The file's tokenizer: byte-level BPE over its tokens and merges, its control and
    user-defined tokens as added tokens, BOS/EOS where its metadata asks for them."""

    def __init__(self, meta: dict, source: Path):
        model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
        if model != "gpt2" or pre != QWEN2_PRE:
            raise GGUFError(
                f"{source}: its tokenizer ({model!r}, pre-tokenizer {pre!r}) is not Qwen2's "
                f"byte-level BPE ('gpt2', {QWEN2_PRE!r})"
            )
        self.tokens = list(meta["tokenizer.ggml.tokens"])
        self.types = list(meta["tokenizer.ggml.token_type"])
        self.merges = list(meta["tokenizer.ggml.merges"])
        self.ends = {
            end: meta.get(f"tokenizer.ggml.{end}_token_id") for end in ("bos", "eos", "padding")
        }
        self.added = {
            end: bool(meta.get(f"tokenizer.ggml.add_{end}_token")) for end in ("bos", "eos")
        }
        for end in ("bos", "eos"):
            if self.added[end] and self.ends[end] is None:
                raise GGUFError(f"{source}: add_{end}_token without an {end}_token_id")

    def _name(self, end: str) -> str | None:
        token_id = self.ends[end]
        return self.tokens[token_id] if token_id is not None else None

    def tokenizer_json(self) -> str:
        from tokenizers import (
            AddedToken,
            Regex,
            Tokenizer,
            decoders,
            models,
            normalizers,
            pre_tokenizers,
            processors,
        )

        vocab: dict[str, int] = {}
        for token_id, token in enumerate(self.tokens):
            vocab.setdefault(token, token_id)
        merges = [tuple(merge.split(" ")) for merge in self.merges]
        if any(len(pair) != 2 for pair in merges):
            raise GGUFError("a merge in the file is not two tokens")
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(
                    add_prefix_space=False, trim_offsets=False, use_regex=False
                ),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        for kind, add in ((CONTROL, tok.add_special_tokens), (USER_DEFINED, tok.add_tokens)):
            add(
                [
                    AddedToken(token, special=kind == CONTROL, normalized=False)
                    for token, its_kind in zip(self.tokens, self.types, strict=True)
                    if its_kind == kind
                ]
            )
        ends = {end: (self._name(end), self.ends[end]) for end in ("bos", "eos") if self.added[end]}
        head = [ends["bos"][0]] if "bos" in ends else []
        tail = [ends["eos"][0]] if "eos" in ends else []
        if ends:
            tok.post_processor = processors.TemplateProcessing(
                single=[*head, "$A", *tail],
                pair=[*head, "$A", "$B:1", *tail],
                special_tokens=sorted(set(ends.values())),
            )
        else:
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
        return tok.to_str()

    def tokenizer_config(self, max_length: int) -> dict:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length}
        for end, key in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token")):
            if (name := self._name(end)) is not None:
                config[key] = name
        return config


def tensors(path: Path):
    """(transformers' name, tensor) for each tensor of the GGUF file: quantised ones
    dequantised to float32, the others in their own dtype (a view of the file's bytes)."""
    import numpy as np
    import torch

    from . import gguf_blocks

    header = read(path)
    names = _namer(header.meta)
    # a plain array over the map: numpy's memmap subclass doubles the package's dequantising
    raw = np.asarray(np.memmap(path, np.uint8, mode="c"))
    patch = None  # a tower's first time step of its patch embedding, until the second
    for name, tensor in header.tensors.items():
        if tensor.kind in _FLOATS:
            dtype = getattr(torch, _FLOATS[tensor.kind])
            data = _bytes(raw, name, tensor, math.prod(tensor.shape) * dtype.itemsize)
            values = torch.from_numpy(data).view(dtype).reshape(tensor.shape)
        else:
            size = gguf_blocks.stored_bytes(tensor.kind, math.prod(tensor.shape))
            data = _bytes(raw, name, tensor, size)
            values = gguf_blocks.dequantize(data, tensor.kind).reshape(tensor.shape)
        if name == CLS_OUT:  # "yes" less "no": the one label's row
            values = values[:1].float() - values[1:2].float()
        if name in (gguf_vision.PATCH, gguf_vision.PATCH + ".1"):
            if patch is None:
                patch = values
                continue
            first, second = (patch, values) if name.endswith(".1") else (values, patch)
            name, values = gguf_vision.PATCH, gguf_vision.join_patches(first, second)
        yield names(name), values


def _bytes(raw, name: str, tensor: Tensor, size: int):
    if tensor.offset + size > len(raw):
        raise GGUFError(f"tensor {name!r} lies past the end of the GGUF file")
    return raw[tensor.offset : tensor.offset + size]


def tensor_dtypes(path: Path) -> dict:
    """Each tensor's dtype as `tensors` yields it, by transformers' name (from the header)."""
    import torch

    stored = {kind: getattr(torch, dtype) for kind, dtype in _FLOATS.items()}
    header = read(path)
    names = _namer(header.meta)
    return {
        names(name): torch.float32 if name == CLS_OUT else stored.get(tensor.kind, torch.float32)
        for name, tensor in header.tensors.items()
        if name != gguf_vision.PATCH + ".1"  # joined to the first time step's
    }


def _namer(meta: dict):
    """transformers' name of each tensor of a file with this metadata: a model's, or a
    Qwen3-VL vision tower's."""
    if meta.get("general.architecture") != gguf_vision.TOWER_ARCHITECTURE:
        return hf_name
    deepstack = gguf_vision.deepstack_indexes(meta)

    def tower_name(name: str) -> str:
        try:
            return gguf_vision.hf_name(name, deepstack)
        except gguf_vision.TowerError as e:
            raise GGUFError(str(e)) from None

    return tower_name


def hf_name(name: str) -> str:
    """A llama.cpp tensor name as transformers names it."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    block, _, rest = name.partition(".")
    layer, _, rest = rest.partition(".")
    if block == "blk" and layer.isdigit() and rest in LAYER_TENSORS:
        return f"model.layers.{layer}.{LAYER_TENSORS[rest]}"
    raise GGUFError(f"tensor {name!r} of the GGUF file is not a Qwen2/Qwen3 model's")
