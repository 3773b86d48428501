"""The `embed` ensemble on a real tritonserver (free ports, stopped after), over HTTP and gRPC.

Reference values: the in-process engine on the same tokenizer ids, and transformers'
Qwen3Model with last-token pooling (cosine >= 0.9999 in fp32).
"""

import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tokenizers import Tokenizer
from tritonclient.utils import InferenceServerException

from qwen_embed import Encoder
from qwen_embed_client.contract import DEFAULT_TASK, EMBEDDING_TYPES, PRIORITIES, compact
from qwen_embed_client.contract import EMBEDDING_OUTPUTS as OUTPUTS

from reference import cosine, reference_embeddings
from triton_helpers import (
    EXECUTING,
    encoder_input,
    encoder_kept_busy,
    infer,
    run_clients,
    text_input,
    wait_until,
)

pytestmark = pytest.mark.server  # starts tritonserver or other processes

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界！这是一个多语言测试。",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "こんにちは世界",
    "naïve café — emoji 🎉",
    "def f(x):\n    return x ** 2",
]
SERVING_COSINE = 0.9999
# Same engine, different batch composition: fp32 rounding only.
ENGINE_MAX_ABS = 1e-4
MAX_INPUT_TOKENS = 8192  # model_repository/tokenizer/config.pbtxt


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    return Tokenizer.from_file(str(demo_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def engine(demo_dir):
    with Encoder.from_pretrained(demo_dir, dtype="float32") as enc:
        yield enc


def metric_sum_count(server, name):
    return server.metric(name + "_sum", model="encoder"), server.metric(
        name + "_count", model="encoder"
    )


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_parity_with_engine_and_transformers(server, tokenizer, engine, demo_dir, protocol):
    vectors, counts = infer(server, TEXTS, protocol)
    ids = [e.ids for e in tokenizer.encode_batch(TEXTS)]
    assert counts.shape == (len(TEXTS), 1)
    assert counts[:, 0].tolist() == [len(x) for x in ids]
    assert all(x[-1] == 151643 for x in ids)  # the appended <|endoftext|> is counted
    assert vectors.shape == (len(TEXTS), 1024) and vectors.dtype == np.float32
    assert np.abs(vectors - engine.embed(ids)).max() <= ENGINE_MAX_ABS
    reference = reference_embeddings(demo_dir, ids)
    assert cosine(vectors, reference).min() >= SERVING_COSINE


def test_options(server, tokenizer, engine):
    ids = [e.ids for e in tokenizer.encode_batch(TEXTS[:3])]
    raw = engine.embed(ids, normalize=False)
    small, _ = infer(server, TEXTS[:3], dimensions=64)
    expected = raw[:, :64] / np.linalg.norm(raw[:, :64], axis=1, keepdims=True)
    assert small.shape == (3, 64) and np.abs(small - expected).max() <= ENGINE_MAX_ABS
    unnormalized, _ = infer(server, TEXTS[:3], "grpc", normalize=False)
    assert np.abs(unnormalized - raw).max() <= ENGINE_MAX_ABS * np.abs(raw).max()

    query, counts = infer(server, TEXTS[:1], prompt_name="query")
    prompted = tokenizer.encode(f"Instruct: {DEFAULT_TASK}\nQuery:{TEXTS[0]}").ids
    assert counts[0, 0] == len(prompted)
    assert np.abs(query - engine.embed([prompted])).max() <= ENGINE_MAX_ABS
    custom, counts = infer(server, TEXTS[:1], instruction="Find the greeting")
    assert counts[0, 0] == len(tokenizer.encode(f"Instruct: Find the greeting\nQuery:{TEXTS[0]}"))
    assert cosine(custom, query)[0] < 0.9999
    document, _ = infer(server, TEXTS[:1], prompt_name="document")
    assert np.abs(document - engine.embed(ids[:1])).max() <= ENGINE_MAX_ABS


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_compact_vectors(server, protocol):
    """Each embedding_type in its own output, the codes of the float vectors the same request
    gets without it (contract.compact, checked against its definition in test_compact.py);
    with dimensions, the codes of the truncated, renormalised vector."""
    module = httpclient if protocol == "http" else grpcclient
    url = server.http_url if protocol == "http" else server.grpc_url
    client = module.InferenceServerClient(url)
    for params in ({}, {"dimensions": 64}, {"dimensions": 13, "normalize": False}):
        floats, _ = infer(server, TEXTS[:3], protocol, **params)
        for embedding_type in EMBEDDING_TYPES:
            result = client.infer(
                "embed",
                [text_input(module, TEXTS[:3])],
                parameters={**params, "embedding_type": embedding_type},
            )
            name = OUTPUTS[embedding_type]
            codes = result.as_numpy(name)
            assert np.array_equal(codes, compact(floats, embedding_type)), (params, embedding_type)
            for other in set(OUTPUTS.values()) - {name}:
                assert result.as_numpy(other) is None  # left out of the response
    # Every type in one request: its texts embedded once (the encoder's own counter moves
    # before its answer leaves), each type's codes of the same vectors.
    before = server.metric("qwen_embed_texts_total", model="encoder")
    result = client.infer(
        "embed",
        [text_input(module, TEXTS[:3])],
        parameters={"dimensions": 64, "embedding_type": ",".join(EMBEDDING_TYPES)},
    )
    assert server.metric("qwen_embed_texts_total", model="encoder") - before == 3
    floats, _ = infer(server, TEXTS[:3], protocol, dimensions=64)
    for kind, name in OUTPUTS.items():
        assert np.array_equal(result.as_numpy(name), compact(floats, kind)), kind


@pytest.mark.parametrize("high", ["interactive", "bulk"])
def test_interactive_requests_overtake_queued_bulk_ones(server, high):
    """Bulk requests (Triton priority 2) queue up behind one executing; an interactive one
    (priority 1, the default) then completes before all of them (the next batch takes it
    first), while a bulk one in its place completes after them: by order of completion, not
    timing."""
    rng = np.random.default_rng(1)
    words = ["alpha", "river", "stone", "cloud", "seven", "market", "blue", "quiet", "engine"]
    # 256 texts (max_batch_size): one execute each, with no room to add the query beside them.
    texts = [" ".join(rng.choice(words, 12)) for _ in range(256)]
    finished = []

    def send(tag, batch, priority):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        level = PRIORITIES[priority]
        client.infer("embed", [text_input(grpcclient, batch)], priority=level, client_timeout=600)
        finished.append(tag)

    def pending():
        return server.metric("nv_inference_pending_request_count", model="encoder")

    def tokenized():
        return server.metric("nv_inference_request_success", model="tokenizer")

    threads = []
    before = tokenized()
    for i in range(5):
        batch = [f"{i} {t}" for t in texts]  # distinct: no response or prefix reuse
        threads.append(threading.Thread(target=send, args=(f"bulk{i}", batch, "bulk")))
        threads[-1].start()
    # Every bulk request past the tokenizer (so none can reach the encoder after the query),
    # and some of them queued behind the executing one.
    wait_until(
        lambda: tokenized() - before >= 5 and pending() >= 3,
        "bulk requests queued behind the executing one",
    )
    queued = 5 - len(finished)
    threads.append(threading.Thread(target=send, args=("query", ["a query"], high)))
    threads[-1].start()
    for t in threads:
        t.join(timeout=600)
    after = len(finished) - 1 - finished.index("query")
    if high == "interactive":  # at most the executing batch went first
        assert after >= queued - 2, finished
    else:
        assert after == 0, finished


def test_short_requests_are_answered_before_long_ones_of_the_same_execute(server):
    """A long request and short ones queue behind a busy encoder and reach one execute
    together; each short one is answered when its own (first) call ends, before the long one,
    not when the whole execute ends. By order of completion, not timing."""

    def send(tag, ids):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.infer("encoder", [encoder_input(ids)], client_timeout=600)
        finished.append(tag)

    finished = []
    # Over the token budget (16,384): calls of its own after the short ones.
    long_ids = [list(range(10 + i, 10 + i + 1000)) for i in range(17)]
    blocker = threading.Thread(target=send, args=("blocker", long_ids[:4]))
    blocker.start()
    wait_until(lambda: server.metric(EXECUTING) >= 1, "the blocker inside the encoder")
    threads = [threading.Thread(target=send, args=("long", [ids[::-1] for ids in long_ids]))]
    threads[0].start()
    wait_until(
        lambda: server.metric("nv_inference_pending_request_count", model="encoder") >= 1,
        "the long request queued",
    )
    for k in range(3):
        threads.append(threading.Thread(target=send, args=(f"short{k}", [[7 + k, 8, 9]])))
        threads[-1].start()
    wait_until(
        lambda: server.metric("nv_inference_pending_request_count", model="encoder") >= 4,
        "the short requests queued",
    )
    for t in [blocker, *threads]:
        t.join(timeout=600)
    assert finished[0] == "blocker" and finished[-1] == "long", finished


def test_truncation_keeps_endoftext(server, tokenizer):
    long_text = "word " * 9000
    n = len(tokenizer.encode(long_text).ids)
    assert n > MAX_INPUT_TOKENS
    message = rf"TEXT\[0\]' has {n} tokens, more than the limit of {MAX_INPUT_TOKENS}"
    with pytest.raises(InferenceServerException, match=message):
        infer(server, [long_text], truncate=False)
    vectors, counts = infer(server, [long_text, "short"])  # truncate defaults to true
    assert counts[:, 0].tolist() == [MAX_INPUT_TOKENS, 2]
    assert np.isfinite(vectors).all()


def test_256_texts_per_request(server):
    texts = [f"text number {i}" for i in range(256)]
    vectors, counts = infer(server, texts, "grpc", dimensions=32)
    assert vectors.shape == (256, 32) and counts.shape == (256, 1)


def test_aggregation_across_clients(server):
    before = metric_sum_count(server, "qwen_embed_encoder_requests_per_execute")

    def client(i):
        for j in range(6):
            infer(server, [f"client {i} request {j} text {k}" for k in range(4)], "grpc")

    run_clients(16, client)
    after = metric_sum_count(server, "qwen_embed_encoder_requests_per_execute")
    requests, executes = after[0] - before[0], after[1] - before[1]
    assert requests == 16 * 6
    print(f"{requests / executes:.1f} requests per encoder execute")
    assert requests / executes >= 4, f"{requests / executes:.1f} requests per execute"


def test_no_cross_talk(server, tokenizer, engine):
    rng = np.random.default_rng(0)
    plans = []
    for i in range(32):
        n = int(rng.integers(1, 9))
        texts = [
            f"client {i} says {' '.join(['hello'] * int(rng.integers(1, 40)))} #{k}"
            for k in range(n)
        ]
        params = {}
        if i % 3 == 0:
            params["dimensions"] = int(rng.integers(1, 1025))
        if i % 4 == 1:
            params["normalize"] = False
        plans.append((texts, params))
    results = [None] * 32

    def client(i):
        texts, params = plans[i]
        results[i] = infer(server, texts, "grpc" if i % 2 else "http", **params)

    run_clients(32, client)
    for (texts, params), (vectors, counts) in zip(plans, results, strict=True):
        ids = [e.ids for e in tokenizer.encode_batch(texts)]
        expected = engine.embed(
            ids, normalize=params.get("normalize", True), dimensions=params.get("dimensions")
        )
        assert counts[:, 0].tolist() == [len(x) for x in ids]
        assert vectors.shape == expected.shape
        assert np.abs(vectors - expected).max() <= ENGINE_MAX_ABS * max(1, np.abs(expected).max())


def test_bad_request_in_a_batch_leaves_good_ones_correct(server, tokenizer, engine):
    """Bad token ids sent straight to `encoder` share its batches with good ensemble requests."""
    ids = [e.ids for e in tokenizer.encode_batch(TEXTS)]
    expected = engine.embed(ids)
    bad_messages, good = [], []

    def client(i):
        if i % 2:
            good.append(np.abs(infer(server, TEXTS, "grpc")[0] - expected).max())
            return
        c = grpcclient.InferenceServerClient(server.grpc_url)
        inp = grpcclient.InferInput("TOKEN_IDS", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[np.array([5, 999999], "<i4").tobytes()]], object))
        try:
            c.infer("encoder", [inp])
        except InferenceServerException as e:
            bad_messages.append(e.message())

    run_clients(16, client)
    assert len(good) == 8 and max(good) <= ENGINE_MAX_ABS
    assert len(bad_messages) == 8
    assert all("outside 0..151668" in m for m in bad_messages), bad_messages[0]


