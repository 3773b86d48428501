"""The gateway as a drop-in for the clients retrieval stacks already use: TEI's API through
`huggingface_hub.InferenceClient` and LlamaIndex's TEI integration, Cohere's v2 API through the
`cohere` SDK, NVIDIA NIM's API through LangChain's NVIDIAEmbeddings and NVIDIARerank, Voyage
AI's through the `voyageai` SDK, Mixedbread's through the `mixedbread` SDK, LiteLLM's providers
for all of these and Infinity's, OpenAI token-id inputs through the `openai` SDK, the per-text
token extensions and the model fingerprint. A real tritonserver serves the demo embedder (fp32)
and the demo reranker; the gateway runs as its own process with an API key, as in production.

Every vector a drop-in route gives must equal the OpenAI route's for the same text and options
within 1e-6 (the same Triton request underneath); scores equal the client library's.
"""

import asyncio
import base64
import http.client
import json
import math
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import cohere
import httpx
import litellm
import numpy as np
import ollama
import openai
import pytest
import torch
import voyageai
from google import genai
from google.genai import errors as genai_errors
from google.genai import types as genai_types
from huggingface_hub import InferenceClient
from langchain_core.documents import Document
from langchain_google_genai import GoogleGenerativeAIEmbeddings
from langchain_nvidia_ai_endpoints import NVIDIAEmbeddings, NVIDIARerank
from langchain_ollama import OllamaEmbeddings
from langchain_openai import AzureOpenAIEmbeddings, OpenAIEmbeddings
from langchain_voyageai import VoyageAIRerank
from llama_index.embeddings.jinaai import JinaEmbedding
from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference
from mixedbread import BadRequestError as MixedbreadBadRequest
from mixedbread import Mixedbread
from transformers import Qwen3Model
from tritonclient.utils import InferenceServerException

from qwen_embed_client import EmbeddingClient, maxsim_scores
from qwen_embed_client.gateway.common import TASK_INSTRUCTIONS, log_odds
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.triton import TritonServer

from reference import cosine
from triton_helpers import gateway_process, infer, post_json, send_json

pytestmark = pytest.mark.server  # starts tritonserver or other processes

API_KEY = "drop-in-key"
TLS = Path(__file__).parent / "tls"  # a self-signed certificate for 127.0.0.1, and its key
SAME = 1e-6  # one Triton request underneath every route
EOS = 151643  # the <|endoftext|> Qwen3-Embedding's tokenizer closes a text with
TOKENS_PER_TEXT = 96  # small, so that truncation is cheap to reach (the reranker's template fits)
ALIAS = "Qwen/Qwen3-Embedding-0.6B"  # a second served name of the embed model
TEXTS = ["Hello, world!", "北京是中华人民共和国的首都。", "naïve café — emoji 🎉"]
# one document's sentences, for late chunking
SENTENCES = ["Paris is the capital of France.", "Its tower is made of iron.", "Ünïcode ok"]


@pytest.fixture(scope="module")
def stack(demo_dir, reranker, tmp_path_factory):
    """(server, gateway base URL)."""
    where = tmp_path_factory.mktemp("drop-in")
    overrides = {
        "encoder": {"dtype": "float32"},
        "tokenizer": {"max_input_tokens": str(TOKENS_PER_TEXT)},
    }
    repo = render(where / "repo", {"embed": demo_dir}, overrides, rerankers={"rerank": reranker})
    with TritonServer(repo, log_path=where / "server.log") as server:
        names = ["--served-model-name", "embed", ALIAS]
        with gateway_process(server, "--api-key", API_KEY, *names) as base:
            yield server, base


def post(base: str, path: str, body: dict, key: str = API_KEY) -> tuple[int, object, dict]:
    """(status, JSON body or None, headers)."""
    return post_json(f"{base}{path}", body, {"Authorization": f"Bearer {key}"}, timeout=120)


def openai_vectors(base: str, texts, **extra) -> np.ndarray:
    api = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY)
    response = api.embeddings.create(
        input=texts, model="embed", encoding_format="float", extra_body=extra or None
    )
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def test_tei_clients_get_the_openai_routes_vectors(stack):
    """huggingface_hub's feature_extraction (TEI's POST /) and LlamaIndex's TEI embedding
    (POST /embed), unchanged but for the URL, with TEI's options."""
    _, base = stack
    hub = InferenceClient(model=base, token=API_KEY)
    expected = openai_vectors(base, TEXTS)
    assert np.abs(hub.feature_extraction(TEXTS) - expected).max() <= SAME
    got = hub.feature_extraction(TEXTS[0], prompt_name="query", dimensions=32)
    assert (
        np.abs(got - openai_vectors(base, TEXTS[:1], prompt_name="query", dimensions=32)).max()
        <= SAME
    )
    raw = hub.feature_extraction(TEXTS[1], normalize=False)
    assert np.abs(raw - openai_vectors(base, TEXTS[1:2], normalize=False)).max() <= SAME
    assert np.linalg.norm(raw) > 1.5  # really not normalised
    llama = TextEmbeddingsInference(base_url=base, model_name="embed", auth_token=API_KEY)
    got = np.array(llama.get_text_embedding_batch(TEXTS), dtype=np.float32)
    assert np.abs(got - expected).max() <= SAME


def test_tei_sentence_similarity_is_the_cosine_of_the_vectors(stack):
    """huggingface_hub's sentence_similarity (TEI's body, posted to /) and POST /similarity with
    TEI's parameters: each sentence's cosine with the source, from the OpenAI route's vectors
    of the same texts (those equal sentence-transformers': test_checkpoints.py)."""
    _, base = stack
    hub = InferenceClient(model=base, token=API_KEY)
    vectors = openai_vectors(base, TEXTS).astype(np.float64)
    got = np.array(hub.sentence_similarity(TEXTS[0], other_sentences=TEXTS[1:]))
    assert np.abs(got - vectors[1:] @ vectors[0]).max() <= SAME
    assert got.max() - got.min() > 1e-3  # the sentences really differ
    body = {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}}
    status, answer, _ = post(base, "/similarity", body | {"parameters": {"prompt_name": "query"}})
    queries = openai_vectors(base, TEXTS, prompt_name="query").astype(np.float64)
    assert status == 200 and np.abs(np.array(answer) - queries[1:] @ queries[0]).max() <= SAME
    assert np.abs(np.array(answer) - got).max() > 1e-4  # the prompt was applied


def test_served_model_names_are_aliases_of_one_model(stack):
    """--served-model-name embed ALIAS: /v1/models lists both, the OpenAI and Cohere routes take
    either and answer the same vectors under the first name; another name is refused, the
    served ones named."""
    _, base = stack
    api = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY)
    models = api.models.list().data
    listed = [m.id for m in models]
    assert listed[:2] == ["embed", ALIAS] and "rerank" in listed
    # a text's most tokens, under vLLM's name (the tokenizer's max_input_tokens here)
    assert [m.max_model_len for m in models[:2]] == [TOKENS_PER_TEXT] * 2
    for name in listed:  # one model's entry, as listed (the alias holds a "/")
        assert api.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError, match=f"'embed' or '{ALIAS}' or 'rerank'"):
        api.models.retrieve("Qwen3-Embedding-8B")
    by_alias = api.embeddings.create(input=TEXTS, model=ALIAS)
    assert by_alias.model == "embed"
    got = np.array([d.embedding for d in by_alias.data], dtype=np.float32)
    assert np.abs(got - openai_vectors(base, TEXTS)).max() <= SAME
    co = cohere.ClientV2(base_url=base, api_key=API_KEY)
    answer = co.embed(
        model=ALIAS, texts=TEXTS[:1], input_type="search_document", embedding_types=["float"]
    )
    assert len(answer.embeddings.float_[0]) == got.shape[1]
    with pytest.raises(openai.NotFoundError, match=f"'embed' or '{ALIAS}'"):
        api.embeddings.create(input=TEXTS, model="Qwen3-Embedding-8B")


