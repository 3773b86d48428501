"""Ray Data with the engine in each actor, for clusters without Triton: the in-process twin
of qwen_embed_client.ray_data.TritonEmbedder (same arguments but `model_dir` for `url`).

    ds.map_batches(
        EngineEmbedder,
        fn_constructor_kwargs={"model_dir": "/models/Qwen3-Embedding-0.6B"},
        concurrency=2,
        num_gpus=1,  # one GPU per actor; without it the actor runs on CPU
        batch_size=256,
    )

Each actor loads the checkpoint once (Encoder.from_pretrained, `settings` keywords such as
dtype) and tokenizes as the tokenizer model does (prompts, truncation), so its vectors are the
served ones.
"""

from __future__ import annotations

from qwen_embed.engine import Encoder
from qwen_embed.hub import resolve_checkpoint
from qwen_embed_client.contract import EmbedOptions, compact
from qwen_embed_client.ray_data import texts_of, with_column

from .serving.tokenizer import TextTokenizer


class EngineEmbedder:
    def __init__(
        self,
        model_dir: str,
        column: str = "text",
        output_column: str = "embedding",
        max_input_tokens: int | None = None,
        settings: dict | None = None,
        **options,
    ):
        self.options = EmbedOptions(**options)
        if self.options.chunked or len(self.options.embedding_types) != 1:
            raise ValueError("EngineEmbedder gives one vector of one embedding type per text")
        model_dir = resolve_checkpoint(model_dir)
        self.encoder = Encoder.from_pretrained(model_dir, **(settings or {}))
        positions = self.encoder.config.max_position_embeddings
        self.tokenizer = TextTokenizer(model_dir, min(max_input_tokens or positions, positions))
        self.column, self.output_column = column, output_column

    def __call__(self, batch):
        opts = self.options
        opts.check_model(self.encoder.embedding_size, self.tokenizer.prompts.names)
        ids = self.tokenizer.encode(texts_of(batch, self.column), opts)
        vectors = self.encoder.embed(ids, normalize=opts.normalize, dimensions=opts.dimensions)
        return with_column(batch, self.output_column, compact(vectors, opts.embedding_type))

    def __del__(self):
        encoder = getattr(self, "encoder", None)
        if encoder is not None:
            encoder.close()