def test_metrics_exposed(server):
    infer(server, TEXTS[:2])
    for name in (
        "qwen_embed_texts_total",
        "qwen_embed_tokens_total",
        "qwen_embed_encode_seconds_count",
        "qwen_embed_encoder_texts_per_execute_count",
        "qwen_embed_encoder_tokens_per_execute_count",
    ):
        assert server.metric(name) >= 1, name


def test_cancelled_requests_are_skipped(server):
    """Requests whose client gave up while the encoder was busy are never embedded."""
    texts_before = server.metric("qwen_embed_texts_total")
    with encoder_kept_busy(server, 4.0) as busy:

        def impatient(i):
            client = grpcclient.InferenceServerClient(server.grpc_url)
            with pytest.raises(InferenceServerException, match="Deadline"):
                client.infer("encoder", [encoder_input([[5, 6, 7]])], client_timeout=0.5)

        run_clients(4, impatient)
    # None of the 4 was embedded: Triton's dynamic batcher drops cancelled requests from the
    # encoder's queue before they reach execute().
    assert server.metric("qwen_embed_texts_total") - texts_before == busy.texts


def test_a_request_whose_timeout_runs_out_inside_an_execute_is_never_computed(server):
    """Queued together, a request whose Triton timeout runs out while an earlier call of the
    same execute runs is answered as one past its timeout, not computed (Triton's queue drops
    only those that time out while queued: this one waited less than its timeout there)."""

    def send(ids, **timeout):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.infer("encoder", [encoder_input(ids)], client_timeout=300, **timeout)

    def texts(count, first):  # distinct ids: no shared prefix makes a copy free
        return [list(range(first + 7 * i, first + 7 * i + 2000)) for i in range(count)]

    started = time.monotonic()
    send(texts(1, 100))
    one = time.monotonic() - started  # one text of 2000 tokens on this machine
    texts_before = server.metric("qwen_embed_texts_total")
    # The second request's timeout (2 x `one`) lies well inside what it waits for, on a host
    # whose speed moves between `one`'s measure and the execute: more than its queue wait
    # (the holder's, about 0.3 x `one`) and less than the first call (8 x `one`).
    holder = threading.Thread(target=send, args=([texts(1, 50)[0][:600]],))
    holder.start()  # an execute of about 0.3 x `one`, while the next two queue
    wait_until(lambda: server.metric(EXECUTING) >= 1, "the first request inside the encoder")
    first = threading.Thread(target=send, args=(texts(8, 1000),))  # its execute's first call
    first.start()
    late = []

    def second():  # more tokens, so the execute's second call; 2 x `one` to wait
        try:
            send(texts(9, 3000), timeout=int(2 * one * 1e6))
        except InferenceServerException as e:
            late.append(e.message())

    run_clients(1, lambda i: second())
    holder.join(timeout=120)
    first.join(timeout=120)
    assert late and "timeout expired before its turn" in late[0], late
    assert server.metric("qwen_embed_texts_total") - texts_before == 1 + 8


