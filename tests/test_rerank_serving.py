"""Reranking through a real tritonserver (the `rerank` ensemble over HTTP and gRPC), the client
library, the CLI, and the gateway's /v1/rerank started by the launcher (as `make serve` does).

One server for the module: the demo embedder and a tiny Qwen3-Reranker replica (real
tokenizer), both encoders in fp32. Scores must equal transformers' (Qwen3ForCausalLM full
logits, softmax over "no"/"yes" at the last position) within 1e-4.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from qwen_embed_client import EmbeddingClient
from qwen_embed_client.contract import DEFAULT_TASK
from qwen_embed_deploy.demo import build_demo_adapter
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.serving.config import DEMO_RERANKER_DIR
from qwen_embed_deploy.serving.rerank import TEXT_PAIRS
from qwen_embed_deploy.triton import TritonServer, free_port

from reference import (
    RERANKER_CONFIG,
    jina_rerank,
    model_card_pairs,
    mxbai_pairs,
    reference_scores,
)
from triton_helpers import http_status, infer, odd_bodies, run_clients, wait_for, wait_until

pytestmark = pytest.mark.server  # starts tritonserver or other processes

FP32_ABS = 1e-4
MXBAI = "mxbai=mxbai,mixedbread-ai/mxbai-rerank-base-v2"  # the gateway's names of mxbai
QUERY = "Which city is the capital of China?"
DOCUMENTS = [
    "The capital of China is Beijing.",
    "Gravity is a force that attracts two bodies towards each other. " * 8,
    "北京是中华人民共和国的首都。",
    "Paris",
    "naïve café — emoji 🎉",
    "def capital(country):\n    return 'Beijing'",
]


@pytest.fixture(scope="module")
def jina_adapter(jina, tmp_path_factory):
    """A LoRA of the jina-reranker-v3 replica (peft's files)."""
    return build_demo_adapter(tmp_path_factory.mktemp("jina-lora"), jina, rank=8, seed=3)


@pytest.fixture(scope="module")
def stack(demo_dir, reranker, mxbai, jina, jina_adapter, cross_encoders, tmp_path_factory):
    """(server, gateway base url) with the gateway started by the launcher; beside the
    Qwen3-Reranker replica, an mxbai-rerank-v2 one (the `mxbai` ensemble), a listwise
    jina-reranker-v3 one (`jina`, keeping a LoRA `ft` beside it) and a sentence-transformers
    CrossEncoder in zerank's form (`zerank`)."""
    where = tmp_path_factory.mktemp("rerank-triton")
    repo = render(
        where / "repo",
        {"embed": demo_dir},
        {"encoder": {"dtype": "float32"}, "jina.encoder": {"lora_modules": f"ft={jina_adapter}"}},
        rerankers={
            "rerank": reranker,
            "mxbai": mxbai,
            "jina": jina,
            "zerank": cross_encoders["zerank"],
        },
    )
    port = free_port()
    with TritonServer(
        repo,
        log_path=where / "server.log",
        # the embed model under a second name too, mxbai under its Hub id too: the launcher
        # passes them to the gateway
        launcher_args=["--gateway-port", str(port), "--served-model-name", "embed", "qwen3", MXBAI],
    ) as server:
        base = f"http://127.0.0.1:{port}"
        wait_for(f"{base}/health")
        yield server, base


@pytest.fixture(scope="module")
def expected(reranker):
    pairs = model_card_pairs(reranker, QUERY, DOCUMENTS, instruction=DEFAULT_TASK)
    return reference_scores(reranker, pairs), np.array([len(p) for p in pairs])


def rerank(server, query, documents, protocol="http", model="rerank", **params):
    """One request to a rerank ensemble; returns (SCORES [n], TOKEN_COUNT [n])."""
    module = httpclient if protocol == "http" else grpcclient
    url = server.http_url if protocol == "http" else server.grpc_url
    q = np.array([query if isinstance(query, bytes) else query.encode()], dtype=object)
    d = np.array([[x if isinstance(x, bytes) else x.encode()] for x in documents], dtype=object)
    inputs = [
        module.InferInput("QUERY", [1], "BYTES"),
        module.InferInput("DOCUMENTS", [len(documents), 1], "BYTES"),
    ]
    inputs[0].set_data_from_numpy(q)
    inputs[1].set_data_from_numpy(d.reshape(len(documents), 1))
    # Closed after the call: an open keep-alive connection holds tritonserver's shutdown for
    # its whole exit timeout.
    with module.InferenceServerClient(url) as client:
        result = client.infer(model, inputs, parameters=params or None)
    return result.as_numpy("SCORES").reshape(-1), result.as_numpy("TOKEN_COUNT").reshape(-1)


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_scores_equal_transformers(stack, expected, protocol):
    server, _ = stack
    scores, counts = rerank(server, QUERY, DOCUMENTS, protocol)
    want, want_counts = expected
    assert scores.dtype == np.float32 and scores.shape == (len(DOCUMENTS),)
    assert np.abs(scores - want).max() <= FP32_ABS
    assert counts.tolist() == want_counts.tolist()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_mxbai_scores_equal_transformers(stack, mxbai, protocol):
    """A second reranker of another family in the same server: its own template and answer
    tokens, its scores transformers' sigmoid("1" logit - "0" logit), with and without an
    instruction."""
    server, _ = stack
    for instruction in (None, "Find the capital city"):
        pairs = mxbai_pairs(mxbai, QUERY, DOCUMENTS, instruction=instruction)
        want = reference_scores(mxbai, pairs, answers=("1", "0"))
        params = {"instruction": instruction} if instruction else {}
        scores, counts = rerank(server, QUERY, DOCUMENTS, protocol, model="mxbai", **params)
        assert np.abs(scores - want).max() <= FP32_ABS
        assert counts.tolist() == [len(p) for p in pairs]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_cross_encoder_scores_equal_its_predict(stack, cross_encoders, protocol):
    """A reranker in sentence-transformers 6's CrossEncoder form (its chat template, one
    LogitScore row): scores and token counts as `CrossEncoder.predict` and `preprocess` make
    them, an instruction as its system message."""
    from sentence_transformers import CrossEncoder

    server, _ = stack
    model = CrossEncoder(str(cross_encoders["zerank"]), device="cpu")
    for instruction in (None, "Find the capital city"):
        pairs = [(QUERY, d) for d in DOCUMENTS]
        want = model.predict(pairs, prompt=instruction)
        ids = [model[0].preprocess([p], prompt=instruction)["input_ids"][0] for p in pairs]
        params = {"instruction": instruction} if instruction else {}
        scores, counts = rerank(server, QUERY, DOCUMENTS, protocol, model="zerank", **params)
        assert np.abs(scores - want).max() <= FP32_ABS
        assert counts.tolist() == [len(i) for i in ids]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_listwise_scores_equal_its_recipe(stack, jina, jina_adapter, protocol):
    """jina-reranker-v3 through the same ensemble: one row per document, each block's tokens
    counted on its first document's row; scores its own `rerank`'s, with an instruction too,
    and with a LoRA the request names (peft's forward of it), and a document past its cut
    without truncate refused for that request only."""
    server, _ = stack
    documents = [d * 40 for d in DOCUMENTS]  # several blocks (the replica's length is 2,800)
    for instruction, adapter in [(None, None), ("Prefer code", None), (None, jina_adapter)]:
        want, blocks = jina_rerank(jina, QUERY, documents, instruction, adapter)
        params = {"instruction": instruction} if instruction else {}
        params |= {"adapter": "ft"} if adapter else {}
        scores, counts = rerank(server, QUERY, documents, protocol, model="jina", **params)
        assert len(blocks) >= 2 and np.abs(scores - want).max() <= FP32_ABS
        assert [c for c in counts.tolist() if c] == [len(b) for b in blocks]
        assert counts.sum() == sum(len(b) for b in blocks)
    with pytest.raises(InferenceServerException, match=r"DOCUMENTS\[0\].*2048.*truncate"):
        rerank(server, QUERY, ["tea " * 2500], protocol, model="jina", truncate=False)
    scores, _ = rerank(server, QUERY, documents[:1], protocol, model="jina")
    assert abs(scores[0] - jina_rerank(jina, QUERY, documents[:1])[0][0]) <= FP32_ABS


@pytest.mark.parametrize("name, kind", [("jina", "cosine"), ("zerank", "logit")])
def test_gateway_answers_raw_scores_as_the_model_scores(stack, jina, cross_encoders, name, kind):
    """The encoder publishes what its scores are (fact `scores`): where a client asks for raw
    scores (NIM's logit, TEI's raw_scores, vLLM's use_activation false), a listwise
    reranker's cosines and a CrossEncoder's logits (zerank-2's) are answered as they are,
    not as log-odds of a probability."""
    from fastapi.testclient import TestClient
    from sentence_transformers import CrossEncoder

    from qwen_embed_client.gateway.app import create_app
    from qwen_embed_client.gateway.common import log_odds

    server, _ = stack
    if name == "jina":
        want = jina_rerank(jina, QUERY, DOCUMENTS)[0]
        # a listwise reranker reads every document beside the query; a pair alone differs
        alone = [jina_rerank(jina, QUERY, [d])[0][0] for d in DOCUMENTS[:2]]
    else:
        model = CrossEncoder(str(cross_encoders[name]), device="cpu")
        want = model.predict([(QUERY, d) for d in DOCUMENTS])
        alone = want[:2]
    with EmbeddingClient(server.grpc_url, rerank_model=name) as client:
        assert client.score_kind() == kind
    app = create_app([server.grpc_url], rerank_model_names=(name,), triton_rerank_model=name)
    with TestClient(app) as client:
        nim = client.post(
            "/v1/ranking",
            json={"query": {"text": QUERY}, "passages": [{"text": d} for d in DOCUMENTS]},
        ).json()["rankings"]
        tei = client.post(
            "/rerank", json={"query": QUERY, "texts": DOCUMENTS, "raw_scores": True}
        ).json()
        vllm = client.post(
            "/v1/rerank",
            json={"query": QUERY, "documents": DOCUMENTS, "use_activation": False},
        ).json()["results"]
        body = {"model": name, "text_1": QUERY, "text_2": DOCUMENTS}
        one = client.post("/v1/score", json=body).json()
        pairs = {"model": name, "text_1": [QUERY, QUERY], "text_2": DOCUMENTS[:2]}
        pairwise = client.post("/v1/score", json=pairs).json()
    # /score: one query reads every document with it; pairwise, each pair alone, as vLLM
    assert np.abs(np.array([d["score"] for d in one["data"]]) - want).max() <= FP32_ABS
    assert np.abs(np.array([d["score"] for d in pairwise["data"]]) - alone).max() <= FP32_ABS
    for got in (
        {r["index"]: r["logit"] for r in nim},
        {r["index"]: r["score"] for r in tei},
        {r["index"]: r["relevance_score"] for r in vllm},
    ):
        assert np.abs(np.array([got[i] for i in range(len(DOCUMENTS))]) - want).max() <= FP32_ABS
    assert all(abs(log_odds(w) - w) > 1e-2 for w in want)  # log-odds would not pass


def test_one_gateway_serves_each_reranker_by_its_name(stack):
    """The launcher's gateway serves every reranker of the repository: a body's `model` (a
    reranker's name, or a LoRA one of them keeps) picks it, on every rerank API; each answer is
    the one a gateway of that reranker alone gives (each checked against its reference above),
    and one naming none is the first reranker's."""
    from fastapi.testclient import TestClient

    from qwen_embed_client.gateway.app import create_app

    server, base = stack
    passages = [{"text": d} for d in DOCUMENTS]
    asked = [
        ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "use_activation": False}),
        ("/v2/rerank", {"query": QUERY, "documents": DOCUMENTS}),
        ("/v1/ranking", {"query": {"text": QUERY}, "passages": passages, "truncate": "END"}),
        ("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
    ]
    alias = "mixedbread-ai/mxbai-rerank-base-v2"  # mxbai's second name (MXBAI)
    for name, model, names in [
        ("mxbai", "mxbai", ("mxbai",)),
        ("mxbai", alias, ("mxbai", alias)),
        ("jina", "jina", ("jina",)),
        ("jina", "ft", ("jina",)),
        ("zerank", "zerank", ("zerank",)),
    ]:
        alone = create_app([server.grpc_url], rerank_model_names=names, triton_rerank_model=name)
        with TestClient(alone) as client:
            for path, body in asked:
                if model == "ft" and path == "/v1/score":
                    continue  # /v1/score takes no adapter
                body = body | {"model": model}
                want = client.post(path, json=body)
                status, got = post(f"{base}{path}", body)
                assert status == want.status_code == 200, (name, path, got)
                assert _same(_without_ids(got), _without_ids(want.json())), (name, path, got)
    status, got = post(f"{base}/v2/rerank", {"query": QUERY, "documents": DOCUMENTS})
    want = rerank(server, QUERY, DOCUMENTS)[0]
    scores = {r["index"]: r["relevance_score"] for r in got["results"]}
    assert (
        status == 200
        and np.abs(np.array([scores[i] for i in range(len(want))]) - want).max() <= FP32_ABS
    )


