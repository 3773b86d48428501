"""Sequence classifiers (`Qwen3ForSequenceClassification` with several labels) served as the
embed model: the encoder's task "classify" answers LOGITS, the labels are the encoder's
published fact, and TEI's /predict (and POST /, where `huggingface_hub.InferenceClient.
text_classification` posts) ranks them. Logits must match transformers' model on the same ids
(max-abs <= 1e-4 in fp32); TEI's scores are their softmax."""

import json
import urllib.request

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from huggingface_hub import InferenceClient
from tokenizers import Tokenizer
from transformers import Qwen3ForSequenceClassification
from tritonclient.utils import InferenceServerException

from qwen_embed import Encoder
from qwen_embed_client import EmbeddingClient
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.triton import TritonServer

from reference import make_classifier, make_reranker, random_sequences
from triton_helpers import gateway_process, text_input

# A real-vocabulary replica and transformers' model: seconds to build, the server tier's.
pytestmark = pytest.mark.server

LABELS = ("negative", "neutral", "positive")
TEXTS = ["I loved this film.", "It was fine, I suppose.", "Dreadful from start to end. 😞"]
FP32_ABS = 1e-4


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return make_classifier(tmp_path_factory.mktemp("classifier"), LABELS)


def reference_logits(model_dir, sequences) -> np.ndarray:
    model = Qwen3ForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return np.stack(
            [model(input_ids=torch.tensor([list(s)])).logits[0].numpy() for s in sequences]
        )


def test_logits_match_transformers(classifier):
    seqs = random_sequences([7, 30, 12], vocab_size=151000)
    expected = reference_logits(classifier, seqs)
    with Encoder.from_pretrained(classifier, dtype="float32", max_batch_tokens=32) as enc:
        assert enc.task == "classify" and enc.config.labels == LABELS
        logits = enc.classify(seqs)
        with pytest.raises(ValueError, match="task='classify'; 'embed' needs"):
            enc.embed(seqs)
    assert logits.shape == (3, 3) and np.abs(logits - expected).max() <= FP32_ABS
    assert np.ptp(expected) > 1e-2  # the texts really differ


def test_the_task_is_checked(classifier, tmp_path):
    with pytest.raises(ValueError, match="pooling must be 'last'"):
        Encoder.from_pretrained(classifier, pooling="mean")
    reranker = make_reranker(tmp_path, classifier=True)  # one label: a cross-encoder
    with pytest.raises(ValueError, match="task 'classify' needs .* several labels"):
        Encoder.from_pretrained(reranker, task="classify")


@pytest.fixture(scope="module")
def stack(classifier, tmp_path_factory):
    """(server, gateway base URL): the classifier as the embed model, fp32."""
    where = tmp_path_factory.mktemp("classify-serving")
    repo = render(where / "repo", {"embed": classifier}, {"encoder": {"dtype": "float32"}})
    with TritonServer(repo, log_path=where / "server.log") as server:
        with gateway_process(server, "--rerank-model-name", "") as base:
            yield server, base


def test_served_logits_and_teis_predict(stack, classifier):
    server, base = stack
    tok = Tokenizer.from_file(str(classifier / "tokenizer.json"))
    expected = reference_logits(classifier, [tok.encode(t).ids for t in TEXTS])
    probabilities = torch.softmax(torch.from_numpy(expected).double(), -1).numpy()
    with EmbeddingClient(server.grpc_url) as client:
        result = client.classify(TEXTS)
        with pytest.raises(Exception, match="per_token.*needs an embedding model"):
            client.embed_tokens(TEXTS[:1])
        with pytest.raises(Exception, match="chunk_size.*needs an embedding model"):
            client.embed_chunks(TEXTS[:1], chunk_size=2)
    assert result.labels == list(LABELS)
    assert np.abs(result.logits - expected).max() <= FP32_ABS
    assert np.abs(result.probabilities - probabilities).max() <= 1e-5
    # huggingface_hub's text_classification posts to / (the Inference API's shape)
    hub = InferenceClient(model=base)
    for text, want in zip(TEXTS, probabilities, strict=True):
        got = hub.text_classification(text)
        assert [g.label for g in got] == [LABELS[i] for i in np.argsort(-want)]
        assert np.abs(np.array([g.score for g in got]) - np.sort(want)[::-1]).max() <= 1e-5

    def predict(body):
        request = urllib.request.Request(
            f"{base}/predict", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.loads(r.read())

    single = predict({"inputs": TEXTS[0], "raw_scores": True})
    assert [p["label"] for p in single] == [LABELS[i] for i in np.argsort(-expected[0])]
    assert np.abs(np.sort(expected[0])[::-1] - [p["score"] for p in single]).max() <= FP32_ABS
    batch = predict({"inputs": TEXTS})
    assert len(batch) == len(TEXTS) and all(len(b) == len(LABELS) for b in batch)


def test_vllms_classify_and_pooling_routes(stack, classifier):
    """vLLM's /classify: per text the best label, the softmax of the logits (the logits with
    use_activation false); /pooling's task classify, the same probabilities."""
    _, base = stack
    tok = Tokenizer.from_file(str(classifier / "tokenizer.json"))
    expected = reference_logits(classifier, [tok.encode(t).ids for t in TEXTS])
    probabilities = torch.softmax(torch.from_numpy(expected).double(), -1).numpy()

    def post(path, body):
        request = urllib.request.Request(
            f"{base}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.loads(r.read())

    answer = post("/classify", {"model": "embed", "input": TEXTS})
    assert [d["label"] for d in answer["data"]] == [LABELS[i] for i in expected.argmax(1)]
    assert np.abs(np.array([d["probs"] for d in answer["data"]]) - probabilities).max() <= 1e-5
    assert {d["num_classes"] for d in answer["data"]} == {len(LABELS)}
    raw = post("/classify", {"model": "embed", "input": TEXTS, "use_activation": False})
    assert np.abs(np.array([d["probs"] for d in raw["data"]]) - expected).max() <= FP32_ABS
    pooled = post("/pooling", {"model": "embed", "input": TEXTS, "task": "classify"})
    assert np.abs(np.array([d["data"] for d in pooled["data"]]) - probabilities).max() <= 1e-5
    assert pooled["usage"]["total_tokens"] == answer["usage"]["total_tokens"] > 0


def test_labels_are_read_once_for_repeated_calls(stack):
    """classify names its columns from the encoder's `labels` fact: the two steps' configs are
    read once, not on every call (client.FACTS_TTL_S)."""
    server, _ = stack
    with EmbeddingClient(server.grpc_url) as client:
        reads, read = [], client._async.model_facts

        async def counted(model):
            reads.append(model)
            return await read(model)

        client._async.model_facts = counted
        results = [client.classify(TEXTS[:1]) for _ in range(3)]
    assert reads == ["tokenizer", "encoder"]
    assert all(r.labels == list(LABELS) for r in results)


def test_bad_input_to_a_classifier_is_refused_for_that_request(stack):
    """A chunked request names its field; a good request beside it is answered."""
    server, _ = stack
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="chunk_size"):
        client.infer("embed", [text_input(grpcclient, TEXTS[:1])], parameters={"chunk_size": 2})
    ok = client.infer("embed", [text_input(grpcclient, TEXTS)])
    assert ok.as_numpy("LOGITS").shape == (len(TEXTS), len(LABELS))
