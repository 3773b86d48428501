"""Ray Data pipelines over a Triton deployment: a callable class for `Dataset.map_batches`.

    ds.map_batches(
        TritonEmbedder,
        fn_constructor_kwargs={"url": ["node-a:8001", "node-b:8001"], "dimensions": 256},
        concurrency=4,
        batch_size=256,
    )

Each actor holds one client (client.py): its requests are split over the URLs by the client's
adaptive scheduler and retried as the client retries them (a dead model process, a full queue,
a server restarting). The batch keeps its columns and gains `output_column`, one vector per
row. Ray's actors, backpressure and retries of failed tasks do the rest. Needs `ray[data]`
(not a dependency of this package). The engine-in-each-actor variant, for clusters without
Triton, is `qwen_embed_deploy.ray_data.EngineEmbedder`.
"""

from __future__ import annotations

import numpy as np

from .client import EmbeddingClient
from .contract import EmbedOptions, priority_level


def texts_of(batch, column: str) -> list[str]:
    """A batch's texts: a dict of numpy arrays (Ray's default format) or a pandas DataFrame."""
    values = batch[column]
    return [str(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]


def with_column(batch, name: str, vectors: np.ndarray):
    """The batch with `vectors` as column `name`, in the batch's own format."""
    if isinstance(batch, dict):
        return {**batch, name: vectors}
    batch = batch.copy()
    batch[name] = list(vectors)
    return batch


class TritonEmbedder:
    """`url`: one Triton gRPC address or a list; `column` holds the texts (default "text");
    `output_column` receives the vectors (default "embedding"); `priority` defaults to "bulk"
    (interactive traffic on the same servers keeps its latency); every other keyword is an
    embed option (prompt_name, dimensions, embedding_type, truncate, ...)."""

    def __init__(
        self,
        url: str | list[str],
        column: str = "text",
        output_column: str = "embedding",
        priority: str | int = "bulk",
        **options,
    ):
        EmbedOptions(**options)  # a bad option fails the actor at once, not every batch
        priority_level(priority)
        self.column, self.output_column = column, output_column
        self.options = {**options, "priority": priority}
        self.client = EmbeddingClient(url)

    def __call__(self, batch):
        vectors = self.client.embed(texts_of(batch, self.column), **self.options)
        return with_column(batch, self.output_column, vectors)

    def __del__(self):
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