def _same(got, want, tolerance: float = 1e-6) -> bool:
    """Two answers alike, their numbers within `tolerance` (a forward's rounding may differ in
    its last bit with the requests it is batched with)."""
    if isinstance(want, float):
        return isinstance(got, float) and abs(got - want) <= tolerance
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(_same(got[k], want[k], tolerance) for k in want)
        )
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(_same(g, w, tolerance) for g, w in zip(got, want, strict=True))
        )
    return got == want


def _without_ids(answer: dict) -> dict:
    """An answer without what differs between two answers to the same request: its id and
    creation time."""
    return {k: v for k, v in answer.items() if k not in ("id", "created")}


def test_instruction_and_truncation_reach_the_tokenizer(stack, reranker):
    server, _ = stack
    scores, _ = rerank(server, QUERY, DOCUMENTS[:2], instruction="Find the capital city")
    pairs = model_card_pairs(reranker, QUERY, DOCUMENTS[:2], instruction="Find the capital city")
    assert np.abs(scores - reference_scores(reranker, pairs)).max() <= FP32_ABS
    long = ["word " * 9000]  # over the limit: 8192 tokens, capped at the replica's 2048 positions
    _, counts = rerank(server, QUERY, long)
    assert counts.tolist() == [RERANKER_CONFIG["max_position_embeddings"]]
    with pytest.raises(InferenceServerException, match=r"DOCUMENTS\[0\].*2048.*truncate"):
        rerank(server, QUERY, long, truncate=False)


