"""Triton adapter for qwen_embed.Encoder: TOKEN_IDS of many requests -> one varlen batch.

Parameter `task`: "embed" answers EMBEDDING [n, dim] (or the compact type's output; with the
tokenizer's CHUNKS, late chunking's CHUNK_EMBEDDING [n, chunks, dim]; with FINISH's per_token,
TOKEN_EMBEDDING [n, tokens, dim], each text's final hidden states (a multi-vector retriever's
projected, the only vectors it answers); with the tokenizer's MEDIA, a multimodal checkpoint's
texts with their images), or for a sequence classifier
(task "classify") LOGITS [n, labels]; "rerank" (the
rerank_encoder model, same file) answers SCORES [n] from the checkpoint's score head (with
MEDIA, of pairs with their images; for a listwise reranker, of a query's documents from its
blocks, one call per request)."""

import functools
import itertools
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from qwen_embed import Encoder, EncoderBroken
from qwen_embed.batch import finish, plan_requests
from qwen_embed.chunking import check_chunks
from qwen_embed.config import MULTI_VECTOR_ONLY
from qwen_embed.media import MediaText, Visual
from qwen_embed_client.contract import (
    ANSWER_TOO_LARGE,
    MAX_ANSWER_BYTES,
    RequestError,
    coded_outputs,
    read_finish,
    required,
    stack_ragged,
    unpack_chunks,
    unpack_ids,
    unpack_media,
)
from qwen_embed_deploy.host import answer_bytes_limit, shared_memory_bytes
from qwen_embed_deploy.placement import encoder_placement, instance_index, pin, read_topology
from qwen_embed_deploy.serving import videos
from qwen_embed_deploy.serving.config import (
    encoder_device,
    encoder_parameters,
    model_parameters,
    resolve_model_dir,
)
from qwen_embed_deploy.serving.images import ImageSettings, patchify

_NOT_EMBEDDING = "parameter '{}' needs an embedding model; this one is a sequence classifier"


def _error(message):
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG)
    )


