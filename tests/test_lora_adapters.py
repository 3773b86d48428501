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
import tritonclient.grpc as grpcclient
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file
from sentence_transformers import SentenceTransformer
from tritonclient.utils import InferenceServerException

from qwen_embed import Encoder, lora
from qwen_embed.adapters import AdapterError
from qwen_embed.chunking import ChunkedText
from qwen_embed.onednn import NativeBf16Weight, brgemm_runs
from qwen_embed.segments import (
    BASE,
    MIN_PREFIX_TOKENS,
    AdapterRows,
    PrefixCache,
    PrefixEntry,
)
from qwen_embed.settings import EncoderSettings, parse_lora_modules
from qwen_embed_client.contract import DEFAULT_TASK, RerankOptions
from qwen_embed_client.gateway.app import create_app
from qwen_embed_deploy.demo import build_demo_adapter
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.serving.rerank import PairTokenizer
from qwen_embed_deploy.triton import TritonServer

from reference import cosine, random_sequences
from replicas import lora_finetune, lora_model, qwen3_embedding
from triton_helpers import infer, run_clients, text_input

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
    }


def _of_another_base(adapter, directory):
    """`adapter` with pairs for a base of another width (A [r, 97])."""
    shutil.copytree(adapter, directory)
    weights = directory / "adapter_model.safetensors"
    pairs = load_file(weights)
    wide = {k: torch.zeros(len(v), 97) if "lora_A" in k else v for k, v in pairs.items()}
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


@pytest.mark.server  # whole fine-tunes against sentence-transformers: seconds
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
        # one call, one forward, a text of each in turn
        names = ["legal", None, "code", "legal"]
        forwards = enc.stats["forwards"]
        got = enc.embed(ids[QUERY], adapter=names)
        assert enc.stats["forwards"] == forwards + 1
        for i, name in enumerate(names):
            want = expected(st, name or "base", QUERY)[i : i + 1]
            assert cosine(got[i : i + 1], want).min() >= FP32_COSINE, (i, name)
    assert cosine(legal, expected(st, "base", "")).max() < 0.99  # the adapter matters


@pytest.mark.server  # starts a tensor-parallel worker
def test_adapters_on_tensor_parallel_shards_and_in_bf16(dirs, st, ids):
    """Column shards take their rows of B, row shards their columns of A (the all-reduce
    sums their partial products as it sums the base's); the workers hear each text's adapter."""
    with Encoder.from_pretrained(
        dirs["base"], dtype="float32", tp_size=2, lora_modules=modules(dirs)
    ) as enc:
        for name in ("legal", "code"):
            got = enc.embed(ids[QUERY], adapter=name)
            assert cosine(got, expected(st, name, QUERY)).min() >= FP32_COSINE, name
        names = ["code", "legal", None, "code"]
        got = enc.embed(ids[""], adapter=names)
        for i, name in enumerate(names):
            want = expected(st, name or "base", "")[i : i + 1]
            assert cosine(got[i : i + 1], want).min() >= FP32_COSINE, (i, name)
    with Encoder.from_pretrained(dirs["base"], dtype="bfloat16", lora_modules=modules(dirs)) as enc:
        for name in ("legal", "code"):
            got = enc.embed(ids[""], adapter=name)
            assert cosine(got, expected(st, name, "")).min() >= BF16_COSINE, name


