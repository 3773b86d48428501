"""E2Rank (Alibaba-NLP/E2Rank): an embedding model that also reranks, served by one loaded
encoder. Its scores through the client library, the CLI and the gateway (`--rerank-recipe e2rank`,
what `make serve RERANK=e2rank` passes) against its README's transformers recipe on a replica
of its layout; what it does not read is refused."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from qwen_embed_client import EmbeddingClient, EmbeddingError
from qwen_embed_client.client import _pseudo_named
from qwen_embed_deploy.triton import TritonServer, free_port

import replicas
from triton_helpers import post_json, wait_for

pytestmark = pytest.mark.server

README_TASK = (
    "Given a web search query and some relevant documents, rerank the documents that answer "
    "the query:"
)
QUERY = "What is the capital of China?"
DOCUMENTS = [
    "The capital of China is Beijing.",
    "Gravity is a force that attracts two bodies towards each other. It gives weight to "
    "physical objects and is responsible for the movement of planets around the sun.",
    "北京是中华人民共和国的首都。",
    "Shanghai is the largest city in China by population.",
] + [f"Passage {i}: notes on topic number {i} of the survey." for i in range(20)]
FP32_ABS = 1e-4


@pytest.fixture(scope="module")
def e2rank_dir(tmp_path_factory):
    return replicas.e2rank(tmp_path_factory.mktemp("e2rank"))


@pytest.fixture(scope="module")
def stack(e2rank_dir, tmp_path_factory):
    port = free_port()
    env = {"QWEN_EMBED_MODEL_DIR": str(e2rank_dir), "QWEN_EMBED_ENCODER_SETTINGS": "dtype=float32"}
    with TritonServer(
        env=env,
        log_path=tmp_path_factory.mktemp("e2rank-server") / "server.log",
        launcher_args=["--rerank-recipe", "e2rank", "--gateway-port", str(port)],
    ) as server:
        base = f"http://127.0.0.1:{port}"
        wait_for(f"{base}/health")
        yield server, base


def readme_scores(model_dir, query, documents, task=README_TASK):
    """E2Rank's README, "Reranking", transformers usage: (scores, tokens per text with the
    pseudo query first)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    documents = [doc + "<|endoftext|>" for doc in documents]
    listed = "\n".join([f"[{i}] {doc}" for i, doc in enumerate(documents[:20], start=1)])
    messages = [{"role": "user", "content": f"{task}\nDocuments:\n{listed}Search Query:{query}"}]
    pseudo_query = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    batch = tokenizer(
        [pseudo_query, *documents],
        padding=True,
        truncation=True,
        max_length=8192,
        return_tensors="pt",
    )
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    embeddings = F.normalize(hidden[:, -1], p=2, dim=1)  # left padding: the last token
    scores = (embeddings[1:] @ embeddings[0]).numpy()
    return scores, batch["attention_mask"].sum(dim=1).numpy()


def test_scores_equal_its_readme_recipe(stack, e2rank_dir):
    server, _ = stack
    want, tokens = readme_scores(e2rank_dir, QUERY, DOCUMENTS)
    with EmbeddingClient(server.grpc_url, rerank_model="embed") as client:
        got = client.rerank(QUERY, DOCUMENTS)
        assert np.abs(got.scores - want).max() <= FP32_ABS
        # the pseudo query's tokens are counted on the first document
        assert got.total_tokens == int(tokens.sum())
        assert got.token_counts[1:].tolist() == tokens[2:].tolist()
        assert client.score_kind() == "cosine"
        task = "Rank the passages by how well they name a capital city:"
        want_task, _ = readme_scores(e2rank_dir, QUERY, DOCUMENTS[:6], task=task)
        got = client.rerank(QUERY, DOCUMENTS[:6], instruction=task, top_n=2)
        assert np.abs(got.scores - want_task).max() <= FP32_ABS
        assert [i for i, _ in got.ranking] == np.argsort(-want_task)[:2].tolist()
    # Documents split over requests meet the one pseudo query of the first 20.
    with EmbeddingClient(server.grpc_url, rerank_model="embed", max_texts_per_request=5) as c:
        assert np.abs(c.rerank(QUERY, DOCUMENTS).scores - want).max() <= FP32_ABS


def test_the_gateways_rerank_routes_use_the_embed_model(stack, e2rank_dir):
    _, base = stack
    want, tokens = readme_scores(e2rank_dir, QUERY, DOCUMENTS[:5])
    body = {"model": "rerank", "query": QUERY, "documents": DOCUMENTS[:5], "top_n": 3}
    status, answer, _ = post_json(f"{base}/v1/rerank", body)
    assert status == 200, answer
    assert [r["index"] for r in answer["results"]] == np.argsort(-want)[:3].tolist()
    for r in answer["results"]:
        assert abs(r["relevance_score"] - float(want[r["index"]])) <= FP32_ABS
    assert answer["usage"]["total_tokens"] == int(tokens.sum())
    status, answer, _ = post_json(
        f"{base}/v2/rerank", {"model": "rerank", "query": QUERY, "documents": DOCUMENTS[:5]}
    )
    assert status == 200, answer
    got = {r["index"]: r["relevance_score"] for r in answer["results"]}
    assert max(abs(got[i] - float(s)) for i, s in enumerate(want)) <= FP32_ABS
    # what it does not read: a 400 naming it, and the embed route unchanged beside it
    body = {"model": "rerank", "query": QUERY, "documents": DOCUMENTS[:2], "max_tokens_per_doc": 8}
    status, answer, _ = post_json(f"{base}/v2/rerank", body)
    assert status == 400 and "max_tokens_per_doc" in answer["message"], answer
    status, answer, _ = post_json(f"{base}/v1/embeddings", {"model": "embed", "input": ["a"]})
    assert status == 200 and len(answer["data"][0]["embedding"]) == 64


def test_the_cli_reranks_on_the_embed_model(stack, e2rank_dir, tmp_path):
    server, _ = stack
    want, _ = readme_scores(e2rank_dir, QUERY, DOCUMENTS[:5])
    documents = tmp_path / "documents.txt"
    documents.write_text("\n".join(DOCUMENTS[:5]) + "\n", encoding="utf-8")
    command = [sys.executable, "-m", "qwen_embed_client", "rerank", QUERY, str(documents)]
    command += ["--rerank-model", "embed", "--url", server.grpc_url]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    got = {row["index"]: row["relevance_score"] for row in map(json.loads, run.stdout.splitlines())}
    assert max(abs(got[i] - float(w)) for i, w in enumerate(want)) <= FP32_ABS


def test_refused_where_its_recipe_does_not_hold(stack):
    """(The launcher's refusal of the recipe on a tokenizer that appends <|endoftext|> is
    among test_production's one-line errors.)"""
    server, _ = stack
    with EmbeddingClient(server.grpc_url, rerank_model="embed") as client:
        with pytest.raises(EmbeddingError, match="query_images"):
            client.rerank(QUERY, DOCUMENTS[:2], query_images=[b"png"])


def test_an_error_names_the_callers_inputs():
    said = "input 'TEXT[0]' is too long; input 'TEXT[3]' too"
    assert _pseudo_named(said) == (
        "input 'QUERY' (with the documents it reads) is too long; input 'DOCUMENTS[2]' too"
    )