def test_one_query_requests_from_16_clients_hit_the_prefix_cache(server, tokenizer, demo_dir):
    """Each request is one query with the default instruction: the prefix is computed once and
    then served from the encoder's cache (segments.py); the vectors stay the reference's. A
    first request of two queries puts the prefix in the cache (computed once, in-batch), so
    every later one-query request can find it whatever the batcher groups."""
    queries = [f"question number {i}: what is {i} squared?" for i in range(32)]
    hits_before = server.metric("qwen_embed_prefix_cache_hits_total")
    computed_before = server.metric("qwen_embed_tokens_computed_total")
    received_before = server.metric("qwen_embed_tokens_total")
    first = infer(server, queries[:2], "grpc", prompt_name="query")[0]
    results = {0: first[0], 1: first[1]}

    def client(k):
        for i in range(2 + k, len(queries), 16):
            results[i] = infer(server, [queries[i]], "grpc", prompt_name="query")[0][0]

    run_clients(16, client)
    hits = server.metric("qwen_embed_prefix_cache_hits_total") - hits_before
    computed = server.metric("qwen_embed_tokens_computed_total") - computed_before
    received = server.metric("qwen_embed_tokens_total") - received_before
    assert hits >= len(queries) - 2, hits
    assert computed < 0.7 * received, (computed, received)
    assert server.metric("qwen_embed_prefix_cache_bytes") > 0
    ids = [
        e.ids
        for e in tokenizer.encode_batch([f"Instruct: {DEFAULT_TASK}\nQuery:{q}" for q in queries])
    ]
    reference = reference_embeddings(demo_dir, ids[:8])
    vectors = np.stack([results[i] for i in range(len(queries))])
    assert cosine(vectors[:8], reference).min() >= SERVING_COSINE
    with Encoder.from_pretrained(demo_dir, dtype="float32", prefix_reuse=False) as plain:
        assert np.abs(vectors - plain.embed(ids)).max() <= 1e-5


