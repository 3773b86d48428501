"""Triton adapter for qwen_embed.serving.tokenizer: TEXT -> TOKEN_IDS, TOKEN_COUNT."""

import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from qwen_embed import ModelConfig
from qwen_embed.placement import read_topology, tokenizer_placement
from qwen_embed.serving.config import model_parameters, resolve_model_dir
from qwen_embed.serving.requests import RequestError, decode_texts, pack_ids, parse_options
from qwen_embed.serving.tokenizer import TextTokenizer


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        # On machines with a core to spare, tokenizers keep off the encoders' cores.
        spare = tokenizer_placement(read_topology())
        if spare is not None and params.get("cpu_pinning", "auto") != "off":
            os.sched_setaffinity(0, spare.cpus)
        model_dir = resolve_model_dir(params)
        self.hidden_size = ModelConfig.from_dir(model_dir).hidden_size
        self.max_texts = int(params.get("max_texts_per_request") or 256)
        self.max_text_bytes = int(params.get("max_text_bytes") or 262144)
        self.tokenizer = TextTokenizer(model_dir, int(params.get("max_input_tokens") or 8192))
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

    def _one(self, request):
        try:
            opts = parse_options(json.loads(request.parameters() or "{}"), self.hidden_size)
            raw = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            texts = decode_texts(raw, self.max_texts, self.max_text_bytes)
            ids = self.tokenizer.encode(texts, opts)
        except RequestError as e:
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
            )
        packed = np.array([[pack_ids(x)] for x in ids], dtype=np.object_)
        counts = np.array([[len(x)] for x in ids], dtype=np.int32)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("TOKEN_IDS", packed), pb_utils.Tensor("TOKEN_COUNT", counts),
        ])  # fmt: skip
