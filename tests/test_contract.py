"""The request contract (qwen_embed_client.contract) against the served repository: the
client's tables (outputs, types, limits, priorities) agree with the config.pbtxt files the
server loads, and every option travels as parameters and back unchanged."""

import argparse
import json
import re
import subprocess
import sys
from dataclasses import fields

import numpy as np
import pytest
from google.protobuf.json_format import MessageToDict
from tritonclient.grpc.model_config_pb2 import DataType

from qwen_embed import ModelConfig
from qwen_embed.engine import host_weights, plan
from qwen_embed.settings import EncoderSettings
from qwen_embed_client.contract import (
    EMBEDDING_OUTPUTS,
    EMBEDDING_TYPES,
    FACTS,
    MAX_DOCUMENTS,
    MAX_INPUTS,
    MAX_TEXTS_PER_REQUEST,
    PRIORITIES,
    EmbedOptions,
    Finish,
    RequestError,
    RerankOptions,
    at_least_one,
    compact,
    finish_rows,
    read_facts,
    read_finish,
)
from qwen_embed_deploy.repository import (
    facts_question,
    publish_facts,
    read_config,
    repository_configs,
    set_parameter,
)
from qwen_embed_deploy.serving.config import (
    MODEL_REPOSITORY,
    EncoderServing,
    TokenizerSettings,
    encoder_parameters,
    model_facts,
    model_parameters,
    tokenizer_settings,
)

CONFIGS = repository_configs(MODEL_REPOSITORY)
NUMPY_TYPES = {DataType.TYPE_FP32: np.float32, DataType.TYPE_INT8: np.int8}
NUMPY_TYPES |= {DataType.TYPE_UINT8: np.uint8}


def outputs(name: str) -> dict[str, int]:
    return {o.name: o.data_type for o in CONFIGS[name].output}


def test_every_batching_model_takes_the_contracts_texts_per_request():
    batching = {n: c.max_batch_size for n, c in CONFIGS.items() if c.max_batch_size}
    assert set(batching) == {"embed", "tokenizer", "encoder", "rerank_encoder"}
    assert set(batching.values()) == {MAX_TEXTS_PER_REQUEST}


def test_each_embedding_type_travels_in_an_output_of_its_numpy_type():
    vectors = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    for model in ("embed", "encoder"):
        declared = outputs(model)
        for kind in EMBEDDING_TYPES:
            name = EMBEDDING_OUTPUTS[kind]
            assert compact(vectors, kind).dtype == NUMPY_TYPES[declared[name]], (model, kind)
        assert "CHUNK_EMBEDDING" in declared
    assert EmbedOptions(chunk_size=4).outputs == {"float": "CHUNK_EMBEDDING"}
    assert EmbedOptions(embedding_type="ubinary").outputs == {"ubinary": "EMBEDDING_UBINARY"}
    several = EmbedOptions(embedding_type="ubinary,float")  # one request, every type asked
    assert several.embedding_types == ("float", "ubinary")
    assert several.outputs == {"float": "EMBEDDING", "ubinary": "EMBEDDING_UBINARY"}


def test_priority_levels_are_the_models_levels():
    for name in ("tokenizer", "encoder", "rerank_encoder"):
        batcher = CONFIGS[name].dynamic_batching
        assert batcher.priority_levels == max(PRIORITIES.values()), name
        assert batcher.default_priority_level == PRIORITIES["interactive"], name


def test_finish_rows_fit_the_declared_input_and_round_trip():
    (finish_input,) = [o for o in CONFIGS["tokenizer"].output if o.name == "FINISH"]
    for finish in (
        Finish(),
        Finish(64, False, ("binary",)),
        Finish(None, True, ("uint8",)),
        Finish(8, True, EMBEDDING_TYPES),
        Finish(16, False, ("float",), per_token=True),
        Finish(per_token=True, skiplist=True),
    ):
        rows = finish_rows(finish, 3)
        assert rows.shape == (3, *finish_input.dims) and rows.dtype == np.int32
        assert read_finish(rows, 1024) == finish
    with pytest.raises(RequestError, match=r"input 'FINISH' must hold \(dimensions in 0..32"):
        read_finish(finish_rows(Finish(64), 1), 32)