def test_tei_rerank_tokenize_decode_and_info(stack):
    server, base = stack
    query, documents = "Which city is the capital of China?", TEXTS
    with EmbeddingClient(server.grpc_url) as client:
        want = client.rerank(query, documents)
        tokens = client.tokenize(TEXTS, prompt_name="query")
        plain = client.embed_with_usage(TEXTS, prompt_name="query")
    status, ranks, _ = post(
        base, "/rerank", {"query": query, "texts": documents, "return_text": True}
    )
    assert status == 200
    assert [r["index"] for r in ranks] == [i for i, _ in want.ranking]
    assert all(abs(r["score"] - s) <= SAME for r, (_, s) in zip(ranks, want.ranking, strict=True))
    assert [r["text"] for r in ranks] == [documents[r["index"]] for r in ranks]
    _, raw, _ = post(base, "/rerank", {"query": query, "texts": documents, "raw_scores": True})
    for r, (_, s) in zip(raw, want.ranking, strict=True):
        assert abs(r["score"] - math.log(s / (1 - s))) <= 1e-4 and "text" not in r
    # the Jina/Cohere v1 shape on the same path, told apart by `documents`
    status, answer, _ = post(
        base, "/rerank", {"model": "rerank", "query": query, "documents": documents}
    )
    assert status == 200 and answer["results"][0]["index"] == want.ranking[0][0]

    status, got, _ = post(base, "/tokenize", {"inputs": TEXTS, "prompt_name": "query"})
    assert status == 200 and got == tokens
    assert [len(t) for t in got] == plain.token_counts.tolist()  # what the encoder receives
    prompted = (
        "Instruct: Given a web search query, retrieve relevant passages that answer "
        "the query\nQuery:" + TEXTS[2]
    ).encode()
    for token in got[2]:  # TEI's byte offsets into the prompted text
        if not token["special"]:
            assert prompted[token["start"] : token["stop"]].decode() == token["text"]
    assert got[2][-1] == {
        "id": 151643,
        "text": "<|endoftext|>",
        "special": True,
        "start": None,
        "stop": None,
    }
    _, bare, _ = post(base, "/tokenize", {"inputs": TEXTS[0], "add_special_tokens": False})
    assert [t["id"] for t in bare[0]] == [9707, 11, 1879, 0]  # the real Qwen vocabulary's ids
    ids = [t["id"] for t in got[0]]
    _, decoded, _ = post(base, "/decode", {"ids": ids})
    assert decoded == [prompted.decode().replace(TEXTS[2], TEXTS[0])]
    _, kept, _ = post(base, "/decode", {"ids": [ids], "skip_special_tokens": False})
    assert kept == [decoded[0] + "<|endoftext|>"]
    # more inputs than one tokenizer request takes (its max_batch_size): several, in order
    many = [f"{i} {TEXTS[i % len(TEXTS)]}" for i in range(300)]
    status, got, _ = post(base, "/tokenize", {"inputs": many})
    assert status == 200 and len(got) == 300, got
    assert got[299][0]["text"] == "2"
    status, texts, _ = post(base, "/decode", {"ids": [[t["id"] for t in g] for g in got]})
    assert status == 200 and texts == many

    status, info, _ = urllib_get(base, "/info")
    assert status == 200
    assert info["max_input_length"] == TOKENS_PER_TEXT and info["model_dtype"] == "float32"
    assert info["model_type"] == {"embedding": {"pooling": "last_token"}}
    assert info["dimension"] == 1024 and info["prompt_names"] == ["document", "query"]


