"""Locust load on Triton's `embed` ensemble over gRPC (tritonclient).

    locust -f perf/locustfile.py -H 127.0.0.1:8001 --headless -u 16 -r 16 -t 60s \\
        [--texts-per-request 8] [--length-mix mixed|short|long] [--prompt-name query]

Every call is reported to Locust's request event (name "embed xN", response length = tokens
embedded), so Locust's own statistics, failures and CSV files are the real thing. Each user is
a closed loop: it sends its next request as soon as the last one is answered.
"""

from __future__ import annotations

import random
import time

# gRPC must cooperate with gevent, which Locust runs its users on; before tritonclient loads.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import numpy as np  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
from locust import User, constant, events, task  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from workload import LONG_WORDS, SHORT_WORDS, make_texts  # noqa: E402

MIXES = {"mixed": 0.2, "short": 0.0, "long": 1.0}  # fraction of long texts


@events.init_command_line_parser.add_listener
def add_options(parser):
    parser.add_argument("--model", default="embed", help="Triton model to call")
    parser.add_argument("--texts-per-request", type=int, default=8)
    mix_help = f"short: {SHORT_WORDS} words, long: {LONG_WORDS}, mixed: 80/20"
    parser.add_argument("--length-mix", choices=sorted(MIXES), default="mixed", help=mix_help)
    parser.add_argument("--prompt-name", choices=["", "query", "document"], default="")
    parser.add_argument("--dimensions", type=int, default=0, help="0: the model's full size")
    parser.add_argument("--text-pool", type=int, default=512, help="distinct texts to draw from")
    parser.add_argument("--request-timeout", type=float, default=120.0)


class EmbedUser(User):
    wait_time = constant(0)

    def on_start(self):
        opts = self.environment.parsed_options
        self.opts = opts
        self.client = grpcclient.InferenceServerClient(self.host.removeprefix("grpc://"))
        self.texts = make_texts(opts.text_pool, seed=0, long_fraction=MIXES[opts.length_mix])
        self.rng = random.Random()
        self.params = {}
        if opts.prompt_name:
            self.params["prompt_name"] = opts.prompt_name
        if opts.dimensions:
            self.params["dimensions"] = opts.dimensions

    def on_stop(self):
        self.client.close()

    @task
    def embed(self):
        n = self.opts.texts_per_request
        batch = self.rng.sample(self.texts, n)
        inp = grpcclient.InferInput("TEXT", [n, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[t.encode()] for t in batch], dtype=np.object_))
        start = time.perf_counter()
        tokens, error = 0, None
        try:
            result = self.client.infer(
                self.opts.model,
                [inp],
                parameters=self.params or None,
                client_timeout=self.opts.request_timeout,
            )
            tokens = int(result.as_numpy("TOKEN_COUNT").sum())
        except InferenceServerException as e:
            error = e
        self.environment.events.request.fire(
            request_type="grpc",
            name=f"{self.opts.model} x{n}",
            response_time=(time.perf_counter() - start) * 1000,
            response_length=tokens,
            exception=error,
            context={},
        )