def test_gateway_cohere_request(stack, expected):
    _, base = stack
    want, counts = expected
    docs = [d if i % 2 else {"text": d} for i, d in enumerate(DOCUMENTS)]  # both Cohere forms
    status, body = post(
        f"{base}/v1/rerank", {"model": "rerank", "query": QUERY, "documents": docs, "top_n": 3}
    )
    assert status == 200, body
    order = np.argsort(-want, kind="stable")[:3].tolist()
    assert [r["index"] for r in body["results"]] == order
    for r in body["results"]:
        assert abs(r["relevance_score"] - float(want[r["index"]])) <= FP32_ABS
        assert r["document"] == {"text": DOCUMENTS[r["index"]]}
    assert body["usage"]["total_tokens"] == int(counts.sum())
    assert body["model"] == "rerank"
    body = {"model": "rerank", "query": QUERY, "documents": DOCUMENTS, "return_documents": False}
    status, body = post(f"{base}/rerank", body)
    assert status == 200 and len(body["results"]) == len(DOCUMENTS)
    assert "document" not in body["results"][0]
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)
    status, body = post(f"{base}/v1/embeddings", {"model": "qwen3", "input": ["hello"]})
    assert status == 200 and len(body["data"][0]["embedding"]) == 1024
    assert body["model"] == "embed"  # the first served name answers
    with urllib.request.urlopen(f"{base}/v1/models") as r:
        models = json.loads(r.read())["data"]
    # the launcher's gateway serves every reranker of the repository: `rerank` first
    ids = ["embed", "qwen3", "rerank", "jina", "mxbai", "mixedbread-ai/mxbai-rerank-base-v2"]
    assert [m["id"] for m in models] == [*ids, "zerank"]
    assert models[0]["prompt_names"] == ["document", "query"]  # the demo embedder's


