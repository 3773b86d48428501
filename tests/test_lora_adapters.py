"""LoRA adapters a request names (qwen_embed/lora.py, setting lora_modules): several fine-tunes
of one base served from one copy of its weights, each against sentence-transformers loading
that fine-tune (peft's unmerged forward over the base): fp32 cosine >= 0.99999 and max-abs
<= 1e-5, bf16 cosine >= 0.999, tensor-parallel shards alike.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from sentence_transformers import SentenceTransformer

from qwen_embed import Encoder
from qwen_embed.adapters import AdapterError
from qwen_embed.segments import MIN_PREFIX_TOKENS, PrefixCache, PrefixEntry
from qwen_embed.settings import EncoderSettings, parse_lora_modules
from qwen_embed_client.contract import DEFAULT_TASK

from reference import cosine
from replicas import lora_finetune, qwen3_embedding

FP32_COSINE = 0.99999
FP32_MAX_ABS = 1e-5
BF16_COSINE = 0.999
QUERY = f"Instruct: {DEFAULT_TASK}\nQuery:"
TEXTS = [
    "What is the capital of China?",
    "Beijing is the capital of China.",
    "naïve café — emoji 🎉 你好",
    "def f(x):\n    return x ** 2",
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = qwen3_embedding(root / "Qwen3-Embedding-0.6B")
    legal = lora_finetune(root / "legal", base, seed=1)
    return {
        "base": base,
        "legal": legal,
        "code": lora_finetune(root / "code", base, seed=2, rank=8),
        "other": _of_another_base(legal, root / "other"),
    }


def _of_another_base(adapter, directory):
    """`adapter` with pairs for a base of another width (A [r, 96])."""
    shutil.copytree(adapter, directory)
    weights = directory / "adapter_model.safetensors"
    pairs = load_file(weights)
    wide = {k: torch.zeros(len(v), 96) if "lora_A" in k else v for k, v in pairs.items()}
    save_file(wide, weights)
    return directory


@pytest.fixture(scope="module")
def st(dirs):
    return {
        name: SentenceTransformer(
            str(dirs[name]), device="cpu", model_kwargs={"dtype": torch.float32}
        )
        for name in ("base", "legal", "code")
    }


@pytest.fixture(scope="module")
def ids(st):
    tokenizer = st["base"].tokenizer
    return {prompt: [tokenizer(prompt + t)["input_ids"] for t in TEXTS] for prompt in ("", QUERY)}


def modules(dirs):
    return f"legal={dirs['legal']},code={dirs['code']}"


def expected(st, name, prompt):
    return st[name].encode(TEXTS, prompt=prompt)


def test_each_request_gets_its_adapter_over_one_base(dirs, st, ids):
    """Calls alternating between the base and two adapters (ranks 4 and 8) on one encoder,
    with and without a shared query prompt: each as its fine-tune. A prefix computed with one
    adapter's weights is never another's (the cache keeps each adapter's own), and an
    adapter's repeated prefix is found again."""
    with Encoder.from_pretrained(dirs["base"], dtype="float32", lora_modules=modules(dirs)) as enc:
        assert enc.adapters == ("legal", "code") and enc.route.adapter is None
        for name, adapter in [("base", None), ("legal", "legal"), ("code", "code")] * 2:
            for prompt in ("", QUERY):
                got = enc.embed(ids[prompt], adapter=adapter)
                want = expected(st, name, prompt)
                assert cosine(got, want).min() >= FP32_COSINE, (name, prompt)
                assert np.abs(got - want).max() <= FP32_MAX_ABS, (name, prompt)
        assert enc.prefix_cache.hits >= 2 * len(TEXTS)  # each adapter's second round
        legal = enc.embed(ids[""], adapter="legal")
    assert cosine(legal, expected(st, "base", "")).max() < 0.99  # the adapter matters


@pytest.mark.server  # starts a tensor-parallel worker
def test_adapters_on_tensor_parallel_shards_and_in_bf16(dirs, st, ids):
    """Column shards take their rows of B, row shards their columns of A (the all-reduce
    sums their partial products as it sums the base's)."""
    with Encoder.from_pretrained(
        dirs["base"], dtype="float32", tp_size=2, lora_modules=modules(dirs)
    ) as enc:
        for name in ("legal", "code"):
            got = enc.embed(ids[QUERY], adapter=name)
            assert cosine(got, expected(st, name, QUERY)).min() >= FP32_COSINE, name
    with Encoder.from_pretrained(dirs["base"], dtype="bfloat16", lora_modules=modules(dirs)) as enc:
        for name in ("legal", "code"):
            got = enc.embed(ids[""], adapter=name)
            assert cosine(got, expected(st, name, "")).min() >= BF16_COSINE, name


def test_what_is_not_served_is_named(dirs, ids, tmp_path):
    with Encoder.from_pretrained(dirs["base"], dtype="float32", lora_modules=modules(dirs)) as enc:
        with pytest.raises(ValueError, match=r"adapter 'sql' is not served here.*'legal', 'code'"):
            enc.embed(ids[""], adapter="sql")
    with Encoder.from_pretrained(dirs["base"], dtype="float32") as enc:
        with pytest.raises(ValueError, match="none: set lora_modules"):
            enc.embed(ids[""], adapter="legal")
    with pytest.raises(AdapterError, match="an adapter of another base"):
        Encoder.from_pretrained(dirs["base"], dtype="float32", lora_modules=f"x={dirs['other']}")
    with pytest.raises(AdapterError, match="lora_modules: x: .* is neither a checkpoint"):
        Encoder.from_pretrained(dirs["base"], dtype="float32", lora_modules=f"x={tmp_path}")
    with pytest.raises(AdapterError, match="holds no adapter_config.json"):
        Encoder.from_pretrained(dirs["base"], dtype="float32", lora_modules=f"x={dirs['base']}")
    # a fine-tune served as itself merges its adapter: another on top would be trained on
    # other weights
    with pytest.raises(AdapterError, match="do not mix"):
        Encoder.from_pretrained(
            dirs["legal"], dtype="float32", adapter="lora", lora_modules=f"code={dirs['code']}"
        )
    bad = dirs["legal"].parent / "dora"
    bad.mkdir()
    config = json.loads((dirs["legal"] / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    with pytest.raises(AdapterError, match="DoRA"):
        Encoder.from_pretrained(dirs["base"], dtype="float32", lora_modules=f"x={bad}")


def test_the_setting_is_read_whole():
    assert parse_lora_modules(" a=/x/y , b ,c=org/repo") == (
        ("a", "/x/y"),
        ("b", None),  # the checkpoint's own adapters/b/
        ("c", "org/repo"),
    )
    assert parse_lora_modules("") == ()
    for bad, message in [
        ("a=/x,a=/y", "names 'a' twice"),
        ("a=", "name=path pairs"),
        ("a b=/x", "name=path pairs"),
    ]:
        with pytest.raises(ValueError, match=message):
            EncoderSettings(lora_modules=bad)


def test_the_prefix_cache_keeps_each_adapters_prefixes_apart():
    cache = PrefixCache(capacity_bytes=10_000, bytes_per_token=10, num_layers=1)
    ids = tuple(range(40))
    seq = np.arange(50)
    head = ids[:MIN_PREFIX_TOKENS]
    cache.add(PrefixEntry(ids, 1))
    assert cache.find(seq, head, 49) is not None
    cache.space = 0  # the first adapter's forwards
    assert cache.find(seq, head, 49) is None
    cache.add(PrefixEntry(ids, 1))
    assert cache.find(seq, head, 49) is not None and cache.tokens == 80
    cache.add(PrefixEntry(tuple(range(100, 1050)), 1))  # past the budget: the oldest leaves
    assert cache.find(seq, head, 49) is not None and cache.evictions == 1
    cache.space = None
    assert cache.find(seq, head, 49) is None