def urllib_get(base: str, path: str):
    request = urllib.request.Request(
        f"{base}{path}", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return r.status, json.loads(r.read()), dict(r.headers)


def test_tei_errors_have_teis_statuses_and_body(stack):
    _, base = stack
    for path, body, status, error_type in [
        ("/embed", {"inputs": []}, 400, "Empty"),
        ("/embed", {"inputs": "x", "dimensions": 0}, 422, "Validation"),
        ("/embed", {"inputs": ["x", [1, 2]]}, 422, "Validation"),  # texts and ids mixed
        ("/embed", {"inputs": "x", "prompt_name": "passage"}, 422, "Validation"),  # the server's
        ("/embed", {"inputs": [[1, 99999999]]}, 422, "Validation"),  # an id past the vocabulary
        ("/embed", {"inputs": "long " * 200, "truncate": False}, 422, "Validation"),
        ("/predict", {"inputs": "x"}, 424, "Backend"),  # an embedder: TEI's "not a classifier"
        ("/", {"inputs": "x", "normalize": "yes"}, 422, "Validation"),
        ("/rerank", {"query": "q", "texts": []}, 400, "Empty"),
        ("/similarity", {"inputs": {"source_sentence": "q", "sentences": []}}, 400, "Empty"),
        ("/similarity", {"inputs": {"sentences": ["a"]}}, 422, "Validation"),
        ("/", {"inputs": {"source_sentence": "q", "sentences": [1]}}, 422, "Validation"),
        (
            "/rerank",
            {"query": "q", "texts": ["a"], "truncation_direction": "Left"},
            422,
            "Validation",
        ),
        ("/tokenize", {"inputs": [1, 2]}, 422, "Validation"),
        ("/decode", {"ids": "abc"}, 422, "Validation"),
        ("/decode", {"ids": [1, 2**40]}, 422, "Validation"),
    ]:
        got, answer, _ = post(base, path, body)
        assert (got, answer["error_type"]) == (status, error_type), (path, body, answer)
        assert set(answer) == {"error", "error_type"} and answer["error"]
    assert post(base, "/embed", {"inputs": "x"}, key="wrong")[0] == 401


def test_a_refused_input_is_named_as_the_body_names_it(stack):
    """Each API names a refused text by its own field and its index in the body, also past
    the first Triton request of a split one (256 texts each), and a body without `model`
    asks the served one."""
    _, base = stack
    texts = [f"t{i}" for i in range(300)]
    bad = texts[:260] + [" "] + texts[261:]
    for path, body, field in [
        ("/v1/embeddings", {"model": "embed", "input": bad}, "input[260]"),
        ("/v1/embeddings", {"input": [[7, EOS]] * 270 + [[-1, EOS]]}, "input[270]"),
        ("/embed", {"inputs": bad}, "inputs[260]"),
        ("/tokenize", {"inputs": bad}, "inputs[260]"),
        (
            "/similarity",
            {"inputs": {"source_sentence": "q", "sentences": ["a", ""]}},
            "inputs.sentences[1]",
        ),
        ("/v2/embed", {"model": "embed", "texts": bad}, "texts[260]"),
        ("/v1/score", {"model": "embed", "text_1": "q", "text_2": ["a", ""]}, "text_2[1]"),
        ("/v1/rerank", {"query": "q", "documents": bad}, "documents[260]"),
        ("/rerank", {"query": "q", "texts": bad}, "texts[260]"),
        ("/v2/rerank", {"model": "rerank", "query": "q", "documents": bad}, "documents[260]"),
    ]:
        status, answer, _ = post(base, path, body)
        assert status in (400, 422), (path, answer)
        error = answer.get("error", answer.get("message"))
        message = error["message"] if isinstance(error, dict) else error
        assert f"'{field}'" in message and "ensemble" not in message, (path, message)
        if path.startswith("/v1/"):
            assert error["param"] == field.split("[")[0], (path, error)
    status, answer, _ = post(base, "/v1/embeddings", {"input": "x", "dimensions": 8})
    assert status == 200 and answer["model"] == "embed" and len(answer["data"][0]["embedding"]) == 8


def test_cohere_sdk_embed_maps_input_types_to_the_checkpoints_prompts(stack):
    server, base = stack
    co = cohere.ClientV2(base_url=base, api_key=API_KEY)
    kinds = ["float", "int8", "ubinary", "base64"]
    before = server.metric("qwen_embed_texts_total", model="encoder")
    response = co.embed(
        model="embed",
        texts=TEXTS,
        input_type="search_query",
        embedding_types=kinds,
        output_dimension=64,
    )
    # every type from one computation of the vectors
    assert server.metric("qwen_embed_texts_total", model="encoder") - before == len(TEXTS)
    expected = openai_vectors(base, TEXTS, prompt_name="query", dimensions=64)
    assert np.abs(np.array(response.embeddings.float_) - expected).max() <= SAME
    for kind in ("int8", "ubinary"):
        want = post(
            base,
            "/v1/embeddings",
            {
                "model": "embed",
                "input": TEXTS,
                "prompt_name": "query",
                "dimensions": 64,
                "embedding_type": kind,
            },
        )[1]
        assert getattr(response.embeddings, kind) == [d["embedding"] for d in want["data"]]
    decoded = [np.frombuffer(base64.b64decode(b), "<f4") for b in response.embeddings.base64]
    assert np.abs(np.stack(decoded) - expected).max() <= SAME
    assert response.texts == TEXTS and response.meta.billed_units.input_tokens > 0
    assert response.text_tokens[0] == {"tokens": 24, "input_tokens": 24, "truncated": False}
    for input_type, options in [
        ("search_document", {"prompt_name": "document"}),
        ("classification", {"instruction": "Classify the given text"}),
        ("clustering", {"instruction": "Identify the topic or theme of the given text"}),
    ]:
        got = co.embed(
            model="embed", texts=TEXTS[:1], input_type=input_type, embedding_types=["float"]
        )
        assert (
            np.abs(
                np.array(got.embeddings.float_) - openai_vectors(base, TEXTS[:1], **options)
            ).max()
            <= SAME
        )
    inputs = [{"content": [{"type": "text", "text": TEXTS[0]}]}]
    got = co.embed(
        model="embed", inputs=inputs, input_type="search_document", embedding_types=["float"]
    )
    assert (
        np.abs(
            np.array(got.embeddings.float_)
            - openai_vectors(base, TEXTS[:1], prompt_name="document")
        ).max()
        <= SAME
    )


def test_cohere_v1_client_embed(stack):
    """Cohere's v1 `Client.embed`: a list of float vectors, or by type when asked."""
    _, base = stack
    co = cohere.Client(base_url=base, api_key=API_KEY)
    floats = co.embed(texts=TEXTS, model="embed", input_type="search_query")
    assert floats.response_type == "embeddings_floats"
    expected = openai_vectors(base, TEXTS, prompt_name="query")
    assert np.abs(np.array(floats.embeddings) - expected).max() <= SAME
    typed = co.embed(texts=TEXTS, model="embed", embedding_types=["int8", "float"])
    assert typed.response_type == "embeddings_by_type"
    assert np.abs(np.array(typed.embeddings.float_) - openai_vectors(base, TEXTS)).max() <= SAME
    assert np.array(typed.embeddings.int8).shape == expected.shape
    with pytest.raises(cohere.core.ApiError) as e:
        co.embed(texts=["word " * 300], model="embed", truncate="NONE")
    assert e.value.status_code == 400 and "texts[0]" in e.value.body["message"]


def test_cohere_sdk_rerank_and_errors(stack):
    server, base = stack
    co = cohere.ClientV2(base_url=base, api_key=API_KEY)
    query = "Which city is the capital of China?"
    with EmbeddingClient(server.grpc_url) as client:
        want = client.rerank(query, TEXTS, top_n=2)
        short = client.rerank(query, TEXTS, max_document_tokens=2)
    got = co.rerank(model="rerank", query=query, documents=TEXTS, top_n=2)
    assert [(r.index, round(r.relevance_score, 6)) for r in got.results] == [
        (i, round(s, 6)) for i, s in want.ranking
    ]
    cut = co.rerank(model="rerank", query=query, documents=TEXTS, max_tokens_per_doc=2)
    assert [r.relevance_score for r in cut.results] == pytest.approx(
        [s for _, s in short.ranking], abs=SAME
    )
    assert not np.allclose(short.scores, want.scores)  # the cap changed what was scored
    with pytest.raises(cohere.errors.BadRequestError, match="input_type must be one of"):
        co.embed(model="embed", texts=["x"], input_type="poem", embedding_types=["float"])
    with pytest.raises(cohere.errors.NotFoundError):
        co.embed(model="embed-v4.0", texts=["x"], input_type="search_query")
    with pytest.raises(cohere.errors.UnauthorizedError):
        cohere.ClientV2(base_url=base, api_key="wrong").rerank(
            model="rerank", query="q", documents=["d"]
        )
    for path, body, field in [
        ("/v2/embed", {"model": "embed", "texts": []}, "texts cannot be empty"),
        ("/v2/embed", {"model": "embed", "texts": ["x"], "truncate": "MIDDLE"}, "truncate"),
        (
            "/v2/embed",
            {"model": "embed", "texts": ["x"], "embedding_types": ["int4"]},
            "embedding_types",
        ),
        (
            "/v2/embed",
            {"model": "embed", "texts": ["x"], "output_dimension": 4096},
            "'output_dimension' must be in 1..1024",  # the server's check, in Cohere's words
        ),
        (
            "/v2/rerank",
            {"model": "rerank", "query": "q", "documents": ["d"], "max_tokens_per_doc": 0},
            "'max_tokens_per_doc' must be >= 1",
        ),
        (
            "/v2/embed",
            {"model": "embed", "texts": ["long " * 200], "truncate": "NONE"},
            "limit of 96",
        ),
        (
            "/v2/embed",
            {"model": "embed", "inputs": [{"content": [{"type": "image_url"}]}]},
            "inputs[0].content[0].image_url is required",
        ),
        ("/v2/rerank", {"model": "rerank", "query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
        ("/v2/rerank", {"model": "rerank", "query": "", "documents": ["d"]}, "query"),
    ]:
        status, answer, _ = post(base, path, body)
        assert status == 400 and field in answer["message"] and answer["id"], (body, answer)


def raw_vectors(base: str, texts, **fields) -> np.ndarray:
    """The OpenAI route's vectors (or codes) as JSON numbers, with extension fields."""
    body = {"input": texts, "model": "embed", "encoding_format": "float", **fields}
    status, answer, _ = post(base, "/v1/embeddings", body)
    assert status == 200, answer
    return np.array([d["embedding"] for d in answer["data"]])


def test_voyage_sdk_gets_the_openai_routes_vectors_codes_and_ranking(stack):
    """Voyage AI's `voyageai` SDK, unchanged but for its base URL: its input types pick the
    checkpoint's prompts, its output dimension and types are the route's `dimensions` and
    embedding types (its base64 decoded as the type it asked for), its rerank the reranker's
    ranking in Voyage's shape; refusals reach it as its InvalidRequestError, in its words."""
    server, base = stack
    vo = voyageai.Client(api_key=API_KEY, base_url=f"{base}/v1")
    answer = vo.embed(TEXTS, model="embed")
    assert np.abs(np.array(answer.embeddings) - openai_vectors(base, TEXTS)).max() <= SAME
    _, plain, _ = post(base, "/v1/embeddings", {"input": TEXTS, "model": "embed"})
    assert answer.total_tokens == plain["usage"]["total_tokens"] > len(TEXTS)
    for input_type in ("query", "document"):
        got = np.array(vo.embed(TEXTS, model=ALIAS, input_type=input_type).embeddings)
        want = openai_vectors(base, TEXTS, prompt_name=input_type)
        assert np.abs(got - want).max() <= SAME, input_type
    query = np.array(vo.embed(TEXTS[:1], model="embed", input_type="query").embeddings)
    assert np.abs(query - openai_vectors(base, TEXTS[:1])).max() > 1e-3  # the prompt applied
    short = np.array(vo.embed(TEXTS, model="embed", output_dimension=32).embeddings)
    assert np.abs(short - openai_vectors(base, TEXTS, dimensions=32)).max() <= SAME
    for kind in ("int8", "uint8", "binary", "ubinary"):
        got = vo.embed(TEXTS, model="embed", output_dtype=kind, output_dimension=64)
        want = raw_vectors(base, TEXTS, embedding_type=kind, dimensions=64)
        assert np.array_equal(np.array(got.embeddings), want), kind
    long = ["long " * 200]
    with pytest.raises(voyageai.error.InvalidRequestError, match="limit of 96"):
        vo.embed(long, model="embed", truncation=False)
    assert vo.embed(long, model="embed").total_tokens == TOKENS_PER_TEXT  # cut, as Voyage's
    with pytest.raises(voyageai.error.InvalidRequestError, match="'output_dimension' must be"):
        vo.embed(TEXTS, model="embed", output_dimension=4096)

    query = "Which city is the capital of China?"
    with EmbeddingClient(server.grpc_url) as client:
        want = client.rerank(query, TEXTS, top_n=2)
    ranked = vo.rerank(query, TEXTS, model="rerank", top_k=2)
    assert [(r.index, r.document) for r in ranked.results] == [
        (i, TEXTS[i]) for i, _ in want.ranking
    ]
    assert [r.relevance_score for r in ranked.results] == pytest.approx(
        [s for _, s in want.ranking], abs=SAME
    )
    assert ranked.total_tokens == want.total_tokens
    with pytest.raises(voyageai.error.InvalidRequestError, match="'top_k' must be >= 1"):
        vo.rerank(query, TEXTS, model="rerank", top_k=0)
    # LangChain's reranker over the SDK's clients, the async one (aiohttp) too
    langchain = VoyageAIRerank(model="rerank", api_key=API_KEY, base_url=f"{base}/v1", top_k=2)
    documents = [Document(page_content=t) for t in TEXTS]
    for kept in (
        langchain.compress_documents(documents, query),
        asyncio.run(langchain.acompress_documents(documents, query)),
    ):
        assert [d.page_content for d in kept] == [TEXTS[i] for i, _ in want.ranking]
        assert [d.metadata["relevance_score"] for d in kept] == pytest.approx(
            [s for _, s in want.ranking], abs=SAME
        )
    body = {"query": query, "documents": TEXTS, "top_k": 1, "return_documents": True}
    status, answer, _ = post(base, "/v1/rerank", body)
    assert status == 200 and answer["object"] == "list", answer
    assert answer["data"] == [
        {
            "relevance_score": answer["data"][0]["relevance_score"],
            "index": want.ranking[0][0],
            "document": TEXTS[want.ranking[0][0]],
        }
    ]
    for path, body, words in [
        (
            "/v1/rerank",
            {"query": "q", "documents": ["d"], "top_k": 1, "top_n": 1},
            "'top_k' or 'top_n'",
        ),
        (
            "/v1/embeddings",
            {"input": "x", "output_dimension": 8, "dimensions": 8},
            "'output_dimension' or 'dimensions'",
        ),
        ("/v1/embeddings", {"input": "x", "output_dtype": "int4"}, "'output_dtype' must be one of"),
        (
            "/v1/embeddings",
            {"input": "x", "output_dtype": "int8", "embedding_type": "int8"},
            "not both",
        ),
        ("/v1/embeddings", {"input": "x", "truncation": "yes"}, "'truncation' must be a boolean"),
    ]:
        status, answer, _ = post(base, path, body)
        assert status == 400 and words in answer["detail"], (body, answer)
        assert answer["detail"] == answer["error"]["message"]


def test_mixedbread_sdk_embeds_with_its_fields_and_reranks(stack):
    """Mixedbread's `mixedbread` SDK, unchanged but for its base URL: its embed's `prompt`,
    `normalized` and `dimensions` are the route's own fields; its rerank (POST /v1/reranking,
    what mxbai-rerank-v2's users call) the reranker's ranking in its shape, refusals naming
    its fields."""
    server, base = stack
    mx = Mixedbread(api_key=API_KEY, base_url=base, max_retries=0)
    answer = mx.embed(model="embed", input=TEXTS, prompt="query: ", normalized=False, dimensions=32)
    got = np.array([d.embedding for d in answer.data], dtype=np.float32)
    want = openai_vectors(base, TEXTS, prompt="query: ", normalize=False, dimensions=32)
    assert np.abs(got - want).max() <= SAME and np.linalg.norm(got[0]) > 1.5
    query = "Which city is the capital of China?"
    with EmbeddingClient(server.grpc_url) as client:
        want = client.rerank(query, TEXTS, top_n=2)
    ranked = mx.rerank(model="rerank", query=query, input=TEXTS, top_k=2, return_input=True)
    assert [(d.index, d.input) for d in ranked.data] == [(i, TEXTS[i]) for i, _ in want.ranking]
    assert [d.score for d in ranked.data] == pytest.approx([s for _, s in want.ranking], abs=SAME)
    assert ranked.usage.total_tokens == want.total_tokens and ranked.top_k == 2
    everything = mx.rerank(model="rerank", query=query, input=TEXTS)
    assert len(everything.data) == len(TEXTS) and everything.data[0].input is None
    for extra, words in [
        ({"top_k": 0}, "'top_k' must be >= 1"),
        ({"rewrite_query": True}, "'rewrite_query' is not served"),
        ({"rank_fields": ["title"]}, "'rank_fields' is not served"),
    ]:
        with pytest.raises(MixedbreadBadRequest, match=words):
            mx.rerank(model="rerank", query=query, input=TEXTS, **extra)
    body = {"query": query, "input": [{"title": "a"}]}
    status, refused, _ = post(base, "/v1/reranking", body)
    assert status == 400 and refused["error"]["param"] == "input", refused
    assert "'input[0]' must be a string" in refused["error"]["message"]


# A 1x1 PNG (the smallest real image file).
ONE_PIXEL_PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4//8/AAX+Av4N70a4AAAAAElFTkSuQmCC"
)


def test_litellm_embedding_providers_get_the_openai_routes_vectors(stack):
    """LiteLLM's embedding providers, each given the gateway's URL as its api_base (the form
    its docs give for that provider's own servers): the OpenAI-compatible and vLLM ones,
    Infinity's (its URL without /v1), Cohere's, Voyage's, NIM's, Jina's, Gemini's (its URL with
    /v1beta), Hugging Face's (TEI's) and Ollama's give the OpenAI route's vectors, their input
    types the checkpoint's prompts and their `dimensions` its width; refusals reach LiteLLM as
    its BadRequestError, and Infinity's `modality` "image" is read as images (refused by this
    text model), not as the URLs' text. Infinity's GET /models lists what /v1/models does."""
    _, base = stack
    v1 = f"{base}/v1"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    listed = send_json("GET", f"{base}/models", None, auth)[1]["data"]
    assert [m["id"] for m in listed] == ["embed", ALIAS, "rerank"]
    for model, api_base, fields, options in [
        ("openai/embed", v1, {}, {}),
        ("hosted_vllm/embed", v1, {"dimensions": 32}, {"dimensions": 32}),
        ("infinity/embed", base, {"dimensions": 32}, {"dimensions": 32}),
        (
            "cohere/embed",
            f"{base}/v2/embed",
            {"input_type": "search_query"},
            {"prompt_name": "query"},
        ),
        ("cohere/embed", f"{base}/v1/embed", {}, {"prompt_name": "document"}),  # its default
        (
            "voyage/embed",
            v1,
            {"input_type": "query", "dimensions": 32},
            {"prompt_name": "query", "dimensions": 32},
        ),
        ("nvidia_nim/embed", v1, {"input_type": "passage"}, {"prompt_name": "document"}),
        ("jina_ai/embed", v1, {"dimensions": 32}, {"dimensions": 32}),
        ("gemini/embed", f"{base}/v1beta", {"dimensions": 32}, {"dimensions": 32}),
        ("huggingface/embed", base, {"input_type": "feature-extraction"}, {}),
        ("ollama/embed", base, {}, {}),
    ]:
        answer = litellm.embedding(
            model=model, input=TEXTS, api_base=api_base, api_key=API_KEY, **fields
        )
        got = np.array([d["embedding"] for d in answer.data], dtype=np.float32)
        want = openai_vectors(base, TEXTS, **options)
        assert got.shape == want.shape and np.abs(got - want).max() <= SAME, (model, fields)
    query = openai_vectors(base, TEXTS, prompt_name="query")
    assert np.abs(query - openai_vectors(base, TEXTS)).max() > 1e-3  # the prompt applied
    answer = asyncio.run(
        litellm.aembedding(model="hosted_vllm/embed", input=TEXTS, api_base=v1, api_key=API_KEY)
    )
    got = np.array([d["embedding"] for d in answer.data], dtype=np.float32)
    assert np.abs(got - openai_vectors(base, TEXTS)).max() <= SAME
    image = "data:image/png;base64," + base64.b64encode(ONE_PIXEL_PNG).decode()
    for model, api_base, fields, words in [
        ("hosted_vllm/embed", v1, {"dimensions": 4096}, "'dimensions' must be in 1..1024"),
        ("infinity/embed", base, {"modality": "image"}, "this model reads text only"),
        ("infinity/embed", base, {"modality": "audio"}, "'modality' must be one of"),
    ]:
        with pytest.raises(litellm.BadRequestError, match=words):
            litellm.embedding(
                model=model, input=[image], api_base=api_base, api_key=API_KEY, **fields
            )


def test_litellm_rerank_providers_rank_as_the_reranker(stack):
    """LiteLLM's rerank providers on the gateway's URL: Cohere's (v2), vLLM's, Jina's,
    Voyage's, Together's and Hugging Face's (TEI's /rerank) give the reranker's ranking and
    scores and the documents' texts, NIM's (/v1/ranking) its logits. (Its Infinity provider
    reads a document as a string where vLLM's reads Cohere's object, from the same body at the
    same URL: the gateway answers vLLM's, docs/api.md.)"""
    server, base = stack
    query = "Which city is the capital of China?"
    with EmbeddingClient(server.grpc_url) as client:
        want = client.rerank(query, TEXTS)
    for model, api_base, kept, texts in [
        ("cohere/rerank", base, 2, False),  # Cohere's v2 returns no documents
        ("hosted_vllm/rerank", base, 2, True),
        ("jina_ai/rerank", f"{base}/v1", 2, True),
        ("voyage/rerank", f"{base}/v1", 2, True),
        ("together_ai/rerank", f"{base}/v1", 2, True),
        ("huggingface/rerank", base, 3, True),  # TEI's /rerank ranks every text
        ("nvidia_nim/ranking/rerank", base, 2, True),
    ]:
        answer = litellm.rerank(
            model=model,
            query=query,
            documents=TEXTS,
            top_n=2,
            return_documents=True,
            api_base=api_base,
            api_key=API_KEY,
        )
        ranking = want.ranking[:kept]
        assert [r["index"] for r in answer.results] == [i for i, _ in ranking], model
        scores = [log_odds(s) if "nvidia_nim" in model else s for _, s in ranking]
        assert [r["relevance_score"] for r in answer.results] == pytest.approx(scores, abs=1e-5)
        documents = [(r.get("document") or {}).get("text") for r in answer.results]
        assert documents == [TEXTS[i] if texts else None for i, _ in ranking], model


def test_nim_embeddings_client_gets_the_query_and_document_prompts(stack):
    """LangChain's NVIDIAEmbeddings (NIM's client): embed_query sends input_type "query",
    embed_documents "passage", the checkpoint's query and document prompts; its truncate
    modes are ours."""
    _, base = stack
    nim = NVIDIAEmbeddings(base_url=f"{base}/v1", model="embed", api_key=API_KEY)
    query = np.array(nim.embed_query(TEXTS[0]))
    assert np.abs(query - openai_vectors(base, TEXTS[:1], prompt_name="query")[0]).max() <= SAME
    assert np.abs(query - openai_vectors(base, TEXTS[:1])[0]).max() > 1e-3  # a prompt it is
    documents = np.array(nim.embed_documents(TEXTS))
    expected = openai_vectors(base, TEXTS, prompt_name="document")
    assert np.abs(documents - expected).max() <= SAME
    small = NVIDIAEmbeddings(base_url=f"{base}/v1", model="embed", api_key=API_KEY, dimensions=32)
    expected = openai_vectors(base, TEXTS[:1], prompt_name="query", dimensions=32)
    assert np.abs(np.array(small.embed_query(TEXTS[0])) - expected[0]).max() <= SAME
    long_text = "word " * 300
    start = NVIDIAEmbeddings(
        base_url=f"{base}/v1", model="embed", api_key=API_KEY, truncate="START"
    )
    expected = openai_vectors(
        base, [long_text], prompt_name="document", truncation_direction="left"
    )
    assert np.abs(np.array(start.embed_documents([long_text])) - expected).max() <= SAME
    body = {"model": "embed", "input": [long_text], "input_type": "passage", "truncate": "NONE"}
    status, answer, _ = post(base, "/v1/embeddings", body)
    assert status == 400 and f"limit of {TOKENS_PER_TEXT}" in answer["error"]["message"], answer
    body = {"model": "embed", "input": ["x"], "input_type": "query", "prompt_name": "query"}
    status, answer, _ = post(base, "/v1/embeddings", body)
    assert status == 400 and answer["error"]["param"] == "prompt_name", answer


def test_nim_rerank_client_ranks_by_the_rerankers_logits(stack):
    """LangChain's NVIDIARerank on /v1/ranking: the reranker's order, each logit the log-odds
    of its P("yes")."""
    server, base = stack
    query = "Which city is the capital of China?"
    with EmbeddingClient(server.grpc_url) as client:
        want = client.rerank(query, TEXTS)
    nim = NVIDIARerank(base_url=f"{base}/v1", model="rerank", api_key=API_KEY, top_n=2)
    got = nim.compress_documents(query=query, documents=[Document(page_content=t) for t in TEXTS])
    assert [d.page_content for d in got] == [TEXTS[i] for i, _ in want.ranking[:2]]
    logits = [math.log(s / (1 - s)) for _, s in want.ranking[:2]]
    assert [d.metadata["relevance_score"] for d in got] == pytest.approx(logits, abs=1e-5)
    passages = [{"text": t} for t in TEXTS]
    body = {"model": "rerank", "query": {"text": query}, "passages": passages, "truncate": "NONE"}
    status, answer, _ = post(base, "/v1/ranking", body)
    assert status == 200 and [r["index"] for r in answer["rankings"]] == [
        i for i, _ in want.ranking
    ]
    with urllib.request.urlopen(f"{base}/v1/health/ready", timeout=10) as r:  # no key
        assert r.status == 200 and json.loads(r.read())["ready"] is True
    for body, status_code, param in [
        ({"model": "rerank", "query": {"text": query}, "passages": []}, 400, "passages"),
        ({"model": "rerank", "query": {"text": query}, "passages": [{"text": 1}]}, 400, "passages"),
        ({"model": "nv-rerank-qa", "query": {"text": query}, "passages": passages}, 404, "model"),
    ]:
        status, answer, _ = post(base, "/v1/ranking", body)
        assert status == status_code and answer["error"]["param"] == param, answer


def test_vllm_rerank_fields(stack):
    """vLLM's /v1/rerank fields: `use_activation` false (Infinity's `raw_scores` true) answers
    the reranker's logits, `top_n` 0 every document, `max_tokens_per_doc` and
    `chat_template_kwargs.instruction` ours."""
    server, base = stack
    query, long_document = "Which city is the capital of China?", "Beijing " * 60
    documents = [*TEXTS, long_document]
    with EmbeddingClient(server.grpc_url) as client:
        want = client.rerank(query, documents)
        cut = client.rerank(query, documents, max_document_tokens=8)
        instructed = client.rerank(query, documents, instruction="Find the city")

    def scores(**fields) -> dict[int, float]:
        body = {"model": "rerank", "query": query, "documents": documents, **fields}
        status, answer, _ = post(base, "/v1/rerank", body)
        assert status == 200, answer
        return {r["index"]: r["relevance_score"] for r in answer["results"]}

    logits = scores(use_activation=False, top_n=0)
    assert len(logits) == len(documents)
    assert [logits[i] for i, _ in want.ranking] == pytest.approx(
        [log_odds(s) for _, s in want.ranking], abs=1e-6
    )
    assert scores(raw_scores=True) == logits  # Infinity's name of the same switch
    assert scores(max_tokens_per_doc=8) == pytest.approx(dict(cut.ranking), abs=1e-6)
    assert dict(cut.ranking)[3] != pytest.approx(dict(want.ranking)[3], abs=1e-4)  # it was cut
    kwargs = {"chat_template_kwargs": {"instruction": "Find the city"}}
    assert scores(**kwargs) == pytest.approx(dict(instructed.ranking), abs=1e-6)


def test_openai_token_ids_truncation_fields_and_fingerprint(stack):
    server, base = stack
    api = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY)
    with EmbeddingClient(server.grpc_url) as client:
        (tokens,) = client.tokenize(TEXTS[:1])
        fingerprint = client.model_fingerprint()
    ids = [t["id"] for t in tokens]
    by_ids = api.embeddings.create(input=[ids, ids], model="embed", encoding_format="float")
    by_text = openai_vectors(base, TEXTS[:1])
    # the tokenizer's own ids (end-of-text included) give the text's vector
    assert np.abs(np.array(by_ids.data[0].embedding) - by_text[0]).max() <= SAME
    assert by_ids.usage.total_tokens == 2 * len(ids)
    # ids without it are another tokenizer's (LangChain's OpenAIEmbeddings sends tiktoken's)
    with pytest.raises(openai.BadRequestError, match=r"'input\[1\]' token ids must end with"):
        api.embeddings.create(input=[ids, ids[:-1]], model="embed")
    single = api.embeddings.create(input=ids, model="embed", encoding_format="float")
    assert np.abs(np.array(single.data[0].embedding) - by_text[0]).max() <= SAME
    with pytest.raises(openai.BadRequestError, match="outside this model's vocabulary"):
        api.embeddings.create(input=[[151643, 10**7]], model="embed")
    with pytest.raises(openai.BadRequestError, match="outside any vocabulary"):
        api.embeddings.create(input=[[1, 2**40]], model="embed")  # past int32: the gateway's
    with pytest.raises(openai.BadRequestError, match="prompts and chunks are for texts"):
        api.embeddings.create(input=[ids], model="embed", extra_body={"prompt_name": "query"})
    # an image for a model that reads text only: refused by the server, naming the field
    png = "data:image/png;base64," + base64.b64encode(ONE_PIXEL_PNG).decode()
    image = {"type": "image_url", "image_url": {"url": png}}
    with pytest.raises(
        openai.BadRequestError, match="'input' holds images, and this model reads text only"
    ) as e:
        api.embeddings.create(input=[[{"type": "text", "text": "x"}, image]], model="embed")
    assert e.value.body["param"] == "input"
    # truncation reported per text: the SDK keeps the extension fields
    long_text = "word " * 300
    response = api.embeddings.create(input=[TEXTS[0], long_text], model="embed")
    first, second = (d.model_extra for d in response.data)
    assert first == {"tokens": 5, "input_tokens": 5, "truncated": False}
    assert second["tokens"] == TOKENS_PER_TEXT and second["truncated"]
    assert second["input_tokens"] == 302  # 300 words, the trailing space, end-of-text
    status, _, headers = post(base, "/embed", {"inputs": [TEXTS[0], long_text]})
    assert headers["x-tokens"] == f"5,{TOKENS_PER_TEXT}" and headers["x-input-tokens"] == "5,302"
    # the fingerprint: one value on every route and in /info and /v1/models
    assert fingerprint and len(fingerprint) == 32
    raw = api.embeddings.with_raw_response.create(input="x", model="embed")
    assert raw.headers["x-model-fingerprint"] == fingerprint == headers["x-model-fingerprint"]
    assert urllib_get(base, "/info")[1]["fingerprint"] == fingerprint
    assert api.models.list().data[0].model_extra["fingerprint"] == fingerprint
    status, _, headers = post(base, "/v2/embed", {"model": "embed", "texts": ["x"]})
    assert status == 200 and headers["x-model-fingerprint"] == fingerprint
    # vLLM's truncation fields are ours
    for theirs, ours in [
        ({"truncate_prompt_tokens": 8}, {"max_tokens": 8}),
        (
            {"truncate_prompt_tokens": 8, "truncation_side": "left"},
            {"max_tokens": 8, "truncation_direction": "left"},
        ),
    ]:
        got = openai_vectors(base, [long_text], **theirs)
        assert np.abs(got - openai_vectors(base, [long_text], **ours)).max() <= SAME
        assert np.abs(got - openai_vectors(base, [long_text])).max() > 1e-3  # it was cut


def post_raw(base: str, path: str, body: dict) -> tuple[int, bytes, dict]:
    """(status, the body's bytes, headers with lower-case names)."""
    request = urllib.request.Request(
        f"{base}{path}",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        return r.status, r.read(), {k.lower(): v for k, v in r.headers.items()}


def data_vectors(body: dict) -> np.ndarray:
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float32)


def test_vllm_encoding_and_activation_fields(stack):
    """vLLM's `embed_dtype` and `endianness` shape a base64 vector's bytes (read back as
    vLLM's own decoder reads them: torch's type, byte-swapped for big-endian), and those of
    its binary formats; its `use_activation` false is `normalize` false."""
    _, base = stack
    floats = openai_vectors(base, TEXTS[:2])
    for embed_dtype, like, tolerance in [
        ("float32", torch.float32, 0),
        ("bfloat16", torch.bfloat16, 2**-8),
        ("fp8_e4m3", torch.float8_e4m3fn, 2**-3),
    ]:
        for endianness in ("little", "big"):
            body = {"model": "embed", "input": TEXTS[:2], "encoding_format": "base64"}
            body |= {"embed_dtype": embed_dtype, "endianness": endianness}
            status, answer, _ = post(base, "/v1/embeddings", body)
            assert status == 200, answer
            for i, item in enumerate(answer["data"]):
                raw = bytearray(base64.b64decode(item["embedding"]))
                width = torch.tensor([], dtype=like).element_size()
                if endianness == "big":
                    raw = b"".join(raw[j : j + width][::-1] for j in range(0, len(raw), width))
                got = torch.frombuffer(bytearray(raw), dtype=like).float().numpy()
                assert np.abs(got - floats[i]).max() <= tolerance * np.abs(floats[i]).max()
    raw = openai_vectors(base, TEXTS[:2], use_activation=False)
    assert np.abs(raw - openai_vectors(base, TEXTS[:2], normalize=False)).max() <= SAME
    # Its binary formats: the vectors' bytes as the body, their places in the `metadata`
    # header ("bytes") or nowhere ("bytes_only")
    for embed_dtype, like, tolerance in [("float32", np.float32, 0), ("float16", ">f2", 2**-10)]:
        body = {"model": "embed", "input": TEXTS[:2], "encoding_format": "bytes"}
        body |= {"embed_dtype": embed_dtype, "endianness": "big" if like == ">f2" else "native"}
        status, content, headers = post_raw(base, "/v1/embeddings", body)
        assert status == 200 and headers["content-type"] == "application/octet-stream"
        metadata = json.loads(headers["metadata"])
        assert metadata["model"] == "embed" and metadata["usage"]["total_tokens"] > 0
        for i, item in enumerate(metadata["data"]):
            assert item["index"] == i and item["shape"] == [floats.shape[1]]
            got = np.frombuffer(content[item["start"] : item["end"]], like).astype(np.float32)
            assert np.abs(got - floats[i]).max() <= tolerance * np.abs(floats[i]).max()
    body |= {"encoding_format": "bytes_only", "embed_dtype": "float32", "endianness": "little"}
    status, content, headers = post_raw(base, "/v1/embeddings", body)
    assert status == 200 and "metadata" not in headers
    assert np.array_equal(np.frombuffer(content, "<f4").reshape(floats.shape), floats)
    status, answer, _ = post(base, "/pooling", body)  # answered on /v1/embeddings alone
    assert status == 400 and answer["error"]["param"] == "encoding_format"
    assert np.abs(np.linalg.norm(raw, axis=1) - 1).min() > 1e-3  # not unit vectors
    status, answer, _ = post(
        base, "/v1/embeddings", {"model": "embed", "input": "x", "add_special_tokens": False}
    )
    assert status == 400 and answer["error"]["param"] == "add_special_tokens"


def late_chunks(base: str) -> np.ndarray:
    """SENTENCES' late chunks with the query prompt, as a causal model pooled at the last
    token reads them out: each the joined text cut after it."""
    cut = [" ".join(SENTENCES[: i + 1]) for i in range(len(SENTENCES))]
    return openai_vectors(base, cut, prompt_name="query")


def test_vllm_pooling_route_gives_text_and_token_vectors(stack):
    """vLLM's /pooling: task "embed" is /v1/embeddings' vector, "token_embed" every token's
    (unit length, as /embed_all with normalize), base64 with vLLM's dtypes too; other tasks
    are refused."""
    server, base = stack

    def pool(**fields) -> dict:
        status, answer, headers = post(base, "/pooling", {"model": "embed", **fields})
        assert status == 200, answer
        assert headers["x-model-fingerprint"] and answer["object"] == "list"
        return answer

    answer = pool(input=TEXTS)  # no task: "embed"
    got = np.array([d["data"] for d in answer["data"]], dtype=np.float32)
    assert np.abs(got - openai_vectors(base, TEXTS)).max() <= SAME
    assert pool(input=TEXTS, task="embed", dimensions=48)["data"][0]["data"] == pytest.approx(
        openai_vectors(base, TEXTS[:1], dimensions=48)[0], abs=SAME
    )
    with EmbeddingClient(server.grpc_url) as client:
        want = client.embed_tokens(TEXTS)
    answer = pool(input=TEXTS, task="token_embed")
    for item, expected in zip(answer["data"], want, strict=True):
        assert item["object"] == "pooling"
        assert np.abs(np.array(item["data"], dtype=np.float32) - expected).max() <= SAME
    assert answer["usage"]["prompt_tokens"] == sum(len(v) for v in want)
    packed = pool(input=TEXTS[:1], task="token_embed", encoding_format="base64")
    raw = np.frombuffer(base64.b64decode(packed["data"][0]["data"]), "<f4")
    assert np.array_equal(raw.reshape(want[0].shape), want[0])
    for path, fields, words, param in [
        ("/pooling", {"task": "plugin"}, "'task' must be one of ['embed', 'token_embed'", "task"),
        ("/pooling", {"task": "token_embed", "embedding_type": "int8"}, "float token", "task"),
        ("/pooling", {"task": "classify"}, "not a sequence classifier", "model"),
        ("/classify", {}, "not a sequence classifier", "model"),
    ]:
        status, answer, _ = post(base, path, {"model": "embed", "input": "x", **fields})
        assert status == 400 and words in answer["error"]["message"], answer
        assert answer["error"]["param"] == param


def test_jina_client_gets_tasks_binary_codes_and_late_chunks(stack):
    """LlamaIndex's JinaEmbedding (it sends `task`, `encoding_type`, `late_chunking`)."""
    _, base = stack

    def jina(**settings) -> JinaEmbedding:
        embedder = JinaEmbedding(api_key=API_KEY, model="embed", **settings)
        embedder._api.api_url = f"{base}/v1/embeddings"  # the library takes no base URL
        return embedder

    query = jina(task="retrieval.query").get_query_embedding(TEXTS[0])
    assert np.abs(query - openai_vectors(base, TEXTS[:1], prompt_name="query")[0]).max() <= SAME
    documents = jina(task="retrieval.passage").get_text_embedding_batch(TEXTS)
    expected = openai_vectors(base, TEXTS, prompt_name="document")
    assert np.abs(np.array(documents) - expected).max() <= SAME
    # its binary codes, unpacked by the library: a bit per dimension, set where it is > 0
    bits = jina(encoding_documents="ubinary").get_text_embedding_batch(TEXTS)
    assert (np.array(bits) == (openai_vectors(base, TEXTS) > 0)).all()
    late = jina(task="retrieval.query", late_chunking=True).get_text_embedding_batch(SENTENCES)
    assert np.abs(np.array(late) - late_chunks(base)).max() <= 1e-5


def test_jina_fields_and_late_chunking(stack):
    """Jina's `task`, `normalized` and `embedding_type` "base64" are our prompts and options;
    `late_chunking` gives each input the vector of the joined text cut after it (a causal
    model pooled at the last token reads a chunk out as the text up to the chunk's end)."""
    _, base = stack

    def jina(**fields) -> np.ndarray:
        status, body, _ = post(base, "/v1/embeddings", {"model": "embed", **fields})
        assert status == 200, body
        return body

    assert (
        np.abs(
            data_vectors(jina(input=TEXTS, task="retrieval.query"))
            - openai_vectors(base, TEXTS, prompt_name="query")
        ).max()
        <= SAME
    )
    matching = data_vectors(jina(input=TEXTS, task="text-matching"))
    instructed = openai_vectors(base, TEXTS, instruction="Retrieve semantically similar text")
    assert np.abs(matching - instructed).max() <= SAME
    raw = data_vectors(jina(input=TEXTS, normalized=False))
    assert np.abs(raw - openai_vectors(base, TEXTS, normalize=False)).max() <= SAME
    packed = jina(input=TEXTS, embedding_type="base64")["data"]
    unpacked = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in packed]
    assert np.abs(np.array(unpacked) - openai_vectors(base, TEXTS)).max() == 0
    # late chunking, with the query prompt before the joined text
    body = jina(input=SENTENCES, late_chunking=True, task="retrieval.query")
    expected = late_chunks(base)
    assert np.abs(data_vectors(body) - expected).max() <= 1e-5
    assert np.abs(np.diff(data_vectors(body), axis=0)).max() > 1e-3  # one vector each
    with EmbeddingClient(stack[0].grpc_url) as client:
        (whole,) = client.count_tokens([" ".join(SENTENCES)], prompt_name="query")
    assert body["usage"]["total_tokens"] == whole
    # the joined text must fit the model's limit
    words = ["word " * 40] * 3
    status, body, _ = post(
        base, "/v1/embeddings", {"model": "embed", "input": words, "late_chunking": True}
    )
    assert status == 400 and body["error"]["param"] == "input", body
    assert f"more than the limit of {TOKENS_PER_TEXT}" in body["error"]["message"]
    assert "'late_chunking' reads the 3 inputs as one text of" in body["error"]["message"]