def test_vllm_score_api_on_the_reranker(stack, reranker, expected):
    """vLLM's /score with the reranker's name answers its relevance (what vLLM answers for a
    cross-encoder): one query against every text_2, or pairwise; its fields named."""
    _, base = stack
    want, counts = expected
    status, body = post(
        f"{base}/v1/score", {"model": "rerank", "text_1": QUERY, "text_2": DOCUMENTS}
    )
    assert status == 200, body
    assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    assert np.abs(np.array([d["score"] for d in body["data"]]) - want).max() <= FP32_ABS
    assert body["usage"]["prompt_tokens"] == int(counts.sum()) and body["model"] == "rerank"
    other = "Where is the Eiffel Tower?"
    pairs = {"model": "rerank", "text_1": [QUERY, other], "text_2": DOCUMENTS[:2]}
    status, body = post(f"{base}/score", pairs)
    assert status == 200, body
    ids = model_card_pairs(reranker, QUERY, DOCUMENTS[:1], instruction=DEFAULT_TASK)
    ids += model_card_pairs(reranker, other, DOCUMENTS[1:2], instruction=DEFAULT_TASK)
    got = np.array([d["score"] for d in body["data"]])
    assert np.abs(got - reference_scores(reranker, ids)).max() <= FP32_ABS
    status, body = post(f"{base}/v1/score", pairs | {"dimensions": 8})
    assert status == 400 and body["error"]["param"] == "dimensions", body
    long = pairs | {"text_1": [QUERY, "long query " * 3000]}
    status, body = post(f"{base}/v1/score", long)
    assert status == 400 and body["error"]["param"] == "text_1", body
    assert "'text_1[1]'" in body["error"]["message"], body


