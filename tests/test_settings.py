"""The encoder's settings object: defaults written once, built whole from config.pbtxt
parameters, carried whole to tensor-parallel workers; the rendered repositories use it."""

import dataclasses
import json
from pathlib import Path

import pytest

from qwen_embed import EncoderSettings
from qwen_embed.cpu import CpuFeatures
from qwen_embed.parallel import RankSpec
from qwen_embed.worker import threads_per_rank
from qwen_embed_deploy.repository import get_parameter, read_config, render
from qwen_embed_deploy.serving.config import (
    MODEL_REPOSITORY,
    EncoderServing,
    encoder_parameters,
    model_parameters,
)

from reference import route_for

ZEN4 = CpuFeatures.from_flags({"avx2", "avx512f", "avx512_bf16"}, "AMD EPYC 9B14")


def triton_args(params: dict[str, str]) -> dict:
    """What Triton hands a Python model's initialize: the config as JSON."""
    parameters = {k: {"string_value": v} for k, v in params.items()}
    return {"model_config": json.dumps({"parameters": parameters})}


def test_parameters_build_the_settings_whole():
    serving, settings = encoder_parameters(
        model_parameters(
            triton_args(
                {
                    "model_dir": "/m",
                    "dtype": "float32",
                    "max_batch_tokens": "4096",
                    "prefix_reuse": "off",
                    "prefix_cache_mb": "",
                    "cpu_pinning": "off",
                }
            )
        )
    )
    assert serving == EncoderServing(model_dir="/m", cpu_pinning="off")
    assert settings == EncoderSettings(dtype="float32", max_batch_tokens=4096, prefix_reuse="off")
    assert settings.prefix_cache_mb == EncoderSettings().prefix_cache_mb  # empty: the default
    _, defaults = encoder_parameters(model_parameters(triton_args({"model_dir": ""})))
    assert defaults == EncoderSettings()


def test_lora_modules_from_the_environment_where_the_config_is_silent(monkeypatch):
    """`make serve LORA_MODULES=... RERANK_LORA_MODULES=...`: each encoder its own, and a
    config's own setting first."""
    monkeypatch.setenv("QWEN_EMBED_LORA_MODULES", "legal=/a/legal")
    monkeypatch.setenv("QWEN_EMBED_RERANK_LORA_MODULES", "ft=/a/ft")
    embed = encoder_parameters({})[1]
    rerank = encoder_parameters({"task": "rerank"})[1]
    own = encoder_parameters({"lora_modules": "code=/a/code"})[1]
    assert (embed.lora_modules, rerank.lora_modules) == ("legal=/a/legal", "ft=/a/ft")
    assert own.lora_modules == "code=/a/code"


def test_encoder_settings_from_the_environment_where_the_config_is_silent(monkeypatch):
    """`make serve ENCODER_SETTINGS=...`: every encoder takes them, a config's own value first,
    a misspelt key or a pair without "=" refused by name."""
    monkeypatch.setenv("QWEN_EMBED_ENCODER_SETTINGS", " quantization=int8 , max_batch_tokens=4096")
    serving, settings = encoder_parameters({"max_batch_tokens": "", "dtype": "float32"})
    assert (settings.quantization, settings.max_batch_tokens) == ("int8", 4096)
    assert settings.dtype == "float32"
    assert encoder_parameters({"max_batch_tokens": "2048"})[1].max_batch_tokens == 2048
    assert encoder_parameters({"task": "rerank"})[1].quantization == "int8"
    monkeypatch.setenv("QWEN_EMBED_ENCODER_SETTINGS", "cpu_pinning=off")  # a serving one
    assert encoder_parameters({})[0].cpu_pinning == "off"
    monkeypatch.setenv("QWEN_EMBED_ENCODER_SETTINGS", "quantisation=int8")
    with pytest.raises(ValueError, match=r"unknown encoder parameter\(s\) \['quantisation'\]"):
        encoder_parameters({})
    monkeypatch.setenv("QWEN_EMBED_ENCODER_SETTINGS", "int8")
    with pytest.raises(ValueError, match="takes key=value pairs, got \\['int8'\\]"):
        encoder_parameters({})


def test_bad_parameters_are_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown encoder parameter\(s\) \['compile_elementwise'"):
        EncoderSettings.from_parameters({"compile_elementwise": "on"})
    with pytest.raises(ValueError, match="parameter 'max_batch_tokens' must be int"):
        EncoderSettings.from_parameters({"max_batch_tokens": "lots"})
    with pytest.raises(ValueError, match="prefix_reuse must be 'auto', 'on' or 'off'"):
        EncoderSettings.from_parameters({"prefix_reuse": "yes"})
    with pytest.raises(ValueError, match="max_batch_tokens must be >= 1"):
        EncoderSettings(max_batch_tokens=0)
    with pytest.raises(ValueError, match="pooling must be one of"):
        EncoderSettings(pooling="max")


def test_python_switches_and_json_round_trip():
    settings = EncoderSettings(prefix_reuse=False, prepack_weights=None, tp_size=2)
    assert (settings.prefix_reuse, settings.prepack_weights) == ("off", "auto")
    assert EncoderSettings.from_json(settings.to_json()) == settings
    spec = RankSpec("/m", settings, route_for(ZEN4)).with_port(29555)
    assert RankSpec.from_json(spec.to_json()) == spec
    assert (spec.host, spec.port) == ("127.0.0.1", 29555)


def test_encoder_defaults_live_only_in_the_settings_object():
    # The templates name the serving parameters and the task, never an engine default.
    engine_keys = {f.name for f in dataclasses.fields(EncoderSettings)}
    for name, allowed in [("encoder", {"model_dir"}), ("rerank_encoder", {"model_dir", "task"})]:
        keys = set(read_config(MODEL_REPOSITORY / name / "config.pbtxt").parameters)
        assert keys == allowed and not (keys - {"task"}) & engine_keys
    # Both encoders (and both tokenizers) run one model.py.
    for step in ("encoder", "tokenizer"):
        ours = (MODEL_REPOSITORY / step / "1" / "model.py").read_text()
        assert (MODEL_REPOSITORY / f"rerank_{step}" / "1" / "model.py").read_text() == ours


def test_rendered_overrides_add_parameters_the_template_leaves_out(tmp_path, demo_dir):
    repo = render(
        tmp_path,
        {"embed": demo_dir},
        {"encoder": {"dtype": "bfloat16"}},
        rerankers={"rerank": demo_dir},
    )
    config = read_config(repo / "encoder" / "config.pbtxt")
    assert get_parameter(config, "dtype") == "bfloat16"
    assert get_parameter(config, "model_dir") == str(demo_dir)
    params = {k: v.string_value for k, v in config.parameters.items()}
    serving, settings = encoder_parameters(model_parameters(triton_args(params)))
    assert settings.dtype == "bfloat16" and serving.model_dir == str(demo_dir)
    rerank = read_config(repo / "rerank_encoder" / "config.pbtxt")
    assert get_parameter(rerank, "task") == "rerank" and "dtype" in rerank.parameters
    assert (repo / "rerank_encoder" / "1" / "model.py").is_file()


def test_rank_threads_follow_the_affinity_mask():
    assert threads_per_rank(2, 2) == 1
    assert threads_per_rank(1, 2) == 1  # never 0
    assert threads_per_rank(16, 4) == 4


def test_every_setting_is_documented():
    table = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    missing = [
        f.name for f in dataclasses.fields(EncoderSettings) if f"| `{f.name}` |" not in table
    ]
    assert not missing
