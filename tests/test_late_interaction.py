"""ColBERT-style late interaction over a Qwen3 backbone: a sentence-transformers 6.3
MultiVectorEncoder (its Transformer's lengths and query expansion, a Dense projection of every
token, MultiVectorMask with or without a skiplist, Normalize per token), served as a
multi-vector model. Every token vector is checked against sentence-transformers' own
MultiVectorEncoder on the same directory (`encode_query`, `encode_document`, `encode`): fp32
max-abs error 1e-4, bf16 min cosine 0.999.
"""

import base64
import json
import shutil
import string

import numpy as np
import pytest
import torch

from qwen_embed import Encoder
from qwen_embed.config import ModelConfig
from qwen_embed.sentence_modules import SentenceModulesError
from qwen_embed_client.contract import EmbedOptions
from qwen_embed_deploy.serving.tokenizer import TextTokenizer

from reference import cosine
from replicas import multi_vector_encoder, qwen3_embedding

FP32_ABS = 1e-4
BF16_COSINE = 0.999
PROMPTS = {"query": "[Q] ", "document": "[D] "}
QUERIES = ["what is the capital of China?", "which river runs through " + "a long query " * 12]
DOCUMENTS = [
    "Beijing is the capital of China. " * 4,
    "Paris, France",
    "北京是中华人民共和国的首都。",
]
# A layout per reading of queries: none, ColBERT's fixed 16 tokens (Qwen's tokenizer pads on
# the left: the expansion comes first), at least 16 (padded at the end), with their lengths
# and skiplists (PyLate's punctuation for documents; two marks for queries and documents).
LAYOUTS = {
    "plain": dict(prompts=PROMPTS, document_length=24),
    "fixed": dict(
        prompts=PROMPTS,
        query_expansion={"strategy": "fixed", "attend": True, "length": 16},
        skiplist={"skiplist_words": list(string.punctuation)},
    ),
    # no prompts saved, no Normalize: the tasks still apply; vectors unnormalised
    "min": dict(
        query_expansion={"strategy": "min", "attend": True, "length": 16},
        query_length=20,
        normalize=False,
        skiplist={"skiplist_words": ["?", ","], "skiplist_tasks": ["query", "document"]},
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("late-interaction")
    base = qwen3_embedding(root / "base")
    return {name: multi_vector_encoder(root / name, base, **k) for name, k in LAYOUTS.items()}


def st_vectors(model_dir, dtype=torch.float32) -> dict:
    """sentence-transformers' token vectors, one text at a time: {task: [per text]}."""
    from sentence_transformers import MultiVectorEncoder

    st = MultiVectorEncoder(str(model_dir), device="cpu", model_kwargs={"dtype": dtype})
    one = lambda encode, texts: [encode([t])[0].float().numpy() for t in texts]  # noqa: E731
    return {
        "query": one(st.encode_query, QUERIES),
        "document": one(st.encode_document, DOCUMENTS),
        None: one(st.encode, DOCUMENTS),
    }


def served_vectors(model_dir, dtype="float32", normalize=True) -> tuple[dict, dict]:
    """The tokenizer's ids per task (its prompt name) and the engine's token vectors, its
    skiplist applied where the tokenizer says (FINISH)."""
    tok = TextTokenizer(model_dir, 8192)
    ids, vectors = {}, {}
    with Encoder.from_pretrained(model_dir, dtype=dtype) as enc:
        for task, texts in (("query", QUERIES), ("document", DOCUMENTS), (None, DOCUMENTS)):
            opts = EmbedOptions(prompt_name=task, per_token=True)
            ids[task] = tok.encode(texts, opts)
            skiplist = tok.finish(opts).skiplist
            vectors[task] = enc.embed_tokens(ids[task], normalize=normalize, skiplist=skiplist)
    return ids, vectors


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_token_vectors_equal_sentence_transformers(models, layout):
    model_dir = models[layout]
    config = ModelConfig.from_dir(model_dir)
    assert config.multi_vector and config.token_size == 24
    normalize = LAYOUTS[layout].get("normalize", True)
    want = st_vectors(model_dir)
    ids, got = served_vectors(model_dir, normalize=normalize)
    for task in want:
        for i, (ours, theirs) in enumerate(zip(got[task], want[task], strict=True)):
            assert ours.shape == theirs.shape, (task, i)
            assert np.abs(ours - theirs).max() <= FP32_ABS, (task, i)
    # what each reading changes, so that the checks above can fail
    tokens = {task: [len(i) for i in lists] for task, lists in ids.items()}
    rows = {task: [len(v) for v in vectors] for task, vectors in want.items()}
    if layout == "fixed":
        assert tokens["query"] == rows["query"] == [16, 16]  # expanded; the long one cut
        assert rows["document"][0] < tokens["document"][0]  # its full stops left out
        assert rows[None][0] < tokens[None][0]  # as a document's
    if layout == "min":
        assert tokens["query"] == [16, 20]  # expanded; cut at query_length
        assert rows["query"] == [15, 20] and rows["document"][1] < tokens["document"][1]
    if layout == "plain":
        assert tokens["document"][0] == 24 < tokens[None][0]  # document_length
        assert rows == tokens
    # a document's prompt, where one is saved, moves its last token's vector
    moved = np.abs(want["document"][1][-1] - want[None][1][-1]).max() > 1e-3
    assert moved == ("prompts" in LAYOUTS[layout])
    norms = np.linalg.norm(want[None][0], axis=1)
    assert np.allclose(norms, 1, atol=1e-5) == normalize


def test_bf16_token_vectors(models):
    want = st_vectors(models["fixed"])
    _, got = served_vectors(models["fixed"], dtype="bfloat16")
    for task in want:
        for ours, theirs in zip(got[task], want[task], strict=True):
            assert cosine(ours, theirs).min() >= BF16_COSINE


def test_the_tokenizer_shows_a_querys_expansion(models):
    """The tokens view (TEI's /tokenize): the expansion tokens are special tokens, before a
    fixed query's own on Qwen's left-padding tokenizer, after a min query's."""
    for layout, first in (("fixed", True), ("min", False)):
        tok = TextTokenizer(models[layout], 8192)
        opts = EmbedOptions(prompt_name="query")
        (encoded,) = tok.encoded(QUERIES[:1], opts, offsets=True)
        (view,) = tok.tokens([encoded])
        assert len(view) == 16 == len(encoded.ids)
        expansion = view[:4] if first else view[-4:]
        assert all(t["special"] and t["start"] is None for t in expansion)
        text = [t for t in view if not t["special"]]
        assert "".join(t["text"] for t in text).endswith("capital of China?")


def test_what_it_cannot_read_is_refused(models, tmp_path):
    """An allowlist of token ids (an image page's patches), expansion tokens the encoder must
    not attend to, texts written through a chat template, a projection of every token without
    a MultiVectorMask and a ColBERT saved by PyLate: each named."""
    allowlist = shutil.copytree(models["plain"], tmp_path / "allowlist")
    (allowlist / "2_MultiVectorMask" / "config.json").write_text(
        json.dumps({"keep_only_token_ids": [151655]})
    )
    with pytest.raises(SentenceModulesError, match="keep_only_token_ids"):
        ModelConfig.from_dir(allowlist)
    classic = shutil.copytree(models["fixed"], tmp_path / "classic")
    config = json.loads((classic / "sentence_bert_config.json").read_text())
    config["query_expansion"]["attend"] = False
    (classic / "sentence_bert_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="attend false"):
        TextTokenizer(classic, 8192)
    chat = shutil.copytree(models["plain"], tmp_path / "chat")
    config = json.loads((chat / "sentence_bert_config.json").read_text())
    config["modality_config"] = {"message": {"method": "forward"}}
    (chat / "sentence_bert_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="chat template"):
        TextTokenizer(chat, 8192)
    unmasked = shutil.copytree(models["plain"], tmp_path / "unmasked")
    modules = json.loads((unmasked / "modules.json").read_text())
    modules = [m for m in modules if not m["type"].endswith("MultiVectorMask")]
    (unmasked / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(SentenceModulesError, match="no MultiVectorMask"):
        ModelConfig.from_dir(unmasked)
    # PyLate's own save: Transformer and its Dense alone, which must not pass for a pooled one
    pylate = shutil.copytree(models["plain"], tmp_path / "pylate")
    modules = json.loads((pylate / "modules.json").read_text())[:2]
    modules[1]["type"] = "pylate.models.Dense.Dense"
    (pylate / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(SentenceModulesError, match="PyLate"):
        ModelConfig.from_dir(pylate)


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    from qwen_embed_deploy.repository import render
    from qwen_embed_deploy.triton import TritonServer

    where = tmp_path_factory.mktemp("late-interaction-served")
    repo = render(where / "repo", {"embed": models["fixed"]}, {"encoder": {"dtype": "float32"}})
    with TritonServer(repo, log_path=where / "server.log") as server:
        yield server


@pytest.mark.server
def test_through_triton_and_the_gateway(models, served):
    """The client's embed_tokens with prompt_name query / document over HTTP and gRPC; vLLM's
    score API and the embed model's ranking on the gateway (MaxSim of the queries' and the
    documents' tasks, unless the request names a prompt), Jina's multi-vector API and its
    return_multivector; pooled vectors refused."""
    import httpx

    from qwen_embed_client import EmbeddingClient, EmbeddingError, maxsim_scores

    from triton_helpers import gateway_process

    want = st_vectors(models["fixed"])
    for protocol, url in (("http", served.http_url), ("grpc", served.grpc_url)):
        with EmbeddingClient(url, protocol=protocol) as client:
            for task, texts in (("query", QUERIES), ("document", DOCUMENTS)):
                got = client.embed_tokens(texts, prompt_name=task)
                for ours, theirs in zip(got, want[task], strict=True):
                    assert ours.shape == theirs.shape
                    assert np.abs(ours - theirs).max() <= FP32_ABS, (protocol, task)
            with pytest.raises(EmbeddingError, match="'per_token'"):
                client.embed(QUERIES)
    scores = maxsim_scores(want["query"][0], want["document"])
    assert np.ptp(scores) > 1e-2
    with gateway_process(served) as base:
        body = {"model": "embed", "text_1": QUERIES[0], "text_2": DOCUMENTS}
        scored = httpx.post(f"{base}/v1/score", json=body, timeout=60)
        assert scored.status_code == 200, scored.text
        got = np.array([d["score"] for d in scored.json()["data"]])
        assert np.abs(got - scores).max() <= 1e-4
        # a prompt named for the query: the documents as encode's, without a task
        named = httpx.post(f"{base}/v1/score", json=body | {"prompt_name": "query"}, timeout=60)
        untasked = maxsim_scores(want["query"][0], want[None])
        got = np.array([d["score"] for d in named.json()["data"]])
        assert np.abs(got - untasked).max() <= 1e-4 < np.abs(untasked - scores).max()
        body = {"model": "embed", "query": QUERIES[0], "documents": DOCUMENTS, "top_n": 2}
        ranked = httpx.post(f"{base}/v1/rerank", json=body, timeout=60)
        assert ranked.status_code == 200, ranked.text
        results = ranked.json()["results"]
        assert [r["index"] for r in results] == list(np.argsort(-scores, kind="stable")[:2])
        (entry,) = httpx.get(f"{base}/v1/models", timeout=60).json()["data"]
        assert entry["multi_vector"] is True
        # Jina's multi-vector API: input_type names the task; base64 a float32 string per token
        for input_type, texts in (("query", QUERIES), ("document", DOCUMENTS)):
            body = {"model": "embed", "input": [{"text": texts[0]}, *texts[1:]]}
            answer = httpx.post(
                f"{base}/v1/multi-vector", json=body | {"input_type": input_type}, timeout=60
            )
            assert answer.status_code == 200, answer.text
            reply = answer.json()
            assert reply["usage"]["total_tokens"] == sum(len(v) for v in want[input_type])
            for item, theirs in zip(reply["data"], want[input_type], strict=True):
                assert item["object"] == "embeddings"
                assert np.abs(np.array(item["embeddings"]) - theirs).max() <= FP32_ABS
        coded = httpx.post(
            f"{base}/v1/multi-vector",
            json={"input": QUERIES[0], "input_type": "query", "embedding_type": "base64"},
            timeout=60,
        ).json()["data"][0]["embeddings"]
        tokens = np.stack([np.frombuffer(base64.b64decode(t), "<f4") for t in coded])
        assert np.abs(tokens - want["query"][0]).max() <= FP32_ABS
        bad = httpx.post(
            f"{base}/v1/multi-vector", json={"input": "q", "embedding_type": "ubinary"}, timeout=60
        )
        assert bad.status_code == 400 and "embedding_type" in bad.json()["detail"], bad.text
        # Jina's v4 form: /v1/embeddings with return_multivector, its task naming the prompt
        body = {"input": QUERIES, "task": "retrieval.query", "return_multivector": True}
        answer = httpx.post(f"{base}/v1/embeddings", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        for item, theirs in zip(answer.json()["data"], want["query"], strict=True):
            assert np.abs(np.array(item["embeddings"]) - theirs).max() <= FP32_ABS
        for extra in ({"late_chunking": True}, {"embedding_type": "binary"}):
            refused = httpx.post(f"{base}/v1/embeddings", json=body | extra, timeout=60)
            assert refused.status_code == 400, refused.text