class TritonPythonModel:
    def initialize(self, args):
        serving, settings = encoder_parameters(model_parameters(args))
        device = encoder_device(
            args.get("model_instance_kind", ""),
            args.get("model_instance_device_id", "0"),
            settings.device,
            settings.tp_size,
            torch.cuda.is_available(),
        )
        placement = None
        if device == "cpu" and settings.tp_size == 1 and serving.cpu_pinning != "off":
            # Before the first torch op: OpenMP starts its threads with this affinity.
            groups = json.loads(args["model_config"]).get("instance_group") or [{}]
            counts = [int(g.get("count", 1)) for g in groups]
            index = instance_index(args.get("model_instance_name", ""), counts)
            placement = encoder_placement(read_topology(), sum(counts), index)
            pin(placement)
        model_dir = resolve_model_dir(serving.model_dir, settings.task)
        self.encoder = Encoder.from_pretrained(model_dir, settings.replace(device=device))
        self.shared_bytes = shared_memory_bytes()
        self.answer_bytes = answer_bytes_limit(self.shared_bytes)
        self.task = self.encoder.task
        self.image_settings = ImageSettings.from_dir(model_dir)
        instance = args.get("model_instance_name", "")
        where = placement.describe() if placement else device
        pb_utils.Logger.log_info(f"{instance}: {self.encoder.route.describe()}; {where}")
        self.metrics = _Metrics(args["model_name"], self.encoder)
        self.metrics.set_route(instance, self.encoder.route, placement)
        # Calls are answered on a thread of their own, in order; every metric moves there too
        # (Triton 2.51's stub breaks when two threads update one metric at once).
        self.answering = ThreadPoolExecutor(max_workers=1, thread_name_prefix="answering")

    def execute(self, requests):
        """Plans and queues the requests' calls; each call's answers leave from the answering
        thread while the next call is planned and runs (docs/architecture.md). Returns once
        every request is answered: Triton fails only the requests of an execute in progress
        when its stub dies, so one returned unanswered would wait for its client's deadline."""
        answer = _Answers(requests, self.metrics, self.answering)
        try:
            self._execute(requests, answer)
        finally:
            answer.send_held()
            answer.last.exception()  # waits; its job logged any failure itself
        return [None] * len(requests)

    def _execute(self, requests, answer):
        deadlines = _Deadlines(requests)
        accepted = []  # (index, options, token ids), their calls' texts in any forward
        adapters = {}  # index -> the adapter it names (lora_modules; absent: none)
        chunked = []  # (index, options, chunked texts): late chunking, one call each
        per_token = []  # (index, options, token id arrays): every token's vector
        with_media = []  # (index, options, media.MediaText): texts with images, one call
        listwise = []  # (index, None, blocks): a listwise reranker's query, one call each
        # No is_cancelled() here (a message to Triton per request): Triton's dynamic batcher
        # drops requests cancelled while queued, and does not pass an ensemble request's
        # cancellation on to this step.
        for i, request in enumerate(requests):
            try:
                opts = self._finish(request)
                adapter = self._adapter(request)
                if adapter is not None:  # read only for the calls it joins
                    adapters[i] = adapter
                blobs = required(
                    pb_utils.get_input_tensor_by_name(request, "TOKEN_IDS"), "TOKEN_IDS"
                )
                if self.encoder.config.listwise:
                    listwise.append((i, None, self._blocks(blobs.reshape(-1))))
                    continue
                seqs = self.encoder.check_sequences(
                    [unpack_ids(b, j) for j, b in enumerate(blobs.reshape(-1))]
                )
                chunks = self._chunks(request, seqs)
                if chunks is not None and self.task != "embed":
                    chunking = "chunk_size', 'chunk_spans' or 'chunk_chars"
                    raise RequestError(_NOT_EMBEDDING.format(chunking))
                self._check_answer_bytes(opts, seqs, chunks)
                media = self._media(request, seqs)
            except ValueError as e:  # RequestError is one; check_sequences raises the others
                answer(i, _error(str(e)))
                continue
            if opts is not None and opts.per_token:
                per_token.append((i, opts, seqs if media is None else media))
            elif media is not None:
                with_media.append((i, opts, media))
            elif chunks is not None:
                chunked.append((i, opts, chunks))
            else:
                accepted.append((i, opts, seqs))
        if not accepted and not chunked and not per_token and not with_media and not listwise:
            return
        unanswered = {i for i, _, _ in accepted + chunked + per_token + with_media + listwise}
        # Every metric moves before the answers it covers leave (_Answers.send calls
        # metrics.flush): a client that reads the metrics after its response sees its request.
        lengths = [len(s) for _, _, seqs in accepted for s in seqs]
        lengths += [len(getattr(t, "ids", t)) for _, _, texts in per_token for t in texts]
        lengths += [len(t.ids) for _, _, texts in chunked + with_media for t in texts]
        lengths += [len(b.ids) for _, _, blocks in listwise for b in blocks]
        requests_in = len(accepted) + len(chunked) + len(per_token) + len(with_media)
        requests_in += len(listwise)
        answer.later(self.metrics.observe_batch, requests_in, lengths)

        def call(members, compute, outputs):
            """Where a member names an adapter, `compute(texts, adapter=...)` with each text's
            (a forward adds each text's own: lora.py)."""
            members = _in_time(members, deadlines, answer, unanswered)
            if not members:
                return
            names = None
            if any(i in adapters for i, _, _ in members):
                names = [adapters.get(i) for i, _, texts in members for _ in texts]
                compute = functools.partial(compute, adapter=names)
            self._call(members, compute, outputs, answer, unanswered, names)

        chunk_rows = functools.partial(self._ragged_outputs, "CHUNK_EMBEDDING")
        try:
            # Calls of whole requests, fewest tokens first (batch.plan_requests), whatever
            # adapters they name.
            tokens = [sum(len(s) for s in seqs) for _, _, seqs in accepted]
            for group in plan_requests(tokens, self.encoder.max_batch_tokens):
                call([accepted[g] for g in group], self.encoder.launch_checked, self._outputs)
            for member in chunked:  # one call each
                call([member], _computed(self.encoder.pool_chunks_checked), chunk_rows)
            if per_token:  # one call: its forwards planned by the token budget together
                states = _computed(self.encoder.token_states_checked)
                call(per_token, states, self._token_outputs)
            if with_media:  # one call: the vision tower runs once per forward's images
                call(with_media, _computed(self._encode_media), self._outputs)
            for member in listwise:  # one call each: a query's blocks are scored together
                call([member], _computed(self.encoder.rank_blocks_checked), _scores)
        except EncoderBroken as e:
            self._broken(str(e), sorted(unanswered), answer)
        except Exception as e:  # every request still gets its one response
            pb_utils.Logger.log_error(f"encoder execute failed: {type(e).__name__}: {e}")
            error = pb_utils.TritonError(f"{type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL)
            for i in sorted(unanswered):
                answer(i, pb_utils.InferenceResponse(error=error))

    def _call(self, members, launch, outputs, answer, unanswered, adapters=None):
        """One call over the texts of `members` ((index, options, texts)): `launch(texts)`
        queues their forwards (its `result()`: their rows in order), `outputs(rows, members)`
        gives each member's output tensors on the answering thread, which answers the call's
        requests as soon as its rows are read. `adapters`: each text's (None: none; counted
        apart)."""
        answer.send_held()  # what is answered already never waits for this call
        texts = [t for _, _, texts in members for t in texts]
        started = time.perf_counter()
        pending = launch(texts)
        call = (members, texts, adapters)
        answer.later(self._answer_call, call, pending, outputs, started, answer)
        unanswered.difference_update(i for i, _, _ in members)

    def _answer_call(self, call, pending, outputs, started, answer):
        """On the answering thread: a call's ((members, their texts, adapters)) rows read,
        counted, and its requests answered (an INTERNAL error each if the rows or outputs
        fail)."""
        members, texts, adapters = call
        try:
            rows = pending.result()
            self.metrics.seconds.observe(time.perf_counter() - started)
            self.metrics.add_call([getattr(t, "ids", t) for t in texts], adapters)
            responses = [
                pb_utils.InferenceResponse(output_tensors=t) for t in outputs(rows, members)
            ]
        except Exception as e:
            pb_utils.Logger.log_error(f"encoder call failed: {type(e).__name__}: {e}")
            error = pb_utils.TritonError(f"{type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL)
            responses = [pb_utils.InferenceResponse(error=error) for _ in members]
        answer.send([(i, r) for (i, _, _), r in zip(members, responses, strict=True)])

    def _encode_media(self, texts, adapter=None):
        if self.task == "rerank":
            return self.encoder.score_media_checked(texts, adapter)
        return self.encoder.pool_media_checked(texts, adapter)

    def _broken(self, message, unanswered, answer):
        """A tensor-parallel group failed: answer this batch, then end the stub so that the
        launcher's watchdog loads the model again (a stub that stayed up would fail every
        request while Triton reports it ready)."""
        pb_utils.Logger.log_error(f"{message}; exiting for a reload")
        threading.Timer(1.0, os._exit, args=(1,)).start()  # after these responses leave
        error = pb_utils.TritonError(message, pb_utils.TritonError.UNAVAILABLE)
        for i in unanswered:
            answer(i, pb_utils.InferenceResponse(error=error))

    def _finish(self, request):
        """The request's contract.Finish from the tokenizer's FINISH rows; request parameters
        were checked there and are not read again."""
        if self.task == "rerank":
            return None
        rows = pb_utils.get_input_tensor_by_name(request, "FINISH")
        pooled, tokens = self.encoder.embedding_size, self.encoder.config.token_size
        finish = read_finish(None if rows is None else rows.as_numpy(), max(pooled, tokens))
        if self.task == "classify":  # logits: nothing to finish
            if finish.per_token:
                raise RequestError(_NOT_EMBEDDING.format("per_token"))
            return None
        if self.encoder.config.multi_vector and not finish.per_token:
            raise RequestError(MULTI_VECTOR_ONLY)
        limit = tokens if finish.per_token else pooled
        if (finish.dimensions or 0) > limit:
            what = "per-token vectors" if finish.per_token else "vectors"
            raise RequestError(
                f"parameter 'dimensions' must be in 1..{limit} for this model's {what}, "
                f"got {finish.dimensions}"
            )
        return finish

    def _adapter(self, request):
        """The adapter the request names (the tokenizer's ADAPTER rows), checked against the
        ones served; None: none."""
        tensor = pb_utils.get_input_tensor_by_name(request, "ADAPTER")
        names = set() if tensor is None else set(tensor.as_numpy().reshape(-1).tolist())
        if len(names) > 1:
            raise RequestError("input 'ADAPTER' must hold the same adapter for every text")
        name = names.pop().decode("utf-8", "replace") if names else ""
        if not name:
            return None
        self.encoder.adapter_index(name)  # ValueError naming the ones served
        return name

    def _check_answer_bytes(self, opts, seqs, chunks):
        """A per_token or chunks answer is [texts, most rows, dimensions] float32: refused
        past what one request may return here, before any work."""
        dims = None if opts is None else opts.dimensions
        if opts is not None and opts.per_token:
            what, unit, rows = "parameter 'per_token'", "tokens", max(map(len, seqs))
            dims = dims or self.encoder.config.token_size
        elif chunks is not None:
            what, unit, rows = "late chunking", "chunks", max(len(c.spans) for c in chunks)
            dims = dims or self.encoder.embedding_size
        else:
            return
        texts = len(seqs)
        size = texts * rows * dims * 4
        if size > self.answer_bytes:
            here = ""
            if self.answer_bytes < MAX_ANSWER_BYTES:  # the server's, not the request's
                here = f" on this server (a quarter of its /dev/shm, {self.shared_bytes >> 20} MiB)"
            raise RequestError(
                f"{what}: {texts} texts of up to {rows} {unit} x {dims} dimensions are "
                f"{size / 2**20:.1f} MiB of float32, more than the {self.answer_bytes >> 20} MiB "
                f"{ANSWER_TOO_LARGE}{here}; send fewer texts, or fewer dimensions"
            )

    def _chunks(self, request, seqs):
        """Late chunking's texts (chunking.ChunkedText) when the tokenizer sent chunks."""
        tensor = pb_utils.get_input_tensor_by_name(request, "CHUNKS")
        blobs = [] if tensor is None else tensor.as_numpy().reshape(-1)
        parsed = [unpack_chunks(b, j) for j, b in enumerate(blobs)]
        if not any(p is not None for p in parsed):
            return None
        if len(parsed) != len(seqs) or any(p is None for p in parsed):
            raise ValueError("input 'CHUNKS' must hold chunks for every text of the request")
        return [
            check_chunks(j, seq, spans, tail)
            for j, (seq, (tail, spans)) in enumerate(zip(seqs, parsed, strict=True))
        ]

    def _blocks(self, blobs):
        """A listwise reranker's blocks: one row per document, each block's sequence on its
        first document's row and nothing on the others (serving/listwise.py)."""
        blocks = self.encoder.check_blocks(
            self.encoder.check_sequences(
                [unpack_ids(b, j) for j, b in enumerate(blobs) if len(b) or j == 0]
            )
        )
        documents = sum(len(b.spans) - 1 for b in blocks)
        if documents != len(blobs):
            raise RequestError(
                f"input 'TOKEN_IDS' holds {len(blobs)} rows for {documents} documents' markers"
            )
        return blocks

    def _media(self, request, seqs):
        """The texts with their images and videos (media.MediaText) when the tokenizer sent
        any: an image's pixels [h, w, 3], a video's [frames, h, w, 3] (contract.pack_media)."""
        tensor = pb_utils.get_input_tensor_by_name(request, "MEDIA")
        blobs = [] if tensor is None else tensor.as_numpy().reshape(-1)
        images = [unpack_media(b, j) for j, b in enumerate(blobs)]
        if not any(images):
            return None
        if self.task == "classify" or len(images) != len(seqs):
            raise RequestError(
                "input 'MEDIA' needs an embedding model or a reranker, and one element per text"
            )
        visuals = [[self._visual(rgb) for rgb in im] for im in images]
        texts = [MediaText(seq, tuple(v)) for seq, v in zip(seqs, visuals, strict=True)]
        return self.encoder.check_visuals(texts)  # the ids were checked with the others

    def _visual(self, rgb):
        if rgb.ndim == 4:
            return Visual(*videos.patchify(rgb, self.image_settings), video=True)
        return Visual(*patchify(rgb, self.image_settings))

    def _ragged_outputs(self, name, rows, members):
        """Per-text vectors (chunks', tokens') -> each member's [n, most rows, dim], each
        finished with the request's options, zeros past a text's own."""
        outputs = []
        for start, stop, opts in _spans(members):
            finished = [
                finish(torch.from_numpy(p), normalize=opts.normalize, dimensions=opts.dimensions)
                for p in rows[start:stop]
            ]
            ragged = stack_ragged([f.numpy() for f in finished], 0.0, np.float32)
            outputs.append([pb_utils.Tensor(name, ragged)])
        return outputs

    def _token_outputs(self, rows, members):
        """Per-token vectors as _ragged_outputs gives them (a MultiVectorEncoder's skiplist's
        left out where a request's FINISH says), with each text's count of them
        (TOKEN_ROWS)."""
        kept = []
        for (start, stop, opts), (_, _, texts) in zip(_spans(members), members, strict=True):
            states = rows[start:stop]
            kept += self.encoder.without_skiplist(states, texts) if opts.skiplist else states
        outputs = self._ragged_outputs("TOKEN_EMBEDDING", kept, members)
        for tensors, (start, stop, _) in zip(outputs, _spans(members), strict=True):
            counts = np.array([[len(s)] for s in kept[start:stop]], dtype=np.int32)
            tensors.append(pb_utils.Tensor("TOKEN_ROWS", counts))
        return outputs

    def _outputs(self, rows, members):
        """Each member's output tensors from the call's rows [texts, ...]."""
        spans = _spans(members)
        if self.task == "rerank":
            return [[pb_utils.Tensor("SCORES", rows[a:b].reshape(-1, 1))] for a, b, _ in spans]
        if self.task == "classify":
            return [[pb_utils.Tensor("LOGITS", rows[a:b])] for a, b, _ in spans]
        # Matryoshka truncation and normalisation with each request's options, in one op over
        # each run of requests that share them (torch's per-op cost would otherwise be paid
        # per request); then the compact codes each asked for, in their own output only.
        outputs = []
        for (normalize, dimensions), run in itertools.groupby(spans, key=_finishing):
            run = list(run)
            first, last = run[0][0], run[-1][1]
            done = finish(
                torch.from_numpy(rows[first:last]), normalize=normalize, dimensions=dimensions
            )
            done = done.contiguous().numpy()
            for start, stop, opts in run:
                codes = coded_outputs(done[start - first : stop - first], opts.embedding_types)
                outputs.append([pb_utils.Tensor(name, array) for name, array in codes.items()])
        return outputs

    def finalize(self):
        self.answering.shutdown(wait=True)
        self.metrics.close()
        self.encoder.close()


def _scores(rows, members):
    """A listwise call's one member: its documents' scores."""
    return [[pb_utils.Tensor("SCORES", rows.reshape(-1, 1))]]


def _spans(members):
    """(start, stop, options) of each member ((index, options, texts)) in its call's rows."""
    spans, start = [], 0
    for _, opts, texts in members:
        spans.append((start, start + len(texts), opts))
        start += len(texts)
    return spans


def _finishing(span):
    """How a span's rows are finished: (normalize, dimensions)."""
    return span[2].normalize, span[2].dimensions


def _in_time(members, deadlines, answer, unanswered):
    """The members whose callers may still wait; the others are answered as Triton's queue
    answers a request past its timeout, and not computed."""
    late = {i for i, _, _ in members if deadlines.passed(i)}
    for i in sorted(late):
        error = pb_utils.TritonError(
            "Request timeout expired before its turn in the encoder's execute",
            pb_utils.TritonError.UNAVAILABLE,
        )
        answer(i, pb_utils.InferenceResponse(error=error))
        unanswered.discard(i)
    return [m for m in members if m[0] not in late]


class _Deadlines:
    """When each request's caller has surely stopped waiting: its Triton timeout (which the
    client library and the gateway set to the caller's wait, and an ensemble hands on to this
    step) counted from this execute's start, as its time in the queue is not known here. The
    queue drops a request past it; this catches those whose time runs out while earlier calls
    of the same execute run. No timeout: none."""

    def __init__(self, requests):
        started = time.monotonic()
        timeouts = [r.timeout() for r in requests]  # us, 0: none
        self._until = [started + t / 1e6 if t else None for t in timeouts]

    def passed(self, i):
        until = self._until[i]
        return until is not None and time.monotonic() > until


class _Answers:
    """One execute's answers, each sent through its request's sender on the answering thread
    (`thread`, one worker: jobs run in order), after the metrics that cover it moved.
    `answer(i, response)` on the execute's thread holds request i's response until
    `send_held()`, called before each call's work starts and at the end; `later(job, ...)`
    queues a job on the answering thread (`last`: the latest's future)."""

    def __init__(self, requests, metrics, thread):
        self._senders = [r.get_response_sender() for r in requests]
        self._metrics = metrics
        self._thread = thread
        self._held = []
        self.last = None
        self.later(metrics.executing.increment, len(requests))

    def __call__(self, i, response):
        self._held.append((i, response))

    def send_held(self):
        if self._held:
            self.later(self.send, self._held)
            self._held = []

    def later(self, job, *args):
        self.last = self._thread.submit(_logged, job, *args)

    def send(self, answers):
        """On the answering thread: (index, response) pairs sent, once the metrics moved. One
        that cannot be sent (more than this stub's shared memory can hold: _check_answer_bytes
        bounds them) is logged, and the next ones still leave (its sender takes no second
        response)."""
        self._metrics.answered += len(answers)
        self._metrics.flush()
        for i, response in answers:
            try:
                self._senders[i].send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except pb_utils.TritonModelException as e:
                pb_utils.Logger.log_error(f"encoder: an answer could not be sent: {e}")


def _logged(job, *args):
    """A job of the answering thread; a failure is logged (nothing waits for its result)."""
    try:
        job(*args)
    except Exception as e:
        pb_utils.Logger.log_error(f"encoder answering failed: {type(e).__name__}: {e}")


class _Computed:
    """A call's rows computed already (the calls whose forwards are not queued ahead)."""

    def __init__(self, rows):
        self._rows = rows

    def result(self):
        return self._rows


def _computed(compute):
    """`compute(texts, ...)` as a launch: its rows wrapped to be read like queued ones."""
    return lambda *args, **kwargs: _Computed(compute(*args, **kwargs))


class _Metrics:
    """Per-execute batch shape and encode time, on Triton's metrics port."""

    BUCKETS = {
        "requests": [1, 2, 4, 8, 16, 32, 64, 128],
        "texts": [1, 4, 16, 64, 256, 1024],
        "tokens": [64, 256, 1024, 4096, 16384, 65536],
    }

    def __init__(self, model_name, encoder):
        self.model = model_name
        labels = {"model": model_name}
        self.families = []  # a MetricFamily must outlive its Metric objects
        self.histograms = {}
        for what, buckets in self.BUCKETS.items():
            family = pb_utils.MetricFamily(
                name=f"qwen_embed_encoder_{what}_per_execute",
                description=f"{what} handled by one encoder execute()",
                kind=pb_utils.MetricFamily.HISTOGRAM,
            )
            self.families.append(family)
            self.histograms[what] = family.Metric(labels=labels, buckets=buckets)
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        self.texts = self._metric("qwen_embed_texts_total", "texts embedded", counter)
        self.tokens = self._metric("qwen_embed_tokens_total", "tokens embedded", counter)
        self.seconds = self._metric(
            "qwen_embed_encode_seconds",
            "time in the encoder forward and pooling, per call (calls of whole requests)",
            pb_utils.MetricFamily.HISTOGRAM,
            buckets=[0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30],
        )
        self.executing = self._metric(
            "qwen_embed_executing_requests",
            "requests an encoder execute() received and has not answered yet",
            gauge,
        )
        self.computed = self._metric(
            "qwen_embed_tokens_computed_total",
            "tokens the forwards computed (fewer than received when prefixes are shared)",
            counter,
        )
        self.hits = self._metric(
            "qwen_embed_prefix_cache_hits_total",
            "sequences whose prefix came from the cache",
            counter,
        )
        self.lookups = self._metric(
            "qwen_embed_prefix_cache_lookups_total",
            "sequences looked up in the prefix cache",
            counter,
        )
        self.cache_bytes = self._metric(
            "qwen_embed_prefix_cache_bytes", "keys/values held by the prefix cache", gauge
        )
        # per adapter a request names (lora_modules): what each fine-tune served
        self.by_adapter = {}
        for what in ("texts", "tokens"):
            family = pb_utils.MetricFamily(
                name=f"qwen_embed_adapter_{what}_total",
                description=f"{what} embedded with each adapter (lora_modules)",
                kind=counter,
            )
            self.families.append(family)
            for name in encoder.adapters:
                labels = {"model": model_name, "adapter": name}
                self.by_adapter[what, name] = family.Metric(labels=labels)
        self.encoder = encoder
        self._pending = {"texts": 0, "tokens": 0}  # counted by calls, not sent yet
        self._pending_by_adapter = dict.fromkeys(self.by_adapter, 0)
        self._sent = {"computed": 0, "hits": 0, "lookups": 0, "cache_bytes": 0}
        self.answered = 0  # requests answered since the last flush (leaving `executing`)
        self.route = pb_utils.MetricFamily(
            name="qwen_embed_encoder_route",
            description="1, labelled with the arithmetic route and the cores of each instance",
            kind=gauge,
        )
        self.families.append(self.route)

    def close(self):
        """Frees the metrics, then their families, while the stub runs: a family freed by the
        stub's own teardown segfaults it (triton-inference-server/server#8662)."""
        families = self.families
        vars(self).clear()  # every Metric's last reference; the families' but this list
        families.clear()

    def _metric(self, name, description, kind, **kwargs):
        family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
        self.families.append(family)
        return family.Metric(labels={"model": self.model}, **kwargs)

    def set_route(self, instance, route, placement):
        threads = placement.threads if placement else torch.get_num_threads()
        labels = {
            "model": self.model,
            "instance": instance,
            **route.labels(),
            "cpus": ",".join(map(str, placement.cpus)) if placement else "",
            "threads": str(threads),
        }
        self.route_gauge = self.route.Metric(labels=labels)
        self.route_gauge.set(1)

    def add_call(self, seqs, adapters=None):
        """A call's texts and tokens (`adapters`: each text's, None: none), sent by the next
        flush()."""
        self._pending["texts"] += len(seqs)
        self._pending["tokens"] += int(sum(len(s) for s in seqs))
        for seq, adapter in zip(seqs, adapters, strict=True) if adapters else ():
            if adapter is not None:
                self._pending_by_adapter["texts", adapter] += 1
                self._pending_by_adapter["tokens", adapter] += len(seq)

    def flush(self):
        """What moved since the last flush, a message to Triton each; nothing for what did not
        (each pb_utils metric call is a round trip). The engine's are running totals."""
        if self.answered:
            self.executing.increment(-self.answered)
            self.answered = 0
        for name, count in self._pending.items():
            if count:
                getattr(self, name).increment(count)
                self._pending[name] = 0
        for key, count in self._pending_by_adapter.items():
            if count:
                self.by_adapter[key].increment(count)
                self._pending_by_adapter[key] = 0
        cache = self.encoder.prefix_cache
        totals = {
            "computed": self.encoder.stats["computed_tokens"],
            "hits": cache.hits,
            "lookups": cache.lookups,
        }
        for name, total in totals.items():
            if total != self._sent[name]:
                getattr(self, name).increment(total - self._sent[name])
                self._sent[name] = total
        if cache.bytes_in_use != self._sent["cache_bytes"]:
            self.cache_bytes.set(cache.bytes_in_use)
            self._sent["cache_bytes"] = cache.bytes_in_use

    def observe_batch(self, num_requests, lengths):
        """The shape of one execute: its requests, and its texts' lengths."""
        self.histograms["requests"].observe(num_requests)
        self.histograms["texts"].observe(len(lengths))
        self.histograms["tokens"].observe(int(sum(lengths)))
