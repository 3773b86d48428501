"""Qwen3-VL's GGUF files: the text model's file beside its vision tower's `mmproj` file.

llama.cpp's converter writes a Qwen3VLForConditionalGeneration checkpoint (Qwen3-VL-Embedding
among them) as two files: the text model (architecture `qwen3vl`: Qwen3's keys, the rotary's
sections and the DeepStack layers' count) and the tower (architecture `clip`, projector
`qwen3vl_merger`: its widths, patch and merge sizes, the image mean and std, which blocks feed
DeepStack). gguf_files.py lays the pair out as one checkpoint directory; here are what the
tower's file gives it: the config's `vision_config`, preprocessor_config.json, and its tensors
under transformers' names (the patch embedding's Conv3D, which the converter cut into one
Conv2D per time step, joined back).
"""

from __future__ import annotations

PROJECTOR = "mmproj.gguf"  # the tower's file's link in the checkpoint directory
TOWER_ARCHITECTURE = "clip"
TEXT_ARCHITECTURE = "qwen3vl"
MERGER = "qwen3vl_merger"  # clip.projector_type of Qwen3-VL's tower
# the converter's one temporal patch size (it refuses others)
TEMPORAL_PATCH = 2
# the Conv3D's time steps, each a Conv2D weight: this name, then with ".1"
PATCH = "v.patch_embd.weight"
GLOBAL_TENSORS = {
    "v.patch_embd.bias": "patch_embed.proj.bias",
    "v.position_embd.weight": "pos_embed.weight",
    "v.post_ln.weight": "merger.norm.weight",
    "v.post_ln.bias": "merger.norm.bias",
    "mm.0.weight": "merger.linear_fc1.weight",
    "mm.0.bias": "merger.linear_fc1.bias",
    "mm.2.weight": "merger.linear_fc2.weight",
    "mm.2.bias": "merger.linear_fc2.bias",
}
BLOCK_TENSORS = {
    "attn_qkv": "attn.qkv",
    "attn_out": "attn.proj",
    "ffn_up": "mlp.linear_fc1",
    "ffn_down": "mlp.linear_fc2",
    "ln1": "norm1",
    "ln2": "norm2",
}
DEEPSTACK_TENSORS = {"fc1": "linear_fc1", "fc2": "linear_fc2", "norm": "norm"}


class TowerError(ValueError):
    """A tower's file not read here, named with why."""


def deepstack_indexes(meta: dict) -> list[int]:
    """The blocks whose outputs feed DeepStack, in order."""
    return [i for i, on in enumerate(meta.get("clip.vision.is_deepstack_layers", [])) if on]


def vision_config(meta: dict, text_hidden: int) -> dict:
    """transformers' Qwen3-VL `vision_config` from the tower file's metadata."""
    if meta.get("clip.projector_type") != MERGER or not meta.get("clip.has_vision_encoder"):
        raise TowerError(
            f"a tower of projector {meta.get('clip.projector_type')!r}: Qwen3-VL's "
            f"({MERGER!r}) is read"
        )
    if not meta.get("clip.use_gelu"):
        raise TowerError("a tower without GELU is not Qwen3-VL's")

    def key(name: str):
        value = meta.get(f"clip.vision.{name}")
        if value is None:
            raise TowerError(f"the tower's metadata lacks clip.vision.{name}")
        return value

    if key("projection_dim") != text_hidden:
        raise TowerError(
            f"the tower projects to {key('projection_dim')} values, the text model is "
            f"{text_hidden} wide: the files are not one model's"
        )
    patch = key("patch_size")
    return {
        "model_type": "qwen3_vl",
        "depth": key("block_count"),
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_heads": key("attention.head_count"),
        "out_hidden_size": text_hidden,
        "patch_size": patch,
        "temporal_patch_size": TEMPORAL_PATCH,
        "spatial_merge_size": key("spatial_merge_size"),
        "in_channels": 3,
        "hidden_act": "gelu_pytorch_tanh",
        "num_position_embeddings": (key("image_size") // patch) ** 2,
        "deepstack_visual_indexes": deepstack_indexes(meta),
    }


def processor_config(meta: dict) -> dict:
    """preprocessor_config.json's image settings from the tower's metadata (the pixel budget
    is the embedding script's: serving/images.py)."""
    return {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "patch_size": meta["clip.vision.patch_size"],
        "temporal_patch_size": TEMPORAL_PATCH,
        "merge_size": meta["clip.vision.spatial_merge_size"],
        "image_mean": list(meta["clip.vision.image_mean"]),
        "image_std": list(meta["clip.vision.image_std"]),
    }


def hf_name(name: str, deepstack: list[int]) -> str:
    """A tower tensor's llama.cpp name as transformers names it (under `model.visual.`);
    `deepstack`: deepstack_indexes (the converter numbers a DeepStack merger by its block)."""
    if name in GLOBAL_TENSORS:
        return f"model.visual.{GLOBAL_TENSORS[name]}"
    if name == PATCH:
        return "model.visual.patch_embed.proj.weight"
    parts = name.split(".")
    if len(parts) == 5 and parts[:2] == ["v", "blk"] and parts[3] in BLOCK_TENSORS:
        return f"model.visual.blocks.{parts[2]}.{BLOCK_TENSORS[parts[3]]}.{parts[4]}"
    if len(parts) == 5 and parts[:2] == ["v", "deepstack"] and parts[3] in DEEPSTACK_TENSORS:
        if parts[2].isdigit() and int(parts[2]) in deepstack:
            merger, part = deepstack.index(int(parts[2])), DEEPSTACK_TENSORS[parts[3]]
            return f"model.visual.deepstack_merger_list.{merger}.{part}.{parts[4]}"
    raise TowerError(f"tensor {name!r} of the tower's GGUF file is not Qwen3-VL's")


def join_patches(first, second):
    """The patch embedding's Conv3D weight [out, in, 2, p, p] from its two time steps."""
    import torch

    return torch.stack([first, second], dim=2)
