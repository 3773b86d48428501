"""The client library against real tritonservers: order, splitting, usage, errors, retries,
cancellation, and one job spread over two servers of unequal speed."""

import asyncio

import numpy as np
import pytest

from qwen_embed_client import (
    AsyncEmbeddingClient,
    EmbeddingClient,
    EmbeddingError,
    deadline,
    metered,
)
from qwen_embed_client.client import DEADLINE_PASSED
from qwen_embed_client.scheduler import MIN_CHUNK, ServerState
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.triton import TritonServer, free_port, servers_together

from triton_helpers import encoder_kept_busy, infer, wait_until

pytestmark = pytest.mark.server  # starts tritonserver or other processes

TEXTS = [f"text {i}: " + "word " * (i % 13) for i in range(70)]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_split_concurrent_and_in_order(server, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    expected, counts = infer(server, TEXTS, "grpc")
    with EmbeddingClient(url, protocol=protocol, max_texts_per_request=16) as client:
        result = client.embed_with_usage(TEXTS)
        small = client.embed(TEXTS[:5], dimensions=32, prompt_name="query")
    assert result.embeddings.shape == (70, 1024)
    assert np.abs(result.embeddings - expected).max() <= 1e-4
    assert result.token_counts.tolist() == counts[:, 0].tolist()
    assert result.total_tokens == int(counts.sum())
    assert (
        np.abs(
            small - infer(server, TEXTS[:5], "grpc", dimensions=32, prompt_name="query")[0]
        ).max()
        <= 1e-4
    )


def test_server_error_is_raised_with_its_message_and_not_retried(server):
    def attempts():  # every attempt passes through the tokenizer step
        return server.metric("nv_inference_request_success", model="tokenizer")

    before = attempts()
    with EmbeddingClient(server.grpc_url, retry_deadline_s=30, backoff_s=5.0) as client:
        with pytest.raises(
            EmbeddingError, match=r"parameter 'dimensions' must be in 1\.\.1024"
        ) as e:
            client.embed(["x"], dimensions=5000)
        assert e.value.status == "StatusCode.INVALID_ARGUMENT" and not e.value.retryable
    # Triton counts the step's success once its response is released, which can come after
    # the client has the ensemble's error: waited for, then it must be the only attempt.
    wait_until(lambda: attempts() - before >= 1, "the tokenizer step's count")
    assert attempts() - before == 1  # sent once, never retried


def test_an_error_names_the_item_by_its_index_in_the_callers_list(server):
    """A refused text, document or token list in a later request of a split job is named at
    its place in what the caller sent, not in its Triton request."""
    texts = [f"text {i}" for i in range(10)]
    with EmbeddingClient(server.grpc_url, max_texts_per_request=4) as client:
        for call, item in [
            (lambda t: client.embed(t), "TEXT"),
            (lambda t: client.count_tokens(t), "TEXT"),  # the tokenizer step alone
            (lambda t: client.rerank("q", t), "DOCUMENTS"),
        ]:
            with pytest.raises(EmbeddingError, match=rf"'{item}\[6\]' is empty"):
                call(texts[:6] + [" "] + texts[7:])
        ids = [[1, 2, 151643]] * 9 + [[1, 10**7, 151643]]
        with pytest.raises(EmbeddingError, match=r"'TEXT\[9\]' holds token id 10000000 at 1"):
            client.embed(ids, token_ids=True)


def test_what_no_server_could_be_sent_is_refused_before_any_request(server):
    """Texts that are not strings (or not token lists with token_ids), or strings with a lone
    surrogate, which no UTF-8 request can carry, are refused by the client itself, named by
    their place in the caller's list: no request reaches the server."""

    def requests():
        return server.metric("nv_inference_request_success", model="tokenizer")

    before = requests()
    with EmbeddingClient(server.grpc_url) as client:
        calls = [
            (lambda: client.embed(None), TypeError, "texts must be a str or a list of str"),
            (lambda: client.embed(b"x"), TypeError, "texts must be a str or a list of str"),
            (lambda: client.embed([]), ValueError, "texts must not be empty"),
            (lambda: client.embed(["a", 5]), TypeError, r"texts\[1\] must be a str, got int"),
            (lambda: client.embed([[1, 2]]), TypeError, r"got list \(token ids go with token_"),
            (lambda: client.embed(["a", "b\ud800"]), ValueError, r"texts\[1\] is not valid UTF"),
            (lambda: client.embed(["a"], token_ids=True), TypeError, "list of token ids"),
            (lambda: client.count_tokens([None]), TypeError, r"texts\[0\] must be a str"),
            (lambda: client.embed_chunks([3], chunk_size=4), TypeError, r"texts\[0\] must be"),
            (lambda: client.rerank(None, ["a"]), TypeError, "query must be a str"),
            (lambda: client.rerank("\udfff", ["a"]), ValueError, "query is not valid UTF-8"),
            (lambda: client.rerank("q", ["a", None]), TypeError, r"documents\[1\] must be"),
        ]
        for call, error, message in calls:
            with pytest.raises(error, match=message):
                call()
        assert client.embed(("a", "b")).shape == (2, 1024)  # any iterable of strings
    assert requests() - before == 1  # the last call's


def test_unreachable_server_retries_then_fails():
    with EmbeddingClient(
        f"127.0.0.1:{free_port()}", retry_deadline_s=0.5, backoff_s=0.05, timeout=5
    ) as client:
        with pytest.raises(EmbeddingError) as e:
            client.embed(["x"])
    assert e.value.retryable


def test_dead_server_chunks_move_to_the_live_one(server):
    dead = f"127.0.0.1:{free_port()}"
    with EmbeddingClient(
        [dead, server.grpc_url], retry_deadline_s=0.5, backoff_s=0.05, max_texts_per_request=8
    ) as client:
        out = client.embed(TEXTS)
    assert np.abs(out - infer(server, TEXTS, "grpc")[0]).max() <= 1e-4


def test_async_cancel_returns_at_once_and_cancels_the_calls(server):
    """Cancelling the task cancels its gRPC calls at once, while the server is still busy.

    (Triton 2.51 does not pass an ensemble request's cancellation on to the composing encoder
    request, so through `embed` the server may still compute what was cancelled; requests sent
    straight to `encoder` are skipped: tests/test_triton_embed.py. What does reach the encoder
    is a request's timeout: the next test.)
    """

    def queued():  # the client's requests wait behind the long one
        return server.metric("nv_inference_pending_request_count", model="encoder")

    async def scenario():
        async with AsyncEmbeddingClient(server.grpc_url, max_texts_per_request=2) as client:
            task = asyncio.ensure_future(client.embed(TEXTS[:8]))
            while queued() < 1:
                await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    with encoder_kept_busy(server, 4.0) as busy:
        asyncio.run(scenario())
        # The cancelled task returned while the long request still ran: its calls were cut
        # short, not waited for.
        assert busy.thread.is_alive()
    with EmbeddingClient(server.grpc_url) as client:
        assert client.embed(["still fine"]).shape == (1, 1024)


def test_requests_outliving_the_callers_deadline_are_never_embedded(server):
    """Within deadline(), each request carries what is left as its Triton timeout, which the
    ensemble hands on to the encoder step: its queue drops the request once its caller has
    stopped waiting, so a busy server never computes it. Across tasks, retries included."""
    texts_before = server.metric("qwen_embed_texts_total")

    async def impatient(client, i):
        with deadline(0.3):
            return await client.embed([f"question {i}", f"another {i}"])

    async def scenario():
        async with AsyncEmbeddingClient(server.grpc_url, max_texts_per_request=1) as client:
            return await asyncio.gather(
                *[impatient(client, i) for i in range(4)], return_exceptions=True
            )

    with encoder_kept_busy(server, 4.0) as busy:
        outcomes = asyncio.run(scenario())
    assert all(isinstance(e, EmbeddingError) for e in outcomes), outcomes
    assert server.metric("qwen_embed_texts_total") - texts_before == busy.texts


def test_no_request_is_sent_once_the_deadline_has_passed():
    """Not sent, not retried: a server that is not there is never asked."""

    async def late():
        async with AsyncEmbeddingClient(f"127.0.0.1:{free_port()}", backoff_s=0.05) as client:
            with deadline(-1.0):
                await client.embed(["x"])

    with pytest.raises(EmbeddingError, match="deadline") as e:
        asyncio.run(late())
    assert e.value.status == DEADLINE_PASSED and not e.value.retryable
    with EmbeddingClient(f"127.0.0.1:{free_port()}", backoff_s=0.05) as client:
        with deadline(-1.0), pytest.raises(EmbeddingError, match="deadline") as e:
            client.embed(["x"])  # the blocking client, its loop on a thread of its own
    assert e.value.status == DEADLINE_PASSED


def test_metered_adds_each_models_tokens_across_the_calls_within(server):
    """metered(): each ensemble asked, with the tokens its answers ran (their usage), summed
    over the requests a call splits into (concurrent tasks) and over calls; tokenizer-only
    calls add nothing; a call the server refuses leaves its model at 0; the blocking client
    (its loop on a thread of its own) counts into the caller's; outside, nothing is kept."""
    documents = ["a document", "another, longer document about nothing"]

    async def calls():
        async with AsyncEmbeddingClient(server.grpc_url, max_texts_per_request=16) as client:
            with metered() as usage:
                embedded = await client.embed_with_usage(TEXTS)  # 5 concurrent requests
                await client.count_tokens(TEXTS)
                ranked = await client.rerank("a query", documents)
            with metered() as refused:
                with pytest.raises(EmbeddingError, match="dimensions"):
                    await client.embed(["x"], dimensions=5000)
            await client.embed(["outside"])  # no meter: nothing kept, nothing raised
            return usage, embedded.total_tokens, ranked.total_tokens, refused

    usage, embedded, ranked, refused = asyncio.run(calls())
    assert embedded == int(infer(server, TEXTS, "grpc")[1].sum())
    assert usage == {"embed": embedded, "rerank": ranked} and ranked > 0
    assert refused == {"embed": 0}
    with EmbeddingClient(server.grpc_url, max_texts_per_request=16) as client:
        with metered() as usage:
            tokens = client.embed_with_usage(TEXTS).total_tokens
    assert tokens == embedded and usage == {"embed": embedded}


def test_chunks_follow_each_servers_measured_speed():
    """The split policy on given measurements (perf/bench_load.py adaptive_split times it)."""
    fast, slow, fresh = ServerState(), ServerState(), ServerState()
    fast.record(texts=40, seconds=1.0)
    slow.record(texts=40, seconds=20.0)
    assert fresh.chunk_size(256, target_s=1.0) == MIN_CHUNK  # unmeasured: small first chunks
    assert fast.chunk_size(256, target_s=1.0) == 40
    assert slow.chunk_size(256, target_s=1.0) == MIN_CHUNK
    assert fast.chunk_size(16, target_s=1.0) == 16  # never past the request limit
    slow.record(texts=40, seconds=1.0)  # it got faster: the average follows
    assert slow.texts_per_s == pytest.approx(0.7 * 2 + 0.3 * 40)
    assert fast.texts_done == 40 and slow.texts_done == 80


def test_two_servers_share_a_job(demo_dir, tmp_path):
    """Two servers, each pinned to its own core (one runs each text alone): every text is
    embedded once, by one of them, and both servers' speeds are measured. (How many texts each
    gets follows their speeds: tested above on given measurements, which a real pair of
    servers gives only noisily.)"""
    texts = [f"document {i} " + "about many things " * 12 for i in range(96)]
    fast_repo = render(tmp_path / "fast-repo", {"embed": demo_dir})
    one_text = {"encoder": {"max_batch_tokens": "16"}}  # shorter than any text: one per forward
    slow_repo = render(tmp_path / "slow-repo", {"embed": demo_dir}, one_text)
    fast = TritonServer(fast_repo, log_path=tmp_path / "fast.log", cpus="0")
    slow = TritonServer(slow_repo, log_path=tmp_path / "slow.log", cpus="1")
    with servers_together(fast, slow):
        with EmbeddingClient([fast.grpc_url, slow.grpc_url], requests_in_flight=2) as client:
            client.embed(texts[:16])  # learn the speeds (kept for later calls)
            learned = client.stats()
            before = {u: s["texts_done"] for u, s in learned.items()}
            out = client.embed(texts)
            split = {u: s["texts_done"] - before[u] for u, s in client.stats().items()}
    print(f"split {split}; learned {learned}")
    assert out.shape == (96, 1024)
    assert all(s["texts_per_s"] > 0 for s in learned.values())
    assert sum(split.values()) == len(texts)
    assert set(split) == {fast.grpc_url, slow.grpc_url}
