"""CUDA graphs over padded token buckets for the token-wise stretches of a forward.

A forward launches about ten kernels per layer from Python; a small forward (one client's
request) is bound by those launches, not by the GPU. Between two attention calls everything a
layer does is token-wise (norms, projections, rotary, MLP): its kernels depend on the row count
alone. So each bucket of rows gets one graph per stretch between attentions (piecewise, as vLLM
does it): the embeddings and layer 0 up to its attention; layer i's output projection and MLP
and layer i+1 up to its attention; ...; the last layer's MLP and the final norm. Attention runs
eagerly between them on the batch's own layout (any sequence lengths, shared prefixes). A batch
of T rows runs in the smallest bucket >= T: rows past T hold stale values that no real row
reads (row-wise ops; attention sees the first T rows). With last-layer pruning the last layer
runs eagerly (its rows depend on the batch).

Every bucket's graphs read and write one set of static buffers sized for the largest bucket
(views of their first rows) and share one memory pool, so the memory is the largest bucket's
buffers plus one stretch's temporaries. `capture` is torch.cuda's; tests on CPU pass one that
runs the stretch as it is, to check the buffers' plumbing where no GPU is.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from .segments import ForwardContext
from .settings import MAX_GRAPH_TOKENS

# Rows of each bucket (steps of about 1.5x: the padding a forward computes in vain stays under
# half of it); the route's cuda_graph_tokens, at most MAX_GRAPH_TOKENS, is the largest.
BUCKETS = (
    *(16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192),
    *(12288, 16384, 24576, 32768, 49152, MAX_GRAPH_TOKENS),
)


def buckets_up_to(tokens: int) -> list[int]:
    """The buckets below `tokens` and `tokens` itself: forwards of up to that many rows."""
    return [b for b in BUCKETS if b < tokens] + [tokens] if tokens > 0 else []


def cuda_capture(device: torch.device) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Capture functions into graphs sharing one pool; each returns its graph's replay."""
    pool = torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], None]) -> Callable[[], None]:
        side = torch.cuda.Stream(device)  # warm-up off the capture stream: JIT, cuBLAS plans
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph.replay

    return capture


class TokenGraphs:
    """The stretches of `model` (a QwenModel: stem, layers' before/after_attention and attend,
    norm, layers_from) captured for each bucket; `forward(ctx)` runs a batch through them, or
    returns None where it has more rows than the largest bucket."""

    def __init__(self, model, buckets: list[int], capture: Callable):
        config, first = model.config, model.layers[0].self_attn
        self.model = model
        self.buckets = sorted(buckets)
        self.replays = 0  # forwards run through the graphs
        n, d, dtype = self.buckets[-1], config.head_dim, model.norm.weight.dtype
        device = model.norm.weight.device

        def zeros(*shape, dtype=dtype):
            return torch.zeros(n, *shape, dtype=dtype, device=device)

        self._full = {
            "ids": zeros(dtype=torch.int64),
            "positions": zeros(dtype=torch.int64),
            "cos": zeros(d // 2),
            "sin": zeros(d // 2),
            "q": zeros(first.num_heads, d),
            "k": zeros(first.num_kv_heads, d),
            "v": zeros(first.num_kv_heads, d),
            "attn": zeros(first.num_heads * d),
            "residual": zeros(config.hidden_size),
            "out": zeros(config.hidden_size),
        }
        stretches = len(model.layers) + 1
        self._graphs = {}
        with torch.inference_mode():
            for rows in reversed(self.buckets):  # largest first: the pool grows once
                self._graphs[rows] = [
                    capture(partial(self._stretch, i, rows)) for i in range(stretches)
                ]

    def _views(self, rows: int) -> dict[str, torch.Tensor]:
        return {name: t[:rows] for name, t in self._full.items()}

    def _stretch(self, i: int, rows: int) -> None:
        """From attention i-1's output (the stem for i = 0) to layer i's q, k, v."""
        b, model = self._views(rows), self.model
        if i == 0:
            x, cos, sin = model.stem(b["ids"], b["positions"])
            b["cos"].copy_(cos)
            b["sin"].copy_(sin)
            residual = None
        else:
            x, residual = model.layers[i - 1].after_attention(b["attn"], b["residual"])
        if i == len(model.layers):
            b["out"].copy_(model.final(x, residual))
            return
        q, k, v, residual = model.layers[i].before_attention(x, residual, b["cos"], b["sin"])
        for name, t in (("q", q), ("k", k), ("v", v), ("residual", residual)):
            b[name].copy_(t)

    def bucket(self, tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= tokens), None)

    @torch.inference_mode()
    def forward(self, ctx: ForwardContext) -> torch.Tensor | None:
        """As model(ctx), or None where the batch fits no bucket."""
        model, t = self.model, ctx.batch.num_tokens
        layers = len(model.layers)
        rows = self.bucket(t)
        if rows is None or (ctx.last is not None and layers < 2):
            return None
        model.backend.prepare(ctx.layout)
        if ctx.last is not None:
            model.backend.prepare(ctx.last)
        b, graphs = self._views(t), self._graphs[rows]
        b["ids"].copy_(ctx.batch.input_ids)
        b["positions"].copy_(ctx.batch.positions)
        graphed = layers if ctx.last is None else layers - 1
        for i in range(graphed):
            graphs[i]()
            attn = model.layers[i].self_attn.attend(b["q"], b["k"], b["v"], ctx, ctx.layout)
            b["attn"].copy_(attn)
        self.replays += 1
        if ctx.last is None:
            graphs[layers]()
            return b["out"]
        x, residual = model.layers[layers - 2].after_attention(b["attn"], b["residual"])
        return model.layers_from(layers - 1, x, residual, b["cos"], b["sin"], ctx)