def test_ollama_clients_get_the_openai_routes_vectors(stack):
    """Ollama's Python library and LangChain's OllamaEmbeddings with the gateway as their host:
    /api/embed's unit vectors, `dimensions`, `options.num_ctx` as a cut, `truncate` false; the
    older /api/embeddings' vector not normalized; /api/tags and /api/show; Ollama's errors."""
    _, base = stack
    auth = {"Authorization": f"Bearer {API_KEY}"}
    client = ollama.Client(host=base, headers=auth)
    got = np.array(client.embed(model="embed", input=TEXTS).embeddings, dtype=np.float32)
    assert np.abs(got - openai_vectors(base, TEXTS)).max() <= SAME
    answer = client.embed(model=ALIAS, input=TEXTS[0], dimensions=48)
    assert (
        np.abs(answer.embeddings[0] - openai_vectors(base, TEXTS[:1], dimensions=48)[0]).max()
        <= SAME
    )
    assert answer.prompt_eval_count == 5 and answer.model == ALIAS
    long_text = "word " * 300
    cut = client.embed(model="embed", input=[long_text], options={"num_ctx": 8}).embeddings
    assert np.abs(cut[0] - openai_vectors(base, [long_text], max_tokens=8)[0]).max() <= SAME
    assert client.embed(model="embed", input=[]).embeddings == []  # Ollama's preload
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="embed", input=[long_text], truncate=False)
    assert e.value.status_code == 400 and f"limit of {TOKENS_PER_TEXT}" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="nomic-embed-text", input="x")
    assert e.value.status_code == 404 and "'nomic-embed-text'" in e.value.error
    raw = client.embeddings(model="embed", prompt=TEXTS[1]).embedding
    assert np.abs(raw - openai_vectors(base, TEXTS[1:2], normalize=False)[0]).max() <= 1e-5
    assert [m.model for m in client.list().models] == ["embed", ALIAS]
    shown = client.show(ALIAS)  # what tools ask before they embed
    assert shown.capabilities == ["embedding"] and shown.details.family == "qwen"
    dimension = openai_vectors(base, TEXTS[:1]).shape[1]
    assert shown.modelinfo["qwen.embedding_length"] == dimension
    assert shown.modelinfo["qwen.context_length"] == TOKENS_PER_TEXT
    with pytest.raises(ollama.ResponseError) as e:
        client.show("nomic-embed-text")
    assert e.value.status_code == 404
    langchain = OllamaEmbeddings(model="embed", base_url=base, client_kwargs={"headers": auth})
    documents = np.array(langchain.embed_documents(TEXTS), dtype=np.float32)
    assert np.abs(documents - openai_vectors(base, TEXTS)).max() <= SAME
    assert np.abs(langchain.embed_query(TEXTS[0]) - documents[0]).max() <= SAME


