"""Embed a corpus with Ray Data over Triton: JSONL or Parquet in, Parquet out.

    python ray_parquet.py corpus.jsonl out/ --url node-a:8001 --url node-b:8001 \
        [--column text] [--dimensions 256] [--prompt-name document] [--actors 4]

Each actor sends its batches through the client library (split over the URLs, retried);
every input column is kept and `embedding` is added. On a cluster, run it where
`ray.init()` finds the cluster (RAY_ADDRESS).
"""

from __future__ import annotations

import argparse

import ray

from qwen_embed_client.ray_data import TritonEmbedder


def embed_files(
    source: str,
    out: str,
    urls: list[str],
    column: str = "text",
    actors: int = 2,
    batch_size: int = 256,
    **options,
) -> None:
    read = ray.data.read_parquet if source.endswith(".parquet") else ray.data.read_json
    ds = read(source).map_batches(
        TritonEmbedder,
        fn_constructor_kwargs={"url": urls, "column": column, **options},
        concurrency=actors,
        batch_size=batch_size,
    )
    ds.write_parquet(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="a .jsonl or .parquet file (or a directory of them)")
    p.add_argument("out", help="a directory for the Parquet files")
    p.add_argument("--url", action="append", required=True, help="Triton gRPC address")
    p.add_argument("--column", default="text")
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--dimensions", type=int)
    p.add_argument("--prompt-name")
    args = p.parse_args()
    options = {
        k: v for k, v in (("dimensions", args.dimensions), ("prompt_name", args.prompt_name)) if v
    }
    ray.init()
    embed_files(
        args.source, args.out, args.url, args.column, args.actors, args.batch_size, **options
    )


if __name__ == "__main__":
    main()