def test_the_templates_parameters_are_settings_fields():
    tokenizer_fields = {f.name for f in fields(TokenizerSettings)}
    encoder_fields = {f.name for f in fields(EncoderServing)} | {
        f.name for f in fields(EncoderSettings)
    }
    for name in ("tokenizer", "rerank_tokenizer"):
        assert set(CONFIGS[name].parameters) <= tokenizer_fields, name
    for name in ("encoder", "rerank_encoder"):
        assert set(CONFIGS[name].parameters) <= encoder_fields, name
    assert not (tokenizer_fields | encoder_fields) & set(FACTS)


def test_published_facts_are_read_back_and_never_taken_for_settings(demo_dir):
    """What the launcher writes into the served configs (publish_facts) is what clients read
    (read_facts), and the models' settings ignore it."""
    served = {}
    for name in ("tokenizer", "encoder"):
        config = read_config(MODEL_REPOSITORY / name / "config.pbtxt")
        set_parameter(config, "model_dir", str(demo_dir))
        publish_facts(name, config)
        served[name] = MessageToDict(config, preserving_proto_field_name=True)
    tokenizer, encoder = (read_facts(served[n]) for n in ("tokenizer", "encoder"))
    fingerprints = [tokenizer.pop("fingerprint"), encoder.pop("fingerprint")]
    assert all(re.fullmatch("[0-9a-f]{32}", f) for f in fingerprints)  # test_fingerprint.py
    assert tokenizer == {
        "dimension": 1024,
        "tokens_per_text": ModelConfig.from_dir(demo_dir).max_position_embeddings,
        "prompt_names": ["document", "query"],  # no config_sentence_transformers.json
        "default_prompt_name": None,
    }
    checkpoint, config, route = plan(demo_dir, EncoderSettings(device="cpu"))
    weights = host_weights(checkpoint, config, route)
    assert encoder == {
        "dimension": 1024,
        "route": route.to_dict(),
        "tokens_per_forward": EncoderSettings().max_batch_tokens,
        "host_weight_bytes": weights.bytes,
        "host_weight_elements": weights.elements,
    }
    assert encoder["host_weight_bytes"] > 0
    params = {n: model_parameters({"model_config": json.dumps(c)}) for n, c in served.items()}
    assert tokenizer_settings(params["tokenizer"]) == TokenizerSettings(model_dir=str(demo_dir))
    assert encoder_parameters(params["encoder"]) == (
        EncoderServing(model_dir=str(demo_dir)),
        EncoderSettings(),
    )


# The launcher's facts (launcher.facts_ahead) in a process of its own, as the launcher runs
_FACTS_AHEAD = """
import json, sys
from qwen_embed_deploy.launcher import facts_ahead
from qwen_embed_deploy.repository import facts_question, repository_configs
from qwen_embed_deploy.serving.config import MODEL_REPOSITORY
facts = facts_ahead(repository_configs(MODEL_REPOSITORY))
configs = repository_configs(MODEL_REPOSITORY).items()
answers = {n: facts(*q) for n, c in configs if (q := facts_question(c)) is not None}
print(json.dumps({"torch": "torch" in sys.modules, "answers": answers}))
"""


@pytest.mark.server  # a child process imports torch: seconds
def test_the_launchers_facts_are_each_models_own():
    """facts_ahead works out every tokenizer's and encoder's facts at once (the encoders' in a
    child process, the tokenizers' in the launcher's): each is model_facts' answer for that
    model, and the launcher is left without torch."""
    out = subprocess.run(
        [sys.executable, "-c", _FACTS_AHEAD], capture_output=True, text=True, check=True
    )
    ahead = json.loads(out.stdout.strip().splitlines()[-1])
    assert ahead["torch"] is False
    configs = repository_configs(MODEL_REPOSITORY)
    expected = {n: model_facts(*q) for n, c in configs.items() if (q := facts_question(c))}
    assert set(expected) == {"tokenizer", "encoder", "rerank_tokenizer", "rerank_encoder"}
    assert ahead["answers"] == expected