def test_client_library_splits_and_ranks(stack, expected):
    server, _ = stack
    want, counts = expected
    # Two "servers" (the same one twice) and 2 documents per request: several requests.
    with EmbeddingClient(
        [server.grpc_url, server.grpc_url.replace("127.0.0.1", "localhost")],
        max_texts_per_request=2,
    ) as client:
        result = client.rerank(QUERY, DOCUMENTS, top_n=4)
    assert np.abs(result.scores - want).max() <= FP32_ABS
    assert result.token_counts.tolist() == counts.tolist()
    assert [i for i, _ in result.ranking] == np.argsort(-want, kind="stable")[:4].tolist()
    with EmbeddingClient(server.grpc_url) as client, pytest.raises(ValueError, match="top_n"):
        client.rerank(QUERY, DOCUMENTS, top_n=0)


def test_cli_rerank(stack, expected, tmp_path):
    server, _ = stack
    want, _ = expected
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(d.replace("\n", " ") for d in DOCUMENTS[:3]) + "\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "qwen_embed_client.cli",
            "rerank",
            QUERY,
            str(path),
            "--url",
            server.grpc_url,
            "--top-n",
            "2",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = [json.loads(x) for x in out.splitlines()]
    assert [x["index"] for x in lines] == np.argsort(-want[:3], kind="stable")[:2].tolist()
    assert lines[0]["document"] == DOCUMENTS[lines[0]["index"]]


def test_embed_and_rerank_concurrently_without_cross_talk(stack):
    server, _ = stack
    texts = [f"embedding text number {i} " * (1 + i % 5) for i in range(16)]
    queries = [f"query {i}?" for i in range(16)]
    docs = [[f"document {i}.{j} " * (1 + j) for j in range(3)] for i in range(16)]
    alone_vectors = [infer(server, [t], "grpc")[0] for t in texts]
    alone_scores = [rerank(server, q, d, "grpc")[0] for q, d in zip(queries, docs, strict=True)]
    results = {}
    barrier = threading.Barrier(16)

    def client(i):
        barrier.wait()
        for k in range(2):  # 16 clients, each alternating embed and rerank
            j = (i + k * 8) % 16
            if (i + k) % 2:
                results[("embed", j, k)] = infer(server, [texts[j]], "grpc")[0]
            else:
                results[("rerank", j, k)] = rerank(server, queries[j], docs[j], "grpc")[0]

    run_clients(16, client)
    assert {kind for kind, _, _ in results} == {"embed", "rerank"} and len(results) == 32
    for (kind, j, _), value in results.items():
        alone = alone_vectors[j] if kind == "embed" else alone_scores[j]
        assert value.shape == alone.shape
        assert np.abs(value - alone).max() <= 1e-4, (kind, j)


