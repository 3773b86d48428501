"""One tritonserver serving two checkpoints side by side (rendered repository)."""

import numpy as np
import pytest
from tokenizers import Tokenizer

from qwen_embed import Encoder
from qwen_embed_deploy.demo import build_demo_model
from qwen_embed_deploy.repository import get_parameter, instance_group, read_config, render
from qwen_embed_deploy.triton import TritonServer

from triton_helpers import infer

pytestmark = pytest.mark.server  # starts tritonserver or other processes

TEXTS = ["first checkpoint or second?", "两个模型并排"]


def test_render_gpu_variant(demo_dir, tmp_path):
    repo = render(
        tmp_path,
        {"embed": demo_dir},
        {"encoder": {"dtype": "bfloat16"}},
        encoder_instances="count: 1, kind: KIND_GPU",
    )
    config = read_config(repo / "encoder" / "config.pbtxt")
    assert list(config.instance_group) == [instance_group("count: 1, kind: KIND_GPU")]
    assert get_parameter(config, "dtype") == "bfloat16"
    assert get_parameter(config, "model_dir") == str(demo_dir.resolve())


def test_a_setting_for_one_deployment(demo_dir, tmp_path):
    """NAME.STEP overrides (the CLI's --set NAME.encoder.KEY=VALUE) reach that deployment only,
    over the ones for every deployment."""
    overrides = {
        "encoder": {"dtype": "float32", "max_batch_tokens": "4096"},
        "rerank.encoder": {"lora_modules": "ft=/adapters/ft", "dtype": "bfloat16"},
    }
    repo = render(tmp_path, {"embed": demo_dir}, overrides, rerankers={"rerank": demo_dir})
    embed = read_config(repo / "encoder" / "config.pbtxt")
    rerank = read_config(repo / "rerank_encoder" / "config.pbtxt")
    assert get_parameter(embed, "lora_modules") == ""
    assert (get_parameter(embed, "dtype"), get_parameter(rerank, "dtype")) == (
        "float32",
        "bfloat16",
    )
    assert get_parameter(rerank, "lora_modules") == "ft=/adapters/ft"
    assert get_parameter(rerank, "max_batch_tokens") == "4096"


def test_two_checkpoints_one_server(demo_dir, tmp_path):
    second = build_demo_model(tmp_path / "second", layers=1, seed=1)
    # fp32: an exact comparison (dtype auto is bf16 on bf16 CPUs, where the server's and this
    # process's compiled elementwise kernels may round differently)
    encoder = {"max_batch_tokens": "4096", "dtype": "float32"}
    repo = render(
        tmp_path / "repo", {"embed": demo_dir, "second": second}, overrides={"encoder": encoder}
    )
    assert sorted(p.name for p in repo.iterdir()) == [
        "embed",
        "encoder",
        "second",
        "second_encoder",
        "second_tokenizer",
        "tokenizer",
    ]
    assert 'string_value: "4096"' in (repo / "second_encoder" / "config.pbtxt").read_text()
    ids = [e.ids for e in Tokenizer.from_file(str(second / "tokenizer.json")).encode_batch(TEXTS)]
    with TritonServer(repo, log_path=tmp_path / "server.log") as server:
        first_out = infer(server, TEXTS, "grpc", model="embed")[0]
        second_out = infer(server, TEXTS, "grpc", model="second")[0]
    for model_dir, out in ((demo_dir, first_out), (second, second_out)):
        with Encoder.from_pretrained(model_dir, dtype="float32") as enc:
            assert np.abs(out - enc.embed(ids)).max() <= 1e-4
    assert np.abs(first_out - second_out).max() > 0.1