EOS_ID = 151643  # <|endoftext|>, what Qwen3-Embedding's tokenizer appends
DOCUMENT = (
    "Beijing is the capital of China. It has been the political centre of the country for "
    "most of the past eight centuries. The Great Wall runs across the hills north of the city. "
    "Its subway is one of the longest in the world."
)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_late_chunking(server, demo_dir, protocol):
    """chunk_size / chunk_spans: one vector per chunk, each the model's vector of the text cut
    after the chunk with the appended EOS (transformers, computed that way), and each chunk's
    characters; a chunk that ends the text gives the text's own vector."""
    module = httpclient if protocol == "http" else grpcclient
    url = server.http_url if protocol == "http" else server.grpc_url
    client = module.InferenceServerClient(url)
    texts = [DOCUMENT, "Gravity pulls things down."]
    result = client.infer("embed", [text_input(module, texts)], parameters={"chunk_size": 16})
    vectors, spans = result.as_numpy("CHUNK_EMBEDDING"), result.as_numpy("CHUNK_SPANS")
    assert result.as_numpy("EMBEDDING") is None
    tok = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    for i, text in enumerate(texts):
        ids = tok.encode(text, add_special_tokens=False).ids
        ends = list(range(16, len(ids), 16)) + [len(ids)]
        count = len(ends)
        assert (spans[i, count:] == -1).all() and not vectors[i, count:].any()
        chars = spans[i, :count]
        assert chars[0, 0] == 0 and chars[-1, 1] == len(text)
        assert "".join(text[a:b] for a, b in chars) == text  # contiguous chunks
        ref = reference_embeddings(demo_dir, [ids[:end] + [EOS_ID] for end in ends])
        assert cosine(vectors[i, :count], ref).min() >= 0.99999
        assert np.abs(vectors[i, :count] - ref).max() <= 1e-4
    whole, _ = infer(server, texts, protocol)
    for i in range(2):
        last = vectors[i, (spans[i, :, 0] >= 0).sum() - 1]
        assert np.abs(last - whole[i]).max() <= 1e-4
    # Spans given by the client, over the text's tokens (after the prompt), with options.
    params = {"chunk_spans": "[[0, 5], [3, 9]]", "prompt_name": "query", "dimensions": 32}
    result = client.infer("embed", [text_input(module, texts[:1])], parameters=params)
    vectors, spans = result.as_numpy("CHUNK_EMBEDDING"), result.as_numpy("CHUNK_SPANS")
    assert vectors.shape == (1, 2, 32) and np.allclose(np.linalg.norm(vectors, axis=2), 1)
    offsets = tok.encode(texts[0], add_special_tokens=False).offsets
    assert spans[0].tolist() == [[0, offsets[4][1]], [offsets[3][0], offsets[8][1]]]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"chunk_size": 0}, "parameter 'chunk_size' must be >= 1"),
        ({"chunk_size": 1}, r"cuts input 'TEXT\[0\]' \(\d+ tokens\) into \d+ chunks, more than "),
        ({"chunk_spans": "[[0, 5], [4, 5000]]"}, r"'chunk_spans'\[1\] = \[4, 5000\] goes past"),
        ({"chunk_spans": "[[3, 3]]"}, r"'chunk_spans'\[0\] = \[3, 3\] must have 0 <= start < end"),
        ({"chunk_spans": "0-5"}, "parameter 'chunk_spans' must be a JSON list"),
        ({"chunk_size": 8, "chunk_spans": "[[0, 1]]"}, "exclude each other"),
        ({"chunk_size": 8, "embedding_type": "int8"}, "must be 'float' with chunks"),
    ],
)
def test_bad_chunk_options_are_refused(server, params, message):
    text = " ".join(["word"] * 600)
    with pytest.raises(InferenceServerException, match=message):
        infer(server, [text], "grpc", **params)
