"""Triton adapter for the tokenizer step of both ensembles (parameter `task`):
embed: TEXT -> TOKEN_IDS, TOKEN_COUNT (qwen_embed.serving.tokenizer);
rerank: QUERY + DOCUMENTS -> one templated pair per document (qwen_embed.serving.rerank)."""

import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from qwen_embed import ModelConfig
from qwen_embed.host import gpu_count
from qwen_embed.placement import read_topology, tokenizer_placement
from qwen_embed.serving.config import model_parameters, resolve_model_dir
from qwen_embed.serving.requests import (
    RequestError,
    decode_texts,
    finish_rows,
    pack_chunks,
    pack_ids,
    parse_options,
    stack_ragged,
)
from qwen_embed.serving.rerank import PairTokenizer, parse_rerank_options
from qwen_embed.serving.tokenizer import TextTokenizer


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        # On machines with a core to spare, tokenizers keep off the CPU encoders' cores.
        spare = tokenizer_placement(read_topology(), gpu_count())
        if spare is not None and params.get("cpu_pinning", "auto") != "off":
            os.sched_setaffinity(0, spare.cpus)
        self.task = params.get("task") or "embed"
        model_dir = resolve_model_dir(params.get("model_dir", ""), self.task)
        config = ModelConfig.from_dir(model_dir)
        self.hidden_size = config.hidden_size
        self.max_texts = int(params.get("max_texts_per_request") or 256)
        self.max_text_bytes = int(params.get("max_text_bytes") or 262144)
        # The model's positions unless the deployment sets fewer; never more: the encoder
        # would refuse what we let through.
        positions = config.max_position_embeddings
        max_tokens = min(int(params.get("max_input_tokens") or positions), positions)
        if self.task == "rerank":
            self.tokenizer = PairTokenizer(model_dir, max_tokens)
            self._tokenize = self._pairs
        else:
            direction = params.get("truncation_direction") or "right"
            self.tokenizer = TextTokenizer(model_dir, max_tokens, direction)
            self._tokenize = self._texts
            self._publish_prompts(args["model_name"], self.tokenizer.prompts)
        # Kept on self: a MetricFamily must outlive its Metric.
        self.seconds_family = pb_utils.MetricFamily(
            name="qwen_embed_tokenize_seconds",
            description="time to tokenize the requests of one tokenizer execute()",
            kind=pb_utils.MetricFamily.HISTOGRAM,
        )
        self.seconds = self.seconds_family.Metric(
            labels={"model": args["model_name"]}, buckets=[0.001, 0.005, 0.02, 0.1, 0.5, 2]
        )

    def execute(self, requests):
        start = time.perf_counter()
        responses = [self._one(request) for request in requests]
        self.seconds.observe(time.perf_counter() - start)
        return responses

    def _publish_prompts(self, model_name, prompts):
        """The checkpoint's prompt names, for `qwen-embed info` and the gateway's /v1/models."""
        self.prompts_family = pb_utils.MetricFamily(
            name="qwen_embed_prompts",
            description="1, labelled with the prompt names of the checkpoint and its default",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        labels = {
            "model": model_name,
            "names": ",".join(prompts.names),
            "default": prompts.default_name or "",
        }
        self.prompts_gauge = self.prompts_family.Metric(labels=labels)
        self.prompts_gauge.set(1)

    def _texts(self, request, params):
        opts = parse_options(params, self.hidden_size, self.tokenizer.prompts)
        raw = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
        texts = decode_texts(raw, self.max_texts, self.max_text_bytes)
        finish = pb_utils.Tensor("FINISH", finish_rows(opts, len(texts)))
        if not opts.chunked:  # CHUNKS is always sent: the encoder step waits for it
            ids = self.tokenizer.encode(texts, opts)
            none = np.array([[b""]] * len(ids), dtype=np.object_)
            return ids, [finish, pb_utils.Tensor("CHUNKS", none)]
        ids, chunks = self.tokenizer.encode_chunks(texts, opts)
        packed = np.array([[pack_chunks(c.tail, c.tokens)] for c in chunks], dtype=np.object_)
        # Characters of each chunk, -1 past a text's own chunks.
        spans = stack_ragged([c.chars for c in chunks], -1, np.int32)
        return ids, [
            finish,
            pb_utils.Tensor("CHUNKS", packed),
            pb_utils.Tensor("CHUNK_SPANS", spans),
        ]

    def _pairs(self, request, params):
        opts = parse_rerank_options(params)
        raw = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy()
        (query,) = decode_texts(raw, 1, self.max_text_bytes, name="QUERY")  # exactly one
        raw = pb_utils.get_input_tensor_by_name(request, "DOCUMENTS").as_numpy()
        documents = decode_texts(raw, self.max_texts, self.max_text_bytes, name="DOCUMENTS")
        return self.tokenizer.encode(query, documents, opts), []

    def _one(self, request):
        try:
            ids, extra = self._tokenize(request, json.loads(request.parameters() or "{}"))
        except RequestError as e:
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
            )
        packed = np.array([[pack_ids(x)] for x in ids], dtype=np.object_)
        counts = np.array([[len(x)] for x in ids], dtype=np.int32)
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("TOKEN_IDS", packed),
                pb_utils.Tensor("TOKEN_COUNT", counts),
                *extra,
            ]
        )