@pytest.mark.parametrize(
    "options",
    [
        EmbedOptions(),
        EmbedOptions(truncate=False, truncation_direction="left", prompt_name="query"),
        EmbedOptions(instruction="Find code", dimensions=64, normalize=False),
        EmbedOptions(prompt="passage: ", embedding_type="binary"),
        EmbedOptions(embedding_type="int8,float,ubinary"),
        EmbedOptions(chunk_spans=[[0, 3], [3, 9]]),
        EmbedOptions(chunk_size=128),
        EmbedOptions(token_ids=True, max_tokens=64, truncation_direction="left"),
        EmbedOptions(video_fps=2.5, video_max_frames=16),
    ],
)
def test_options_cross_as_parameters_unchanged(options):
    params = options.parameters()
    assert json.loads(json.dumps(params)) == params  # what Triton carries: JSON scalars
    assert EmbedOptions.from_parameters(params) == options
    assert "truncate" not in EmbedOptions().parameters()  # defaults are not sent


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"dimensions": True}, "parameter 'dimensions' must be an integer"),
        ({"dimensions": 0}, "parameter 'dimensions' must be >= 1"),
        ({"dimensions": 2**63}, "parameter 'dimensions' must be an integer of at most 64 bits"),
        ({"max_tokens": -(2**64)}, "parameter 'max_tokens' must be an integer of at most 64"),
        ({"embedding_type": "int4"}, "parameter 'embedding_type' must be one of"),
        ({"embedding_type": "int8,int8"}, "or several of them separated by commas"),
        ({"embedding_type": "float,"}, "or several of them separated by commas"),
        ({"truncation_direction": "up"}, "parameter 'truncation_direction' must be one of"),
        ({"normalize": "yes"}, "parameter 'normalize' must be a boolean"),
        ({"prompt": " "}, "parameter 'prompt' must not be empty"),
        # a lone surrogate (JSON's escape "\\ud800"): no UTF-8 parameter can carry it
        ({"prompt_name": "\ud800"}, "parameter 'prompt_name' is not valid UTF-8"),
        ({"instruction": "x\udfff"}, "parameter 'instruction' is not valid UTF-8"),
        ({"prompt": "p", "prompt_name": "query"}, "parameter 'prompt' replaces"),
        ({"instruction": "x", "prompt_name": "document"}, "parameter 'instruction' fills"),
        ({"chunk_size": 0}, "parameter 'chunk_size' must be >= 1"),
        ({"chunk_spans": "[[2, 1]]"}, r"parameter 'chunk_spans'\[0\] = \[2, 1\]"),
        ({"chunk_spans": "[[0, 1]"}, "parameter 'chunk_spans' must be a JSON list"),
        ({"chunk_size": 4, "chunk_spans": "[[0, 1]]"}, "exclude each other"),
        ({"chunk_size": 4, "embedding_type": "int8"}, "must be 'float' with chunks"),
        ({"dimension": 4}, r"unknown parameter\(s\) \['dimension'\]"),
        ({"max_tokens": 0}, "parameter 'max_tokens' must be >= 1"),
        ({"token_ids": 1}, "parameter 'token_ids' must be a boolean"),
        ({"token_ids": True, "prompt_name": "query"}, "cannot be combined with 'prompt_name'"),
        ({"token_ids": True, "chunk_size": 8}, "cannot be combined with 'chunks'"),
        ({"video_fps": 0}, "parameter 'video_fps' must be a number > 0, got 0"),
        ({"video_fps": "2"}, "parameter 'video_fps' must be a number > 0"),
        ({"video_fps": True}, "parameter 'video_fps' must be a number > 0"),
        ({"video_max_frames": 1}, r"parameter 'video_max_frames' must be in 2..256, got 1"),
        ({"video_max_frames": 257}, r"parameter 'video_max_frames' must be in 2..256"),
        ({"video_max_frames": 8.0}, "parameter 'video_max_frames' must be an integer"),
    ],
)
def test_a_broken_rule_names_the_field_and_the_limit(params, message):
    with pytest.raises(RequestError, match=message) as e:
        EmbedOptions.from_parameters(params)
    assert e.value.field in (*params, None)  # None: the unknown names