def test_what_is_not_served_is_named(checkpoint, tmp_path):
    base = checkpoint("qwen3")
    legal, code = (
        build_demo_adapter(tmp_path / n, base, rank=4, seed=i)
        for i, n in enumerate(("legal", "code"))
    )
    seqs = random_sequences([5, 9])
    with Encoder.from_pretrained(base, lora_modules=f"legal={legal},code={code}") as enc:
        with pytest.raises(ValueError, match=r"adapter 'sql' is not served here.*'legal', 'code'"):
            enc.embed(seqs, adapter="sql")
    with Encoder.from_pretrained(base) as enc:
        with pytest.raises(ValueError, match="none: set lora_modules"):
            enc.embed(seqs, adapter="legal")
    other = _of_another_base(legal, tmp_path / "other")
    with pytest.raises(AdapterError, match="an adapter of another base"):
        Encoder.from_pretrained(base, lora_modules=f"x={other}")
    with pytest.raises(AdapterError, match="lora_modules: x: .* is neither a checkpoint"):
        Encoder.from_pretrained(base, lora_modules=f"x={tmp_path / 'nothing'}")
    with pytest.raises(AdapterError, match="holds no adapter_config.json"):
        Encoder.from_pretrained(base, lora_modules=f"x={base}")
    # a fine-tune served as itself merges its adapter: another on top would be trained on
    # other weights
    with pytest.raises(AdapterError, match="do not mix"):
        Encoder.from_pretrained(legal, adapter="lora", lora_modules=f"code={code}")
    bad = tmp_path / "dora"
    bad.mkdir()
    config = json.loads((legal / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    with pytest.raises(AdapterError, match="DoRA"):
        Encoder.from_pretrained(base, lora_modules=f"x={bad}")


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
    assert cache.find(BASE, seq, head, 49) is not None
    assert cache.find(0, seq, head, 49) is None  # the first adapter's
    cache.add(PrefixEntry(ids, 1, space=0))
    assert cache.find(0, seq, head, 49).space == 0 and cache.tokens == 80
    cache.add(PrefixEntry(tuple(range(100, 1050)), 1))  # past the budget: the oldest leaves
    assert cache.find(0, seq, head, 49) is not None and cache.evictions == 1
    assert cache.find(BASE, seq, head, 49) is None


def test_a_forwards_rows_add_their_adapters_in_runs():
    """Runs of rows with one adapter over the computed rows and over the pooled rows; a layer
    of any other row count is refused, not given another's runs."""
    rows = AdapterRows.of(np.array([0, 0, BASE, 1, 1, 1, 0]), np.array([0, BASE, 1, 0]))
    assert rows.runs(7) == ((0, 0, 2), (1, 3, 6), (0, 6, 7))
    assert rows.runs(4) == ((0, 0, 1), (1, 2, 3), (0, 3, 4))
    with pytest.raises(ValueError, match="5 rows"):
        rows.runs(5)
    assert AdapterRows.of(np.array([BASE] * 3), np.array([BASE, BASE])) is None


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_texts_of_several_adapters_share_a_forward(checkpoint, tmp_path, name):
    """One call naming an adapter per text (the base's texts among them) runs one forward,
    each text as a call of its adapter alone computes it without prefix reuse (fp32, max-abs
    <= 1e-5): a prompt every text begins with is computed once per adapter in that forward,
    never shared across adapters, and later calls find each adapter's again; also where
    every text computes one row of its own past the cached prompt (the pruned last layer's
    rows are then the computed ones)."""
    base = checkpoint(name)
    a, b = (build_demo_adapter(tmp_path / n, base, rank=4, seed=i) for i, n in enumerate("ab"))
    prompt = random_sequences([12], seed=5)[0]
    long = [prompt + s for s in random_sequences([5, 17, 3, 9, 30, 1], seed=2)]
    short = [prompt + s for s in random_sequences([1] * 6, seed=3)]
    names = ["a", None, "b", "b", None, "a"]
    settings = {"dtype": "float32", "lora_modules": f"a={a},b={b}"}

    def alone(enc, seqs):
        out = np.empty((len(seqs), enc.embedding_size), np.float32)
        for adapter in ("a", "b", None):
            picked = [i for i, n in enumerate(names) if n == adapter]
            out[picked] = enc.embed([seqs[i] for i in picked], adapter=adapter)
        return out

    with Encoder.from_pretrained(base, prefix_reuse="off", **settings) as enc:
        want = {"long": alone(enc, long), "short": alone(enc, short)}
        plain = enc.embed(long)
    with Encoder.from_pretrained(base, **settings) as enc:
        assert enc.route.prefix_reuse
        got = enc.embed(long, adapter=names)
        assert enc.stats["forwards"] == 1 and enc.prefix_cache.hits == 0
        assert enc.stats["computed_tokens"] == sum(map(len, long)) - 3 * len(prompt)
        assert np.abs(got - want["long"]).max() <= FP32_MAX_ABS
        assert np.abs(alone(enc, long) - want["long"]).max() <= FP32_MAX_ABS
        assert enc.prefix_cache.hits == len(long)  # each adapter's prompt, found by its own
        got = enc.embed(short, adapter=names)
        assert enc.stats["computed_tokens"] == sum(map(len, long)) * 2 - 9 * len(prompt) + 6
        assert np.abs(got - want["short"]).max() <= FP32_MAX_ABS
    adapted = [i for i, n in enumerate(names) if n]
    assert cosine(want["long"][adapted], plain[adapted]).max() < 0.99  # the adapters matter


@pytest.fixture(scope="module")
def served(dirs, reranker, tmp_path_factory):
    """A tritonserver with the base embedder keeping both adapters, and the reranker one."""
    where = tmp_path_factory.mktemp("lora-triton")
    finetune = lora_model(where / "rerank-finetune", reranker)
    overrides = {
        "encoder": {"dtype": "float32"},
        "embed.encoder": {"lora_modules": modules(dirs)},
        "rerank.encoder": {"lora_modules": f"ft={finetune}"},
    }
    repo = render(
        where / "repo", {"embed": dirs["base"]}, overrides, rerankers={"rerank": reranker}
    )
    with TritonServer(repo, log_path=where / "server.log") as server:
        yield server, finetune


@pytest.mark.server
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_requests_name_their_adapter_through_triton(served, st, protocol):
    """Clients at once, each naming the base or an adapter: every answer its own fine-tune's
    (the encoder's forwards take several requests' adapters)."""
    server, _ = served
    names = [None, "legal", "code"] * 2
    counted = {n: server.metric("qwen_embed_adapter_texts_total", adapter=n) for n in names[1:3]}
    tokens = server.metric("qwen_embed_adapter_tokens_total", adapter="legal")

    def one(i):
        params = {"prompt_name": "query"} if i % 2 else {}
        if names[i]:
            params["adapter"] = names[i]
        got, counts = infer(server, TEXTS, protocol, **params)
        want = expected(st, names[i] or "base", QUERY if i % 2 else "")
        assert cosine(got, want).min() >= FP32_COSINE, (i, names[i])
        seen[i] = int(counts.sum())

    seen = {}
    run_clients(len(names), one)
    # each adapter's texts counted apart (two requests of 4 texts each), and its tokens
    for name, before in counted.items():
        assert server.metric("qwen_embed_adapter_texts_total", adapter=name) - before == 8
    legal = server.metric("qwen_embed_adapter_tokens_total", adapter="legal") - tokens
    assert legal == seen[1] + seen[4]


@pytest.mark.server
def test_per_token_vectors_of_an_adapter(served, st):
    """per_token with an adapter: each token's vector is its fine-tune's final hidden state
    (sentence-transformers' token embeddings of that fine-tune), normalised."""
    server, _ = served
    client = grpcclient.InferenceServerClient(server.grpc_url)
    params = {"adapter": "legal", "per_token": True}
    result = client.infer("embed", [text_input(grpcclient, TEXTS)], parameters=params)
    states, counts = result.as_numpy("TOKEN_EMBEDDING"), result.as_numpy("TOKEN_COUNT")[:, 0]
    # one text at a time: a batch's token embeddings hold its padding
    want, base = (
        [st[name].encode([t], output_value="token_embeddings")[0] for t in TEXTS]
        for name in ("legal", "base")
    )
    for got, count, theirs, plain in zip(states, counts, want, base, strict=True):
        assert count == len(theirs)
        assert np.allclose(np.linalg.norm(got[:count], axis=1), 1, atol=1e-5)
        assert cosine(got[:count], theirs.numpy()).min() >= FP32_COSINE
        assert cosine(got[:count], plain.numpy()).min() < 0.99  # the adapter matters


@pytest.mark.server
def test_late_chunks_of_an_adapter_through_triton(served, st):
    """Late chunking with an adapter: a text's one chunk (chunk_size past its length), read
    out as the text's last token is, is its fine-tune's vector of the whole text."""
    server, _ = served
    client = grpcclient.InferenceServerClient(server.grpc_url)

    def chunks(**params):
        result = client.infer("embed", [text_input(grpcclient, TEXTS)], parameters=params)
        return result.as_numpy("CHUNK_EMBEDDING")

    whole = chunks(adapter="legal", chunk_size=512)
    assert whole.shape[1] == 1
    assert cosine(whole[:, 0], expected(st, "legal", "")).min() >= FP32_COSINE
    assert cosine(chunks(chunk_size=512)[:, 0], expected(st, "base", "")).min() >= FP32_COSINE


@pytest.mark.server
def test_what_a_request_cannot_name_is_refused_for_it_alone(served):
    server, _ = served
    for params, message in [
        ({"adapter": "sql"}, r"adapter 'sql' is not served here \(adapters: \['legal', 'code'\]\)"),
        ({"adapter": 5}, "parameter 'adapter' must be a string"),
    ]:
        with pytest.raises(InferenceServerException, match=message):
            infer(server, TEXTS, **params)
    assert infer(server, TEXTS, adapter="legal")[0].shape == (len(TEXTS), 64)


@pytest.mark.server
def test_the_gateway_takes_an_adapter_as_the_model(served, dirs, st, reranker):
    """vLLM's way: `model` names a LoRA module, /v1/models lists them beside their parent."""
    server, finetune = served
    app = create_app([server.grpc_url])
    with TestClient(app) as client:
        listed = client.get("/v1/models").json()["data"]
        answer = client.post("/v1/embeddings", json={"model": "code", "input": TEXTS})
        headers = [
            client.post("/v1/embeddings", json={"model": m, "input": TEXTS[:1]}).headers
            for m in ("embed", "legal", "code")
        ]
        unknown = client.post("/v1/embeddings", json={"model": "sql", "input": TEXTS})
        documents = TEXTS[1:]
        body = {"model": "ft", "query": TEXTS[0], "documents": documents}
        ranked = client.post("/v1/rerank", json=body)
        base = client.post("/v1/rerank", json=body | {"model": "rerank"})
        # the other APIs that name a model: Cohere, Ollama, NIM
        cohere = client.post(
            "/v2/embed",
            json={"model": "legal", "texts": TEXTS, "input_type": "search_document"}
            | {"embedding_types": ["float"]},
        )
        ollama = client.post("/api/embed", json={"model": "code", "input": TEXTS})
        tags = client.get("/api/tags").json()["models"]
        passages = [{"text": d} for d in documents]
        body = {"model": "ft", "query": {"text": TEXTS[0]}, "passages": passages}
        nim = client.post("/v1/ranking", json=body)
    assert {(m["id"], m.get("parent")) for m in listed} >= {("legal", "embed"), ("code", "embed")}
    assert answer.status_code == 200 and answer.json()["model"] == "code"
    # each adapter's vectors are fingerprinted apart from the base's and each other's
    fingerprints = [h["x-model-fingerprint"] for h in headers]
    assert len(set(fingerprints)) == 3 and answer.headers["x-model-fingerprint"] == fingerprints[2]
    got = np.array([d["embedding"] for d in answer.json()["data"]], np.float32)
    assert cosine(got, expected(st, "code", "")).min() >= FP32_COSINE
    assert unknown.status_code == 404 and "'legal' or 'code'" in unknown.json()["error"]["message"]
    assert ranked.status_code == 200, ranked.text
    assert ranked.json()["model"] == "ft"
    pairs = PairTokenizer(reranker, 8192).encode(TEXTS[0], documents, RerankOptions())
    with Encoder.from_pretrained(
        reranker, task="rerank", dtype="float32", lora_modules=f"ft={finetune}"
    ) as enc:
        want, plain = enc.score(pairs, adapter="ft"), enc.score(pairs)
    for answer, scores in ((ranked, want), (base, plain)):
        by_index = {r["index"]: r["relevance_score"] for r in answer.json()["results"]}
        assert np.abs(np.array([by_index[i] for i in range(len(documents))]) - scores).max() <= 1e-5
    got = np.array(cohere.json()["embeddings"]["float"], np.float32)
    assert cosine(got, expected(st, "legal", "")).min() >= FP32_COSINE
    assert cohere.headers["x-model-fingerprint"] == fingerprints[1]
    got = np.array(ollama.json()["embeddings"], np.float32)
    assert cosine(got, expected(st, "code", "")).min() >= FP32_COSINE
    digests = {m["name"]: m["digest"] for m in tags}
    assert [digests[m] for m in ("embed", "legal", "code")] == fingerprints
    by_index = {r["index"]: r["logit"] for r in nim.json()["rankings"]}
    logits = np.log(want / (1 - want))
    assert np.abs(np.array([by_index[i] for i in range(len(documents))]) - logits).max() <= 1e-3


def _unmerged_and_merged(base, tmp_path, seqs, **settings):
    """(vectors of a demo adapter named per request over `base`, the same adapter's fine-tune
    merged at load, the base's own)."""
    adapter = build_demo_adapter(tmp_path / "adapter", base, rank=8, seed=3)
    with Encoder.from_pretrained(base, lora_modules=f"x={adapter}", **settings) as enc:
        unmerged, plain = enc.embed(seqs, adapter="x"), enc.embed(seqs)
    with Encoder.from_pretrained(adapter, **{**settings, "tp_size": 1}) as enc:
        assert enc.route.adapter == "lora"
        merged = enc.embed(seqs)
    return unmerged, merged, plain


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_an_adapter_per_request_equals_it_merged(checkpoint, tmp_path, name):
    """Qwen2's q|k|v biases and Qwen3's q/k norms: (x A^T) B^T added per layer is the merged
    weight's product (fp32, max-abs <= 1e-5)."""
    seqs = random_sequences([5, 17, 40, 3], seed=1)
    unmerged, merged, plain = _unmerged_and_merged(
        checkpoint(name), tmp_path, seqs, dtype="float32"
    )
    assert np.abs(unmerged - merged).max() <= FP32_MAX_ABS
    assert cosine(unmerged, plain).max() < 0.99  # the adapter matters


@pytest.mark.server  # starts a tensor-parallel worker
def test_late_chunks_of_an_adapter_equal_it_merged(checkpoint, tmp_path):
    """Late chunking with an adapter per text, the base's texts among them in one forward
    (their read-out rows after every text's body): each chunk as the fine-tune merged at load
    gives it (fp32, max-abs <= 1e-5), in one process and on two TP ranks; texts with a
    read-out tail (the last layer then computes each chunk's read-out row alone) and beside
    one without (each chunk's last token)."""
    base = checkpoint("qwen3")
    adapter = build_demo_adapter(tmp_path / "adapter", base, rank=8, seed=3)
    bodies = random_sequences([30, 17, 24, 40], seed=6)
    spans = [np.array([(0, 9), (9, len(b)), (3, 12)]) for b in bodies]
    texts = [ChunkedText(np.array(b + [7]), s, 1) for b, s in zip(bodies, spans, strict=True)]
    texts += [ChunkedText(np.array(bodies[0]), spans[0], tail=0)]
    names = ["x", None, "x", "x", None]
    with Encoder.from_pretrained(adapter, dtype="float32") as enc:
        merged = enc.embed_chunks(texts)
    runs = {}
    for tp_size in (1, 2):
        with Encoder.from_pretrained(
            base, lora_modules=f"x={adapter}", dtype="float32", tp_size=tp_size
        ) as enc:
            forwards = enc.stats["forwards"]
            runs[tp_size] = enc.embed_chunks(texts, adapter=names)
            assert enc.stats["forwards"] == forwards + 1
            runs[tp_size, "read out"] = enc.embed_chunks(texts[:4], adapter=names[:4])
            plain = enc.embed_chunks(texts)
    for got in runs.values():
        for i, name in enumerate(names[: len(got)]):
            want = merged[i] if name else plain[i]
            assert np.abs(got[i] - want).max() <= FP32_MAX_ABS, (i, name)
    assert cosine(merged[0], plain[0]).max() < 0.99  # the adapter matters


@pytest.mark.skipif(not brgemm_runs(), reason="the native bf16 GEMM merges; it needs AVX-512")
def test_a_forward_of_one_adapter_multiplies_it_merged(checkpoint, tmp_path, monkeypatch):
    """bf16 on the native GEMM: a forward of one adapter's texts, lora.MERGE_FROM_ROWS rows or
    more, multiplies by each layer's weights with the adapter's pair merged
    (NativeBf16Weight.merged, counted), giving the fine-tune merged at
    load's vectors (its pairs held in bf16: the suite's bf16 bound); with the base's texts in
    the forward, the pairs' products are added (no merge)."""
    seqs = random_sequences([50, 17, 40, 33], seed=7)
    monkeypatch.setattr(lora, "MERGE_FROM_ROWS", sum(map(len, seqs)))
    merges = []
    merged_by = NativeBf16Weight.merged
    monkeypatch.setattr(
        NativeBf16Weight, "merged", lambda self, a, b: merges.append(1) or merged_by(self, a, b)
    )
    base = checkpoint("qwen3")
    adapter = build_demo_adapter(tmp_path / "adapter", base, rank=8, seed=3)
    with Encoder.from_pretrained(base, lora_modules=f"x={adapter}", dtype="bfloat16") as enc:
        assert "native" in enc.route.describe()
        unmerged = enc.embed(seqs, adapter="x")
        merges_in_one = len(merges)
        mixed = enc.embed(seqs, adapter=["x", None, "x", "x"])
    with Encoder.from_pretrained(adapter, dtype="bfloat16") as enc:
        merged = enc.embed(seqs)
    layers = int(json.loads((base / "config.json").read_text())["num_hidden_layers"])
    # q|k|v, o, gate|up and down of every layer but the pruned last, whose rows past the pooled
    # ones take only its key|value projection
    assert merges_in_one == 4 * (layers - 1) + 1 and len(merges) == merges_in_one
    assert cosine(unmerged, merged).min() >= BF16_COSINE
    assert cosine(mixed[[0, 2, 3]], merged[[0, 2, 3]]).min() >= BF16_COSINE


@pytest.mark.server  # starts a tensor-parallel worker
@pytest.mark.skipif(not brgemm_runs(), reason="the native bf16 GEMM merges; it needs AVX-512")
def test_an_adapter_merged_for_a_forward_on_two_ranks(checkpoint, tmp_path):
    """tp_size 2, bf16 on the native GEMM, a forward of one adapter's texts past
    lora.MERGE_FROM_ROWS rows (the worker's own threshold): each rank merges its shards' pairs
    (column shards their rows of B, row shards their columns of A, summed by the all-reduce as
    the base is), giving the fine-tune merged at load's vectors."""
    seqs = random_sequences([400] * 8, seed=8)
    assert sum(map(len, seqs)) >= lora.MERGE_FROM_ROWS
    base = checkpoint("qwen3")
    adapter = build_demo_adapter(tmp_path / "adapter", base, rank=8, seed=3)
    with Encoder.from_pretrained(
        base, lora_modules=f"x={adapter}", dtype="bfloat16", tp_size=2
    ) as enc:
        forwards = enc.stats["forwards"]
        unmerged = enc.embed(seqs, adapter="x")
        assert enc.stats["forwards"] == forwards + 1
    with Encoder.from_pretrained(adapter, dtype="bfloat16") as enc:
        merged = enc.embed(seqs)
    assert cosine(unmerged, merged).min() >= BF16_COSINE


def test_an_adapter_beside_fp32_held_weights(checkpoint, tmp_path):
    """float16 on a CPU holds the linear weights in fp32 (route.Linear.FP32_GEMM): the pairs
    too, multiplied in fp32 as the base is."""
    seqs = random_sequences([5, 17, 40, 3], seed=5)
    unmerged, merged, _ = _unmerged_and_merged(checkpoint("qwen3"), tmp_path, seqs, dtype="float16")
    assert cosine(unmerged, merged).min() >= BF16_COSINE


@pytest.mark.server  # starts a tensor-parallel worker
def test_a_replicated_kv_head_takes_its_adapter_whole(checkpoint, tmp_path):
    """One kv head over two ranks: each rank holds it whole (ColumnParallelLinear's parts), and
    its rows of B too."""
    seqs = random_sequences([5, 17, 40, 3], seed=2)
    unmerged, merged, _ = _unmerged_and_merged(
        checkpoint("qwen3_kv1"), tmp_path, seqs, dtype="float32", tp_size=2
    )
    assert np.abs(unmerged - merged).max() <= FP32_MAX_ABS
