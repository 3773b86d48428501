"""Triton's response cache for the encoders (launcher --response-cache-mb): repeated requests
are answered from it, and a request whose options change the result never gets another
request's answer (the options reach the encoder as inputs, which Triton hashes)."""

import shutil

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from test_rerank_serving import rerank
from tritonclient.utils import InferenceServerException

from qwen_embed_client.contract import compact
from qwen_embed_deploy.launcher import cache_args, served_edits
from qwen_embed_deploy.repository import edited_copy, read_config, render
from qwen_embed_deploy.serving.config import MODEL_REPOSITORY
from qwen_embed_deploy.triton import TritonServer

from triton_helpers import infer, text_input

pytestmark = pytest.mark.server  # starts tritonserver or other processes

TEXT = ["What is the capital of China?"]


def test_cache_flags_and_configs():
    assert cache_args(0) == []
    assert cache_args(64) == [f"--cache-config=local,size={64 * 2**20}"]
    with pytest.raises(ValueError, match="--response-cache-mb"):
        cache_args(-1)
    cache_on = served_edits(None, False, None, response_cache=True)
    copy = edited_copy(MODEL_REPOSITORY, cache_on)
    for name in ("encoder", "rerank_encoder"):
        assert read_config(copy / name / "config.pbtxt").response_cache.enable
    for name in ("embed", "tokenizer", "rerank", "rerank_tokenizer"):  # hashes no options
        assert not read_config(copy / name / "config.pbtxt").HasField("response_cache")
    assert edited_copy(copy, cache_on) == copy  # already on: nothing to change
    shutil.rmtree(copy.parent)


@pytest.fixture(scope="module")
def server(demo_dir, reranker, tmp_path_factory):
    where = tmp_path_factory.mktemp("cache")
    repo = render(
        where / "repo",
        {"embed": demo_dir},
        {"encoder": {"dtype": "float32"}},
        rerankers={"rerank": reranker},
    )
    args = ["--response-cache-mb", "16"]
    with TritonServer(repo, log_path=where / "server.log", launcher_args=args) as server:
        yield server


def counts(server, model="encoder"):
    return (
        server.metric("nv_cache_num_hits_per_model", model=model),
        server.metric("nv_cache_num_misses_per_model", model=model),
    )


def test_repeats_hit_and_other_options_miss(server):
    first, _ = infer(server, TEXT, "grpc")
    texts_before = server.metric("qwen_embed_texts_total")
    assert counts(server) == (0, 1)
    again, _ = infer(server, TEXT, "http")
    assert counts(server) == (1, 1) and np.array_equal(again, first)
    assert server.metric("qwen_embed_texts_total") == texts_before  # the encoder did not run
    # Every option that changes the result is a miss with its own, correct answer.
    small, _ = infer(server, TEXT, "grpc", dimensions=64)
    assert small.shape == (1, 64) and counts(server) == (1, 2)
    expected = first[:, :64] / np.linalg.norm(first[:, :64])
    assert np.abs(small - expected).max() <= 1e-5
    raw, _ = infer(server, TEXT, "grpc", normalize=False)
    assert abs(np.linalg.norm(raw) - 1) > 1e-3 and counts(server) == (1, 3)
    query, tokens = infer(server, TEXT, "grpc", prompt_name="query")
    assert tokens[0, 0] > 10 and np.abs(query - first).max() > 1e-3 and counts(server) == (1, 4)
    codes = server_codes(server, "int8")
    assert np.array_equal(codes, compact(first, "int8")) and counts(server) == (1, 5)
    # ... and each of those, repeated, hits.
    assert np.array_equal(infer(server, TEXT, "http", dimensions=64)[0], small)
    assert np.array_equal(infer(server, TEXT, "http", prompt_name="query")[0], query)
    assert np.array_equal(server_codes(server, "int8"), codes)
    assert counts(server) == (4, 5)


def test_token_vectors_are_cached_apart_from_pooled_vectors(server):
    """per_token is an encoder input too (FINISH): its TOKEN_EMBEDDING answer is cached on its
    own key, never given to a pooled request, and a repeat hits (Triton counts its bytes
    against --response-cache-mb like any response)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    texts = ["The cache keeps a vector per token."]

    def tokens():
        inputs = [text_input(grpcclient, texts)]
        return client.infer("embed", inputs, parameters={"per_token": True})

    hits, misses = counts(server)
    first = tokens()
    assert counts(server) == (hits, misses + 1)
    again = tokens()
    assert counts(server) == (hits + 1, misses + 1)
    states = first.as_numpy("TOKEN_EMBEDDING")
    assert np.array_equal(again.as_numpy("TOKEN_EMBEDDING"), states)
    assert states.shape == (1, first.as_numpy("TOKEN_COUNT")[0, 0], 1024)
    pooled, _ = infer(server, texts, "grpc")
    assert counts(server) == (hits + 1, misses + 2) and pooled.shape == (1, 1024)


def server_codes(server, embedding_type):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = [text_input(grpcclient, TEXT)]
    result = client.infer("embed", inputs, parameters={"embedding_type": embedding_type})
    return result.as_numpy("EMBEDDING_INT8")


def test_rerank_repeats_hit_and_another_instruction_misses(server):
    documents = ["Beijing is the capital.", "Gravity."]
    scores, _ = rerank(server, TEXT[0], documents)
    assert counts(server, "rerank_encoder") == (0, 1)
    again, _ = rerank(server, TEXT[0], documents, "grpc")
    assert np.array_equal(again, scores) and counts(server, "rerank_encoder") == (1, 1)
    other, _ = rerank(server, TEXT[0], documents, instruction="Find gravity")
    assert np.abs(other - scores).max() > 0 and counts(server, "rerank_encoder") == (1, 2)


def test_texts_up_to_the_models_positions(server):
    """The shipped tokenizer takes texts up to the model's max_position_embeddings (32,768 for
    the demo model), not a fixed 8,192; beyond it a text is refused (truncate=false)."""
    long_text = "word " * 9000
    vectors, tokens = infer(server, [long_text], "grpc", truncate=False)
    assert tokens[0, 0] > 9000 and np.isfinite(vectors).all()
    with pytest.raises(InferenceServerException, match="more than the limit of 32768"):
        infer(server, ["word " * 33000], "grpc", truncate=False)