VLLM_QUERY = f"{TEXT_PAIRS.prefix}<Instruct>: {DEFAULT_TASK}\n<Query>: {QUERY}\n"
VLLM_DOCUMENT = f"<Document>: {DOCUMENTS[0]}{TEXT_PAIRS.suffix}"
BAD = [
    # (query, documents, parameters, expected message)
    ("", ["doc"], {}, r"input 'QUERY\[0\]' is empty"),
    ("q", ["doc", "   "], {}, r"input 'DOCUMENTS\[1\]' is empty"),
    ("q", ["x"] * 257, {}, r"input 'DOCUMENTS' holds 257 texts, more than the limit of 256"),
    ("q", [b"ok", b"\xff\xfe bad"], {}, r"input 'DOCUMENTS\[1\]' is not valid UTF-8"),
    ("q", ["doc"], {"instruction": ""}, r"parameter 'instruction' must not be empty"),
    ("q", ["doc"], {"dimensions": 8}, r"unknown parameter\(s\) \['dimensions'\]"),
    ("q", ["doc"], {"truncate": "yes"}, r"parameter 'truncate' must be a boolean"),
    # a client's own formatting (vLLM's Qwen3-Reranker examples): it would be wrapped twice
    (VLLM_QUERY, ["doc"], {}, r"input 'QUERY' holds this reranker's prompt template"),
    ("q", ["doc", VLLM_DOCUMENT], {}, r"input 'DOCUMENTS\[1\]' holds this reranker's prompt"),
]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_input_is_invalid_arg_and_the_server_stays_correct(stack, expected, protocol):
    server, _ = stack
    for query, documents, params, message in BAD:
        with pytest.raises(InferenceServerException, match=message) as info:
            rerank(server, query, documents, protocol, **params)
        assert "INVALID_ARG" in str(info.value.status()) or "400" in str(info.value.status())
    scores, _ = rerank(server, QUERY, DOCUMENTS, protocol)
    assert np.abs(scores - expected[0]).max() <= FP32_ABS


def test_zero_documents_is_refused(stack):
    server, _ = stack
    q = httpclient.InferInput("QUERY", [1], "BYTES")
    q.set_data_from_numpy(np.array([b"q"], dtype=object))
    d = httpclient.InferInput("DOCUMENTS", [0, 1], "BYTES")
    d.set_data_from_numpy(np.zeros((0, 1), dtype=object))
    with httpclient.InferenceServerClient(server.http_url) as client:
        with pytest.raises(InferenceServerException, match="DOCUMENTS' must hold at least 1"):
            client.infer("rerank", [q, d])


GATEWAY_BAD = [
    ({"query": "", "documents": ["d"]}, 400, "query"),
    ({"query": "q", "documents": []}, 400, "documents"),
    ({"query": "q", "documents": ["d"] * 1001}, 400, "documents"),
    ({"query": "q", "documents": ["d", 3]}, 400, "documents"),
    ({"query": "q", "documents": [{"txt": "d"}]}, 400, "documents"),
    ({"query": "q", "documents": ["d\ud800"]}, 400, "documents"),
    ({"query": "q", "documents": ["d"], "top_n": -1}, 400, "top_n"),
    ({"query": "q", "documents": ["d"], "top_n": True}, 400, "top_n"),
    ({"query": "q", "documents": ["d"], "model": "Qwen3-Reranker-8B"}, 404, "model"),
    ({"query": "q", "documents": ["d" * 300000]}, 400, "documents"),  # Triton's byte limit
    ({"query": VLLM_QUERY, "documents": ["d"]}, 400, "query"),
    ({"query": "q", "documents": ["d", VLLM_DOCUMENT]}, 400, "documents"),
]


def test_gateway_bad_requests_get_4xx_naming_the_field(stack, expected):
    _, base = stack
    for body, status, param in GATEWAY_BAD:
        got, answer = post(f"{base}/v1/rerank", {"model": "rerank", **body})
        assert got == status, (body, answer)
        assert answer["error"]["param"] == param, (body, answer)
    status, body = post(
        f"{base}/v1/rerank", {"model": "rerank", "query": QUERY, "documents": DOCUMENTS}
    )
    assert status == 200
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert max(abs(got[i] - float(s)) for i, s in enumerate(expected[0])) <= FP32_ABS


def test_odd_bodies_get_a_4xx_never_a_5xx(stack, expected):
    """The rerank routes (OpenAI/Jina, TEI, Cohere, vLLM's score) with each field replaced by odd
    values, then seeded random bodies of nested ones (triton_helpers.odd_bodies): answered below
    500; the reranker scores as before."""
    _, base = stack
    routes = {
        "/v1/rerank": (
            {"model": "rerank", "query": "q", "documents": ["a", "b"]},
            ["query", "documents", "top_n", "return_documents", "instruction", "model"]
            + ["use_activation", "max_tokens_per_doc", "chat_template_kwargs"],
        ),
        "/rerank": ({"query": "q", "texts": ["a"]}, ["query", "texts", "raw_scores", "truncate"]),
        "/v2/rerank": (
            {"model": "rerank", "query": "q", "documents": ["a"]},
            ["query", "documents", "top_n", "max_tokens_per_doc"],
        ),
        "/v1/score": ({"model": "embed", "text_1": "a", "text_2": ["b"]}, ["text_1", "text_2"]),
        "/score": (  # the same route on the reranker
            {"model": "rerank", "text_1": ["a", "b"], "text_2": ["c", "d"]},
            ["text_1", "text_2", "dimensions"],
        ),
    }
    refused = 0
    for path, body in odd_bodies(routes, seed=1):
        status = http_status(base + path, body)
        assert status < 500, (path, body, status)
        refused += status >= 400
    assert refused > 100
    status, body = post(
        f"{base}/v1/rerank", {"model": "rerank", "query": QUERY, "documents": DOCUMENTS}
    )
    assert status == 200
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert max(abs(got[i] - float(s)) for i, s in enumerate(expected[0])) <= FP32_ABS