def test_model_facts_are_checked_by_the_tokenizer_only():
    options = EmbedOptions(dimensions=2048, prompt_name="passage")
    with pytest.raises(RequestError, match=r"parameter 'dimensions' must be in 1..1024"):
        options.check_model(1024, ["query"])
    with pytest.raises(RequestError, match=r"'prompt_name' must be one of \['document', 'query'\]"):
        EmbedOptions(prompt_name="passage").check_model(1024, ["query", "document"])


def test_rerank_options():
    assert RerankOptions().parameters() == {}
    options = RerankOptions(truncate=False, instruction="Judge code", max_document_tokens=8)
    assert RerankOptions.from_parameters(options.parameters()) == options
    with pytest.raises(RequestError, match="parameter 'max_document_tokens' must be >= 1"):
        RerankOptions(max_document_tokens=0)
    sampled = RerankOptions(video_fps=0.5, video_max_frames=8)
    assert RerankOptions.from_parameters(sampled.parameters()) == sampled
    with pytest.raises(RequestError, match="parameter 'video_max_frames' must be in 2..256"):
        RerankOptions(video_max_frames=0)
    with pytest.raises(RequestError, match=r"unknown parameter\(s\) \['dimensions'\]"):
        RerankOptions.from_parameters({"dimensions": 4})


def test_rendered_copies_keep_the_contract(tmp_path):
    from qwen_embed_deploy.repository import render

    repo = render(tmp_path / "out", {"embed": tmp_path}, rerankers={"rerank": tmp_path})
    for name in ("embed", "tokenizer", "encoder"):
        rendered = read_config(repo / name / "config.pbtxt")
        assert rendered.max_batch_size == MAX_TEXTS_PER_REQUEST
        assert [o.name for o in rendered.output] == [o.name for o in CONFIGS[name].output]


def test_counts_and_limits_of_the_http_edge_are_the_contracts():
    """top_n and max_document_tokens: one rule for the client and every API of the gateway."""
    assert at_least_one("top_n", None) is None and at_least_one("top_n", 3) == 3
    for bad, message in (
        (0, "must be >= 1, got 0"),
        (True, "must be an integer"),
        (2.0, "must be an integer"),
    ):
        with pytest.raises(RequestError, match=f"parameter 'top_n' {message}"):
            at_least_one("top_n", bad)
    assert MAX_INPUTS >= MAX_TEXTS_PER_REQUEST and MAX_DOCUMENTS >= 1


def test_the_cli_flags_are_the_contracts_options():
    """Every option of the contract a user sets by hand is a flag of the CLI, named, typed and
    limited as the field is; what the flags give back is a valid option record."""
    from qwen_embed_client import cli

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    embed, rerank = sub.add_parser("embed"), sub.add_parser("rerank")
    for options, p in ((EmbedOptions, embed), (RerankOptions, rerank)):
        for flag, keywords in cli.option_flags(options):
            p.add_argument(flag, **keywords)
    flags = {a.dest: a for a in embed._actions}
    # what a user types on the command line: everything but the wire-only fields
    wire_only = {"chunk_spans", "chunk_chars", "chunk_by_separator", "token_ids"}
    assert {f.name for f in fields(EmbedOptions)} - set(flags) == wire_only
    assert flags["max_tokens"].type is int and flags["dimensions"].type is int
    assert flags["video_fps"].type is float and flags["video_max_frames"].type is int
    assert flags["normalize"].option_strings == ["--no-normalize"]
    assert flags["truncation_direction"].choices == ["right", "left"]
    assert flags["embedding_type"].choices == list(EMBEDDING_TYPES)

    args = parser.parse_args(
        ["embed", "--max-tokens", "7", "--no-normalize", "--truncation-direction", "left"]
    )
    options = EmbedOptions(**cli.options_from_flags(EmbedOptions, args))
    assert options == EmbedOptions(max_tokens=7, normalize=False, truncation_direction="left")
    assert parser.parse_args(["embed"]).normalize is True
    with pytest.raises(SystemExit):  # argparse refuses what the contract's choices exclude
        parser.parse_args(["embed", "--truncation-direction", "up"])

    args = parser.parse_args(["rerank", "--max-document-tokens", "32", "--no-truncate"])
    options = RerankOptions(**cli.options_from_flags(RerankOptions, args))
    assert options == RerankOptions(max_document_tokens=32, truncate=False)