def test_langchain_openai_embeddings_get_the_texts_vectors_or_a_clear_refusal(stack, demo_dir):
    """LangChain's OpenAIEmbeddings sends tiktoken's token ids by default (cl100k_base's, which
    cannot be downloaded here: sent below as the SDK sends them), which a Qwen model would read
    as its own vocabulary's: refused, naming the setting that sends texts. With it, or with
    the model's own tokenizer in place of tiktoken's, the texts' vectors."""
    _, base = stack
    api = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY)
    cl100k = [[9906, 11, 1917, 0]]  # "Hello, world!" in cl100k_base, as LangChain sends it
    with pytest.raises(openai.BadRequestError, match="check_embedding_ctx_length=False") as e:
        api.embeddings.create(input=cl100k, model="embed", encoding_format="base64")
    assert e.value.body["param"] == "input"
    settings = {"model": "embed", "base_url": f"{base}/v1", "api_key": API_KEY}
    expected = openai_vectors(base, TEXTS)
    for langchain in (
        OpenAIEmbeddings(**settings, check_embedding_ctx_length=False),
        OpenAIEmbeddings(**settings, tiktoken_enabled=False, tiktoken_model_name=str(demo_dir)),
    ):
        got = np.array(langchain.embed_documents(TEXTS), dtype=np.float32)
        assert np.abs(got - expected).max() <= SAME