def test_make_serve_answers_embeddings_and_rerank_on_the_gateway(demo_dir, tmp_path):
    """What `make serve` runs on a fresh clone: the checked-in repository, the demo embedder
    and demo reranker, the gateway on its own port."""
    assert (DEMO_RERANKER_DIR / "config.json").is_file()  # built by `make setup`
    port = free_port()
    with TritonServer(
        log_path=tmp_path / "server.log",
        env={"QWEN_EMBED_MODEL_DIR": str(demo_dir)},
        launcher_args=["--gateway-port", str(port)],
    ):
        base = f"http://127.0.0.1:{port}"
        wait_for(f"{base}/health")
        status, body = post(f"{base}/v1/embeddings", {"model": "embed", "input": ["hi", "yo"]})
        assert status == 200 and len(body["data"]) == 2
        assert len(body["data"][0]["embedding"]) == 1024
        body = {"model": "rerank", "query": "capital?", "documents": ["Beijing.", "Gravity."]}
        status, body = post(f"{base}/v1/rerank", body)
        assert status == 200 and sorted(r["index"] for r in body["results"]) == [0, 1]
        assert all(0.0 <= r["relevance_score"] <= 1.0 for r in body["results"])


def test_make_serve_serves_several_checkpoints_by_name(demo_dir, tmp_path):
    """`make serve MODELS=... RERANKERS=...` as a user runs it: the checkpoints rendered and
    served in one step, the gateway answering each by its name (the demo embedder twice, the
    second under a Hub-style alias too) and the reranker where no model is named."""
    ports = {name: free_port() for name in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT")}
    ports["GATEWAY_PORT"] = free_port()
    variables = [f"{name}={port}" for name, port in ports.items()]
    variables += [
        f"MODELS=embed={demo_dir} small={demo_dir}",
        f"RERANKERS=rerank={DEMO_RERANKER_DIR}",
        "SERVED_MODEL_NAME=embed small=small,acme/small",
        f"BATCH_DIR={tmp_path / 'batches'}",
    ]
    with open(tmp_path / "serve.log", "wb") as log:
        make = subprocess.Popen(
            ["make", "serve", *variables],
            cwd=Path(__file__).resolve().parents[1],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        base = f"http://127.0.0.1:{ports['GATEWAY_PORT']}"
        wait_for(f"{base}/health", timeout=300)
        with urllib.request.urlopen(f"{base}/v1/models") as r:
            listed = [m["id"] for m in json.loads(r.read())["data"]]
        assert listed == ["embed", "small", "acme/small", "rerank"]
        vectors = {}
        for model in ("embed", "acme/small"):
            status, body = post(f"{base}/v1/embeddings", {"model": model, "input": ["hi", "yo"]})
            assert status == 200 and body["model"] == model.replace("acme/", "")
            vectors[model] = np.array([d["embedding"] for d in body["data"]])
        assert np.abs(vectors["embed"] - vectors["acme/small"]).max() <= 1e-6  # one checkpoint
        body = {"query": "capital?", "documents": ["Beijing.", "Gravity."]}
        status, body = post(f"{base}/v1/rerank", body)
        assert status == 200 and body["model"] == "rerank"
    finally:
        os.killpg(make.pid, signal.SIGTERM)  # make and the launcher: it drains, then exits
        make.wait(timeout=120)
        launcher = f"qwen_embed_deploy.launcher .*--http-port {ports['HTTP_PORT']} "
        wait_until(lambda: subprocess.run(["pgrep", "-f", launcher]).returncode, "its exit")
