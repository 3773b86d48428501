"""Checkpoint loading: shards, key prefixes, missing/unexpected tensors, architectures."""

import dataclasses
import json
import resource
import shutil
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen_embed import CheckpointError, Encoder, UnsupportedModelError, engine, int8, loader
from qwen_embed.cpu import HeapTrimmer
from qwen_embed.layers import _Linear
from qwen_embed.route import Gemm, Linear

from reference import make_checkpoint, random_sequences

SEQS = random_sequences([4, 60, 1], seed=11)


def embed(model_dir, **kwargs):
    with Encoder.from_pretrained(model_dir, **kwargs) as enc:
        return enc.embed(SEQS)


@pytest.fixture
def reference_vectors(checkpoint):
    return embed(checkpoint("qwen3"))


def copy_checkpoint(source, target):
    for f in source.iterdir():
        shutil.copy(f, target / f.name)
    return target


def test_sharded_checkpoint(tmp_path, reference_vectors):
    make_checkpoint(tmp_path, "qwen3", max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    assert (tmp_path / "model.safetensors.index.json").is_file()
    np.testing.assert_array_equal(embed(tmp_path), reference_vectors)


def quantised(layer):
    return [m for n, m in layer.named_modules() if isinstance(m, _Linear) and int8.quantizes(n)]


def test_each_layer_is_quantised_and_its_floats_freed_as_it_is_read(checkpoint, monkeypatch):
    """The int8 route converts a decoder layer as soon as its last tensor is read, and its
    float weights go then (nothing keeps them: a parameter's loader refers to its module), so
    that the load never holds the float model beside the int8 one."""
    load_weights, seen = engine.load_weights, []

    def spied(model, *args, loaded, **kwargs):
        floats = [[weakref.ref(m.weight) for m in quantised(layer)] for layer in model.layers]

        def state():  # (layers converted, those of them whose float weights are gone)
            converted = [all(m.weight is None for m in quantised(layer)) for layer in model.layers]
            freed = [all(ref() is None for ref in refs) for refs in floats]
            return sum(converted), sum(c and f for c, f in zip(converted, freed, strict=True))

        def spy(param):
            seen.append(state())
            loaded(param)

        load_weights(model, *args, loaded=spy, **kwargs)
        seen.append(state())

    monkeypatch.setattr(engine, "load_weights", spied)
    with Encoder.from_pretrained(checkpoint("qwen3"), dtype="float32", quantization="int8") as enc:
        layers = len(enc.model.layers)
    assert layers >= 2
    assert [converted for converted, _ in seen] == sorted(converted for converted, _ in seen)
    assert {converted for converted, _ in seen} == set(range(layers + 1))
    assert all(freed == converted for converted, freed in seen)


def test_a_float_route_converts_after_the_load_and_trims_the_heap_after_each_layer(
    checkpoint, monkeypatch
):
    """A float route packs its weights once the whole checkpoint is read, a decoder layer at a
    time with every freed page handed back after each (HeapTrimmer(0)): where a packed copy
    lands otherwise depends on the heap's history, and with it the load's peak."""
    load_weights, trims, model = engine.load_weights, [], {}

    def converted():
        layers = model["model"].layers
        return sum(all(m.weight is None for m in quantised(layer)) for layer in layers)

    def spied(m, *args, **kwargs):
        model["model"] = m
        load_weights(m, *args, **kwargs)
        model["after_load"] = converted()

    class Trimmer(HeapTrimmer):
        def __call__(self, *_):
            if self.keep_bytes == 0:
                trims.append(converted())
            super().__call__()

    monkeypatch.setattr(engine, "load_weights", spied)
    monkeypatch.setattr(engine, "HeapTrimmer", Trimmer)
    with Encoder.from_pretrained(checkpoint("qwen3"), dtype="float32") as enc:
        layers = len(enc.model.layers)
        assert enc.route.linear == Linear.FLOAT and enc.route.gemm is not None
    assert layers >= 2 and model["after_load"] == 0
    assert trims == list(range(1, layers + 1))


def test_base_model_keys_without_prefix(checkpoint, tmp_path, reference_vectors):
    """A Qwen3Model export: same weights, keys without "model.", no lm_head."""
    copy_checkpoint(checkpoint("qwen3"), tmp_path)

    def strip_prefix(tensors):
        lm = {k: tensors.pop(k) for k in list(tensors)}
        tensors.update(
            {k.removeprefix("model."): v for k, v in lm.items() if not k.startswith("lm_head.")}
        )

    rewrite_tensors(tmp_path, strip_prefix)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3Model"]}))
    keys = load_file(tmp_path / "model.safetensors").keys()
    assert "norm.weight" in keys and not any(k.startswith(("model.", "lm_head.")) for k in keys)
    np.testing.assert_array_equal(embed(tmp_path), reference_vectors)


def test_lm_checkpoint_keys_with_prefix(checkpoint):
    keys = load_file(checkpoint("qwen3") / "model.safetensors").keys()
    assert all(k.startswith(("model.", "lm_head.")) for k in keys)


def rewrite_tensors(directory, change):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def mappings() -> list[tuple[int, int, Path | None]]:
    """This process's memory mappings: (start, end, the file mapped or None)."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(a, 16) for a in fields[0].split("-"))
        named = len(fields) > 5 and fields[5].startswith("/")
        found.append((start, end, Path(fields[5]) if named else None))
    return found


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_embedding_table_stays_where_the_file_maps_it(tmp_path, dtype):
    """On CPU a bf16 checkpoint's embedding table is not copied where the model's dtype holds
    its values exactly (fp32, bf16): the rows are the file's mapping, read from disk only for
    the tokens met and shared by every process through the page cache; the rows gathered are
    the table's, widened to the model's dtype. Only the table's bytes stay mapped (the other
    tensors' pages, read at load, go with them). fp16 cannot hold every bf16 value: a copy."""
    make_checkpoint(tmp_path, "qwen3", dtype=torch.bfloat16)
    weights = (tmp_path / "model.safetensors").resolve()
    ids = torch.tensor(SEQS[1] + [0, 511])
    with Encoder.from_pretrained(tmp_path, dtype=dtype) as enc:
        module = enc.model.embed_tokens
        rows = module(ids)
        address = module.weight.data_ptr()
        held = [(start, end) for start, end, path in mappings() if path == weights]
    table = load_file(weights)["model.embed_tokens.weight"]
    assert rows.dtype == getattr(torch, dtype)
    torch.testing.assert_close(rows, table[ids].to(rows.dtype), rtol=0, atol=0)
    if dtype == "float16":
        assert held == [] and module.weight.dtype == torch.float16
    else:
        ((start, end),) = held
        assert start <= address < end and module.weight.dtype == torch.bfloat16
        page = resource.getpagesize()
        assert table.nbytes <= end - start <= table.nbytes + 2 * page


LFS_POINTER = (
    "version https://git-lfs.github.com/spec/v1\n"
    "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 1211\n"
)
WEIGHTS = "model.safetensors"


@pytest.mark.parametrize(
    "name, damage, message",
    [
        (
            WEIGHTS,
            lambda b: b[:-5000],
            r"model.safetensors is cut short: its header describes \d+ bytes, the file holds",
        ),
        (
            WEIGHTS,
            lambda b: b"\xff" * 8 + b[8:],
            r"model.safetensors is not a safetensors file: .*a header of 18446744073709551615 "
            r"bytes in a file of",
        ),
        (WEIGHTS, lambda b: b[:5], r"model.safetensors is not a safetensors file"),
        (WEIGHTS, lambda b: b[:8] + b"[" + b[9:], r"model.safetensors is not a safetensors file"),
        (WEIGHTS, lambda b: LFS_POINTER.encode(), r"/model.safetensors is a Git LFS pointer, not"),
        ("config.json", lambda b: b'{"architectures": ["Qwen3', r"/config.json is not valid JSON"),
    ],
    ids=[
        "cut short",
        "header size garbled",
        "a few bytes",
        "header not an object",
        "weights an LFS pointer",
        "config cut short",
    ],
)
def test_a_damaged_file_is_named(checkpoint, tmp_path, name, damage, message):
    """What a download cut short, a garbled file or a clone without git-lfs leaves:
    CheckpointError naming the file, whichever reader meets it first (the sentence modules'
    look for projections does)."""
    copy_checkpoint(checkpoint("qwen3"), tmp_path)
    path = tmp_path / name
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError, match=message):
        embed(tmp_path)


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("tokenizer.json", LFS_POINTER, r"/tokenizer.json is a Git LFS pointer, not the file"),
        (
            "tokenizer.json",
            '{"version": "1.0", "model": ',
            r"/tokenizer.json is not a tokenizer the tokenizers library reads: ",
        ),
        ("tokenizer_config.json", "{'add_eos_token': True}", r"tokenizer_config.json is not valid"),
    ],
    ids=["tokenizer an LFS pointer", "tokenizer cut short", "tokenizer config not JSON"],
)
def test_a_damaged_tokenizer_file_is_named(demo_dir, tmp_path, name, text, message):
    from qwen_embed_deploy.serving.tokenizer import TextTokenizer

    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_dir / f, tmp_path / f)
    (tmp_path / name).write_text(text)
    with pytest.raises(CheckpointError, match=message):
        TextTokenizer(tmp_path, 512)