def test_azure_openai_clients_get_the_openai_routes_vectors(stack):
    """`openai.AzureOpenAI` and LangChain's `AzureOpenAIEmbeddings` with the gateway as their
    endpoint: the deployment in the URL is the model (a served name, a Hugging Face id with
    its "/" too) whatever the body's `model`, the key in Azure's `api-key` header; a wrong
    key is refused, an unknown deployment named. Azure's v1 API (base URL {endpoint}/openai/v1)
    answers as OpenAI's routes do."""
    _, base = stack
    expected = openai_vectors(base, TEXTS)
    azure = {"azure_endpoint": base, "api_key": API_KEY, "api_version": "2024-10-21"}
    api = openai.AzureOpenAI(**azure, max_retries=0)
    for deployment in ("embed", ALIAS):
        got = api.embeddings.create(model=deployment, input=TEXTS)
        assert got.model == "embed"  # the first served name answers
        assert np.abs(np.array([d.embedding for d in got.data]) - expected).max() <= SAME
    short = api.embeddings.create(model="embed", input=TEXTS, dimensions=32)
    want = openai_vectors(base, TEXTS, dimensions=32)
    assert np.abs(np.array([d.embedding for d in short.data]) - want).max() <= SAME
    # an application written for Azure names its own model in the body: the URL decides
    pinned = openai.AzureOpenAI(**azure, azure_deployment="embed", max_retries=0)
    got = pinned.embeddings.create(model="text-embedding-3-small", input=TEXTS)
    assert np.abs(np.array([d.embedding for d in got.data]) - expected).max() <= SAME
    with pytest.raises(openai.AuthenticationError):
        openai.AzureOpenAI(**azure | {"api_key": "wrong"}, max_retries=0).embeddings.create(
            model="embed", input=TEXTS
        )
    with pytest.raises(openai.NotFoundError, match="'text-embedding-3-small' does not exist"):
        api.embeddings.create(model="text-embedding-3-small", input=TEXTS)
    langchain = AzureOpenAIEmbeddings(
        **azure, azure_deployment="embed", check_embedding_ctx_length=False
    )
    assert np.abs(np.array(langchain.embed_documents(TEXTS)) - expected).max() <= SAME
    # Azure's v1 API: the plain client with {endpoint}/openai/v1 as its base URL
    v1 = openai.OpenAI(base_url=f"{base}/openai/v1", api_key=API_KEY, max_retries=0)
    got = v1.embeddings.create(model=ALIAS, input=TEXTS)
    assert np.abs(np.array([d.embedding for d in got.data]) - expected).max() <= SAME
    assert [m.id for m in v1.models.list()] == ["embed", ALIAS, "rerank"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/openai/v1", api_key="wrong").models.list()


def test_gemini_clients_get_each_task_types_prompt_and_dimensions(stack):
    """google-genai's `models.embed_content` and LangChain's GoogleGenerativeAIEmbeddings with
    the gateway as their base URL, the key in Google's x-goog-api-key header: each task type
    the checkpoint's prompt (as Cohere's input types pick them), `output_dimensionality`, the
    URL's model (a Hugging Face id with its "/" too), requests of several task types in one
    batch, the single embedContent route, models.list and .get; a title, a wrong key, an
    unknown model and a bad dimension count refused in Google's error shape, named."""
    _, base = stack
    client = genai.Client(api_key=API_KEY, http_options=genai_types.HttpOptions(base_url=base))
    for task_type, options in [
        (None, {}),
        ("RETRIEVAL_QUERY", {"prompt_name": "query"}),
        ("RETRIEVAL_DOCUMENT", {"prompt_name": "document"}),
        ("CLASSIFICATION", {"instruction": TASK_INSTRUCTIONS["classification"]}),
        ("FACT_VERIFICATION", {"instruction": TASK_INSTRUCTIONS["fact_verification"]}),
    ]:
        config = genai_types.EmbedContentConfig(task_type=task_type, output_dimensionality=64)
        got = client.models.embed_content(model="embed", contents=TEXTS, config=config)
        want = openai_vectors(base, TEXTS, dimensions=64, **options)
        assert np.abs(np.array([e.values for e in got.embeddings]) - want).max() <= SAME, task_type
    query = openai_vectors(base, TEXTS[:1], prompt_name="query")
    by_alias = client.models.embed_content(model=ALIAS, contents=TEXTS[0])
    assert (
        np.abs(np.array(by_alias.embeddings[0].values) - openai_vectors(base, TEXTS[:1])).max()
        <= SAME
    )
    # one batch of two task types and two dimension counts: each request its own
    mixed = {
        "requests": [
            {"content": {"parts": [{"text": TEXTS[0]}]}, "taskType": "RETRIEVAL_QUERY"},
            {"content": {"parts": [{"text": TEXTS[0]}]}, "outputDimensionality": 32},
        ]
    }
    status, answer, _ = post(base, "/v1beta/models/embed:batchEmbedContents", mixed)
    assert status == 200 and answer["usageMetadata"]["totalTokenCount"] > 0
    first, second = (np.array(e["values"]) for e in answer["embeddings"])
    assert np.abs(first - query[0]).max() <= SAME
    assert np.abs(second - openai_vectors(base, TEXTS[:1], dimensions=32)[0]).max() <= SAME
    single = {"content": {"parts": [{"text": TEXTS[0]}]}, "task_type": "RETRIEVAL_QUERY"}
    status, answer, _ = post(base, "/v1beta/models/embed:embedContent", single)
    assert (
        status == 200 and np.abs(np.array(answer["embedding"]["values"]) - query[0]).max() <= SAME
    )
    names = [m.name for m in client.models.list()]
    assert names == ["models/embed", f"models/{ALIAS}"]
    assert client.models.get(model="embed").input_token_limit == TOKENS_PER_TEXT
    with pytest.raises(genai_errors.ClientError, match="NOT_FOUND"):
        client.models.get(model="nope")
    wrong_key = genai.Client(api_key="wrong", http_options=genai_types.HttpOptions(base_url=base))
    for call, code, words in [
        (
            lambda: client.models.embed_content(
                model="embed", contents=TEXTS[0], config={"title": "A title"}
            ),
            400,
            "'requests[0].title' is read by no model",
        ),
        (
            lambda: client.models.embed_content(
                model="embed", contents=TEXTS[0], config={"output_dimensionality": 0}
            ),
            400,
            "'outputDimensionality'",
        ),
        (
            lambda: client.models.embed_content(model="nope", contents=TEXTS[0]),
            404,
            "'nope' does not exist",
        ),
        (
            lambda: wrong_key.models.embed_content(model="embed", contents=TEXTS[0]),
            401,
            "API key",
        ),
    ]:
        with pytest.raises(genai_errors.ClientError) as refused:
            call()
        assert refused.value.code == code and words in refused.value.message, refused.value
    langchain = GoogleGenerativeAIEmbeddings(model="embed", google_api_key=API_KEY, base_url=base)
    documents = openai_vectors(base, TEXTS, prompt_name="document")
    assert np.abs(np.array(langchain.embed_documents(TEXTS)) - documents).max() <= SAME
    assert np.abs(np.array(langchain.embed_query(TEXTS[0])) - query[0]).max() <= SAME


def test_a_page_of_an_allowed_origin_reads_the_answers_and_their_headers(stack):
    """The origins of $QWEN_EMBED_CORS_ALLOW_ORIGINS (as the launcher's gateway gets them):
    a browser's page of one reads the answers of the OpenAI, TEI and vLLM binary routes with
    every header they set (the fingerprint, TEI's token counts, the bytes' `metadata`);
    another origin's page is told nothing."""
    server, _ = stack
    origin = "https://app.example"
    env = {"QWEN_EMBED_CORS_ALLOW_ORIGINS": f"https://other.example, {origin}"}
    with gateway_process(server, "--api-key", API_KEY, env=env) as base:
        sent = {"Origin": origin, "Authorization": f"Bearer {API_KEY}"}
        for path, body in [
            ("/v1/embeddings", {"model": "embed", "input": TEXTS}),
            ("/v1/embeddings", {"model": "embed", "input": TEXTS, "encoding_format": "bytes"}),
            ("/embed", {"inputs": TEXTS}),
            ("/embed_all", {"inputs": TEXTS[:1]}),
        ]:
            status, _, headers = send_json("POST", f"{base}{path}", body, sent)
            headers = {k.lower(): v for k, v in headers.items()}
            assert status == 200 and headers["access-control-allow-origin"] == origin, path
            exposed = {h.strip() for h in headers["access-control-expose-headers"].split(",")}
            ours = {h for h in headers if h.startswith("x-") or h == "metadata"}
            assert "x-model-fingerprint" in ours and ours <= exposed, (path, ours, exposed)
        elsewhere = {**sent, "Origin": "https://evil.example"}
        status, _, headers = send_json("POST", f"{base}/embed", {"inputs": "x"}, elsewhere)
        assert status == 200 and "access-control-allow-origin" not in map(str.lower, headers)


def test_the_gateway_serves_https_with_the_operators_certificate(stack):
    """With $QWEN_EMBED_SSL_CERTFILE and $QWEN_EMBED_SSL_KEYFILE (as the launcher's gateway gets
    them), clients that trust the certificate get the same vectors over HTTPS; plain HTTP to
    that port gets no answer. A certificate without its key, or a key that is not its, stops
    the gateway with one line naming the files."""
    server, base = stack
    cert, key = TLS / "cert.pem", TLS / "key.pem"
    trust = ssl.create_default_context(cafile=str(cert))
    env = {"QWEN_EMBED_SSL_CERTFILE": str(cert), "QWEN_EMBED_SSL_KEYFILE": str(key)}
    with gateway_process(server, "--api-key", API_KEY, env=env, tls=trust) as secure:
        assert secure.startswith("https://")
        # closed before the gateway stops: an idle TLS connection holds a stopping server for
        # asyncio's TLS shutdown timeout (the launcher stops its gateway within 10 s anyway)
        with httpx.Client(verify=trust) as session:
            api = openai.OpenAI(base_url=f"{secure}/v1", api_key=API_KEY, http_client=session)
            answer = api.embeddings.create(input=TEXTS, model="embed", encoding_format="float")
        got = np.array([d.embedding for d in answer.data], dtype=np.float32)
        assert np.abs(got - openai_vectors(base, TEXTS)).max() <= SAME
        plain = secure.replace("https://", "http://")
        with pytest.raises((OSError, http.client.HTTPException)):
            urllib.request.urlopen(f"{plain}/health", timeout=10)
    for flags, words in [
        (["--ssl-certfile", str(cert)], "--ssl-certfile and --ssl-keyfile go together"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(cert)], f"--ssl-keyfile {cert}"),
    ]:
        refused = subprocess.run(
            [sys.executable, "-m", "qwen_embed_client.gateway", *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 2 and words in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr


def test_every_api_gives_one_vector_per_text(stack):
    """The same texts through the four ways in: one vector each, equal across routes."""
    server, base = stack
    expected = openai_vectors(base, TEXTS, dimensions=48)
    _, tei, _ = post(base, "/embed", {"inputs": TEXTS, "dimensions": 48})
    _, co, _ = post(base, "/v2/embed", {"model": "embed", "texts": TEXTS, "output_dimension": 48})
    with EmbeddingClient(server.grpc_url) as client:
        library = client.embed(TEXTS, dimensions=48)
    for got in (np.array(tei), np.array(co["embeddings"]["float"]), library):
        assert got.shape == (len(TEXTS), 48) and np.abs(got - expected).max() <= SAME


def test_token_vectors_and_late_interaction_scores(stack, demo_dir):
    """TEI's /embed_all (every token's final hidden state) and the client library's
    embed_tokens: transformers' last_hidden_state for the same tokens; /v1/score: MaxSim of
    those vectors, normalised; an answer past the per-request byte limit refused by name."""
    server, base = stack
    status, states, headers = post(base, "/embed_all", {"inputs": TEXTS})
    assert status == 200 and len(states) == len(TEXTS)
    with EmbeddingClient(server.grpc_url) as client:
        ids = [[t["id"] for t in text] for text in client.tokenize(TEXTS)]
        assert client.count_tokens(TEXTS).tolist() == [len(i) for i in ids]
        library = client.embed_tokens(TEXTS, normalize=False)
        queries = client.embed_tokens(TEXTS[:1], prompt_name="query")
        documents = client.embed_tokens(TEXTS[1:])
    model = Qwen3Model.from_pretrained(demo_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [model(input_ids=torch.tensor([i])).last_hidden_state[0].numpy() for i in ids]
    assert headers["x-tokens"] == ",".join(str(len(i)) for i in ids)
    for got, mine, want in zip(states, library, expected, strict=True):
        got = np.array(got, dtype=np.float32)
        assert got.shape == mine.shape == want.shape
        assert cosine(got, want).min() >= 0.9999 and np.abs(got - mine).max() <= SAME
    body = {"model": "embed", "text_1": TEXTS[0], "text_2": TEXTS[1:], "prompt_name": "query"}
    status, scored, _ = post(base, "/v1/score", body)
    assert status == 200 and [d["index"] for d in scored["data"]] == [0, 1]
    want = maxsim_scores(queries[0], documents)
    assert np.abs(np.array([d["score"] for d in scored["data"]]) - want).max() <= 1e-4
    assert scored["usage"]["total_tokens"] == sum(len(v) for v in queries + documents)
    # 256 texts of 66 tokens x 1024 dimensions: 66 MiB of float32, just past the 64 MiB limit:
    # one Triton request is refused by the encoder, an HTTP request (several) by the gateway,
    # each before any forward (the encoder's texts counter does not move)
    long = ["word " * 64] * 256
    embedded = server.metric("qwen_embed_texts_total")
    with pytest.raises(InferenceServerException, match=r"parameter 'per_token': 256 texts"):
        infer(server, long, "grpc", model="embed", per_token=True)
    status, error, _ = post(base, "/embed_all", {"inputs": long})
    assert status == 422 and "are at least 66.0 MiB" in error["error"], error
    status, error, _ = post(base, "/embed_all", {"inputs": long * 8})  # 8 tokenizer requests
    assert status == 422 and "2048 inputs are at least 528.0 MiB" in error["error"], error
    assert server.metric("qwen_embed_texts_total") == embedded