def test_embedding_table_shorter_than_the_vocabulary_is_named(checkpoint, tmp_path):
    copy_checkpoint(checkpoint("qwen3"), tmp_path)
    name = "model.embed_tokens.weight"
    rewrite_tensors(tmp_path, lambda t: t.update({name: t[name][:500].clone()}))
    with pytest.raises(CheckpointError, match=r"at least 512 rows of 96.*\(500, 96\)"):
        embed(tmp_path)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    copy_checkpoint(checkpoint("qwen3"), tmp_path)
    rewrite_tensors(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: layers\.1\.self_attn\.k_proj"):
        embed(tmp_path)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    copy_checkpoint(checkpoint("qwen3"), tmp_path)
    extra = {"model.layers.0.extra.weight": torch.ones(3)}
    rewrite_tensors(tmp_path, lambda t: t.update(extra))
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.extra\.weight'"
    ):
        embed(tmp_path)


def test_wrong_shape_is_named(checkpoint, tmp_path):
    copy_checkpoint(checkpoint("qwen3"), tmp_path)
    rewrite_tensors(tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(5)}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*shape mismatch"):
        embed(tmp_path)


@pytest.mark.parametrize(
    "change",
    [
        {"use_sliding_window": True},
        {"layer_types": ["full_attention", "sliding_attention"]},  # jina-reranker-v3.5's kind
    ],
)
def test_sliding_window_layers_are_refused(checkpoint, tmp_path, change):
    copy_checkpoint(checkpoint("qwen3"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(UnsupportedModelError, match="sliding-window attention"):
        embed(tmp_path)


@pytest.mark.parametrize("nested", [False, True])  # a multimodal config's text_config
def test_quantized_checkpoints_are_refused(checkpoint, tmp_path, nested):
    """An fp8 checkpoint as llm-compressor saves it would otherwise fail on its first scale
    tensor as an unexpected one, or, scales elsewhere, load its codes as weights."""
    copy_checkpoint(checkpoint("qwen3"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    quantized = {"quant_method": "compressed-tensors", "format": "float-quantized"}
    if nested:
        config["text_config"] = {"quantization_config": quantized}
    else:
        config["quantization_config"] = quantized
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedModelError,
        match="quantized checkpoints are not read .*'compressed-tensors'.*quantization fp8",
    ):
        embed(tmp_path)


def test_unsupported_architecture(checkpoint, tmp_path):
    copy_checkpoint(checkpoint("qwen3"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedModelError,
        match="supported: C2LLMForEmbedding, CodeFuse_CGE_Large, ColQwen2, ColQwen2ForRetrieval, "
        "ColQwen2_5, ColQwen3, ColQwen3_5, GmeQwen2VL, JinaEmbeddingsV4Model, "
        "JinaEmbeddingsV5Model, JinaForRanking, JinaVLForRanking, "
        "PPLXQwen3ContextualModel, PPLXQwen3Model, Qwen2ForCausalLM, "
        "Qwen2ForSequenceClassification, Qwen2Model, "
        "Qwen3ForCausalLM, Qwen3ForSequenceClassification, Qwen3Model",
    ):
        embed(tmp_path)


def test_pickled_weights_are_refused(checkpoint, tmp_path):
    shutil.copy(checkpoint("qwen3") / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="only safetensors"):
        embed(tmp_path)


def test_rope_theta_from_either_place():
    from qwen_embed.config import ModelConfig

    base = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "vocab_size": 10,
    }
    assert ModelConfig.from_hf({**base, "rope_theta": 5.0}).rope_theta == 5.0
    nested = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}
    assert ModelConfig.from_hf(nested).rope_theta == 7.0
    with pytest.raises(UnsupportedModelError, match="rope_type 'yarn'"):
        ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    assert ModelConfig.from_hf(base).has_qkv_bias and not ModelConfig.from_hf(base).has_qk_norm


def _sentence_files(directory, pooling: dict, dense: dict | None = None) -> None:
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"}]
    modules.append({"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if dense is not None:
        modules.append({"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
        (directory / "2_Dense").mkdir()
        (directory / "2_Dense" / "config.json").write_text(json.dumps(dense))
        weights = {"linear.weight": torch.ones(dense["out_features"], dense["in_features"])}
        save_file(weights, directory / "2_Dense" / "model.safetensors")
    (directory / "modules.json").write_text(json.dumps(modules))


def test_what_follows_the_transformer_is_read_from_the_checkpoint(checkpoint, tmp_path):
    """sentence_modules.py: the Pooling mode (as sentence-transformers before and since 6 write
    it), a top-level `linear` and Dense modules chained by width; what it cannot apply is
    refused by name, not ignored."""
    from qwen_embed.config import ModelConfig
    from qwen_embed.sentence_modules import SentenceModulesError

    cases = {
        "mean": ({"pooling_mode_mean_tokens": True}, None, None),
        "dense": (
            {"pooling_mode_cls_token": True},
            {"in_features": 128, "out_features": 32, "bias": False},
            None,
        ),
        "chain": (
            {"pooling_mode_lasttoken": True},
            {"in_features": 96, "out_features": 32, "bias": False},
            "a projection from 96 features follows a vector of 128",
        ),
        "max": ({"pooling_mode_max_tokens": True}, None, r"pooling \['max'\]"),
        # sentence-transformers 6 writes one `pooling_mode`
        "mean6": ({"pooling_mode": "mean", "embedding_dimension": 128}, None, None),
        "weighted6": ({"pooling_mode": "weightedmean"}, None, r"pooling \['weightedmean'\]"),
        "two6": ({"pooling_mode": ["mean", "max"]}, None, r"pooling \['mean', 'max'\]"),
        "residual": (
            {"pooling_mode": "lasttoken"},
            {"in_features": 128, "out_features": 128, "use_residual": True},
            "use_residual false",
        ),
        "per token": (
            {"pooling_mode": "lasttoken"},
            {"in_features": 128, "out_features": 8, "module_input_name": "token_embeddings"},
            "lists no MultiVectorMask",  # a MultiVectorEncoder's projection of every token
        ),
        "prompt": (
            {"pooling_mode_mean_tokens": True, "include_prompt": False},
            None,
            "include_prompt false",
        ),
        "tanh?": (
            {"pooling_mode_lasttoken": True},
            {"in_features": 128, "out_features": 8, "activation_function": "my.Swish"},
            "activation 'my.Swish' is not supported",
        ),
    }
    for name, (pooling, dense, error) in cases.items():
        (tmp_path / name).mkdir()
        directory = copy_checkpoint(checkpoint("qwen3"), tmp_path / name)
        tensors = load_file(directory / "model.safetensors")
        tensors["linear.weight"] = torch.zeros(128, 96)  # hidden 96 -> 128, voyage's way
        save_file(tensors, directory / "model.safetensors")
        _sentence_files(directory, pooling, dense)
        if error:
            with pytest.raises(SentenceModulesError, match=error):
                ModelConfig.from_dir(directory)
            continue
        config = ModelConfig.from_dir(directory)
        widths = [(d.in_features, d.out_features) for d in config.sentence.dense]
        expected = {"mean": ("mean", [(96, 128)]), "dense": ("cls", [(96, 128), (128, 32)])}
        expected["mean6"] = expected["mean"]
        assert (config.sentence.pooling, widths) == expected[name]
        assert config.embedding_size == widths[-1][1]


# The float16 fields of a k-quant block (bytes), set to small scales in the random blocks below
K_QUANT_SCALES = {"Q4_K": slice(0, 4), "Q5_K": slice(0, 4), "Q6_K": slice(208, 210)}


def _stored(rng, array, quant):
    """`array` as a GGUF file stores it in type `quant` (uint8 rows): quantised by the `gguf`
    package, or, for the k-quants it cannot write, random blocks with small float16 scales."""
    import gguf

    if quant.name not in K_QUANT_SCALES:
        return gguf.quants.quantize(array, quant)
    values, size = gguf.GGML_QUANT_SIZES[quant]
    rows, width = array.shape
    blocks = rng.integers(0, 256, (rows, width // values, size), dtype=np.uint8)
    scales = blocks[..., K_QUANT_SCALES[quant.name]]
    small = rng.standard_normal(scales.shape[:-1] + (scales.shape[-1] // 2,)) * 0.01
    blocks[..., K_QUANT_SCALES[quant.name]] = small.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["F32", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_tensors_are_what_the_gguf_package_reads(tmp_path, kind):
    """Each tensor type as the `gguf` package reads it, bit for bit (Q8_0 and the k-quants by
    our torch code, the other quantised types by the package's), under transformers' names; a
    file cut short names the tensor past its end."""
    import gguf

    from qwen_embed.gguf_files import GGUFError, tensors

    quant = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(0)
    arrays = {
        "token_embd.weight": rng.standard_normal((40, 256), dtype=np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((64, 512), dtype=np.float32) * 3,
        "blk.0.attn_norm.weight": rng.standard_normal(256, dtype=np.float32),
    }
    writer = gguf.GGUFWriter(tmp_path / "x.gguf", "qwen3")
    expected = {}
    for name, array in arrays.items():
        if array.ndim == 2 and kind != "F32":
            stored = _stored(rng, array, quant)
            writer.add_tensor(name, stored, raw_dtype=quant)
            expected[name] = gguf.quants.dequantize(stored, quant)
        else:
            writer.add_tensor(name, array)
            expected[name] = array
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file):
        write()
    writer.write_tensors_to_file()
    writer.close()
    got = dict(tensors(tmp_path / "x.gguf"))
    names = ["embed_tokens", "layers.0.self_attn.q_proj", "layers.0.input_layernorm"]
    assert list(got) == [f"model.{name}.weight" for name in names]
    for (name, want), value in zip(expected.items(), got.values(), strict=True):
        # float types as they are stored (views of the file), quantised ones in float32
        stored = torch.bfloat16 if kind == "BF16" and want.ndim == 2 else torch.float32
        assert value.shape == want.shape and value.dtype == stored, name
        assert np.array_equal(value.float().numpy(), want), name
    data = (tmp_path / "x.gguf").read_bytes()
    (tmp_path / "x.gguf").write_bytes(data[:-200])
    with pytest.raises(GGUFError, match="'blk.0.attn_norm.weight' lies past the end"):
        list(tensors(tmp_path / "x.gguf"))


def test_a_damaged_file_the_heads_or_adapters_open_is_named(tmp_path):
    """The files safetensors' own reader opens (a Dense module's, a LoRA adapter's)."""
    from qwen_embed.loader import safetensors_file

    path = tmp_path / "adapter_model.safetensors"
    path.write_text(LFS_POINTER)
    with pytest.raises(CheckpointError, match=r"/adapter_model.safetensors is a Git LFS pointer"):
        safetensors_file(path)
    path.write_bytes(b"\x08" + b"\x00" * 7 + b"{}garbage")
    with pytest.raises(CheckpointError, match=r"/adapter_model.safetensors is not a safetensors"):
        safetensors_file(path)


@pytest.mark.parametrize(
    "stored, changes, width",
    [
        (torch.float32, {"dtype": "float32"}, 4),
        (torch.float32, {"dtype": "bfloat16"}, 2),
        (torch.bfloat16, {"dtype": "bfloat16"}, 2),
        # a bf16 checkpoint computed in fp32 is held in fp32, as are 16-bit weights multiplied
        # by one fp32 GEMM (Linear.FP32_GEMM), except where our AVX2 GEMM packs bf16 values
        (torch.bfloat16, {"dtype": "float32"}, 4),
        (torch.bfloat16, {"dtype": "bfloat16", "linear": Linear.FP32_GEMM}, 4),
        (torch.bfloat16, {"dtype": "float32", "gemm": Gemm.NATIVE_F32}, 2),
        (torch.float32, {"dtype": "float32", "gemm": Gemm.NATIVE_F32}, 4),
        (torch.bfloat16, {"dtype": "bfloat16", "linear": Linear.INT8}, 1),
    ],
)
def test_the_weight_floor_counts_each_decoder_element_once(
    checkpoint, tmp_path, stored, changes, width
):
    """engine.host_weights: every decoder-layer element of the checkpoint (read here whole),
    at the bytes the route holds it in; nothing else (the embedding table is mapped from its
    file, the norm after the last layer is small). A second file of extra layers beyond
    num_hidden_layers (an MTP head's, say) is not counted."""
    src = checkpoint("qwen3")
    shutil.copytree(src, tmp_path / "ckpt")
    tensors = {k: t.to(stored) for k, t in load_file(src / "model.safetensors").items()}
    save_file(tensors, tmp_path / "ckpt" / "model.safetensors")
    extra = {"model.layers.99.mlp.up_proj.weight": torch.zeros(64, 64, dtype=torch.bfloat16)}
    save_file(extra, tmp_path / "ckpt" / "extra.safetensors")
    ckpt, config, route = engine.plan(tmp_path / "ckpt", engine.EncoderSettings(device="cpu"))
    route = dataclasses.replace(route, **{"linear": Linear.FLOAT, "gemm": Gemm.ONEDNN} | changes)
    layers = [t for k, t in tensors.items() if k.startswith("model.layers.")]
    assert layers and len(layers) < len(tensors)
    elements = sum(t.numel() for t in layers)
    assert engine.host_weights(ckpt, config, route) == (elements, elements * width)
    assert len(loader.layer_tensors(ckpt, 100)) == len(layers) + 1  # the extra file is read
    gpu = dataclasses.replace(route, device="cuda:0")  # held on the GPU, not the host
    assert engine.host_weights(ckpt, config, gpu) == (0, 0)
