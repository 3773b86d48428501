"""Ray Data pipelines on a local Ray instance the test starts (ray.init(num_cpus=2)): the
TritonEmbedder over a real tritonserver and the engine-in-each-actor EngineEmbedder, both giving
the vectors the client library gets for the same texts; the Parquet example end to end."""

import json
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray
import ray.data

from qwen_embed_client import EmbeddingClient
from qwen_embed_client.ray_data import TritonEmbedder
from qwen_embed_deploy.ray_data import EngineEmbedder
from qwen_embed_deploy.repository import MODEL_REPOSITORY

sys.path.insert(0, str(MODEL_REPOSITORY.parent / "client" / "examples"))
from ray_parquet import embed_files  # noqa: E402

pytestmark = pytest.mark.server  # starts tritonserver and a Ray instance

TEXTS = [f"document {i}: " + "word " * (i % 7) for i in range(40)]
SAME = 1e-5  # fp32 on both sides; batches of other sizes


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    ray.init(
        num_cpus=2,
        object_store_memory=200 * 2**20,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def expected(server):
    with EmbeddingClient(server.grpc_url) as client:
        return client.embed(TEXTS, dimensions=64, prompt_name="document")


def test_triton_embedder_keeps_columns_and_adds_the_vectors(server, local_ray, expected):
    ds = ray.data.from_items([{"id": i, "text": t} for i, t in enumerate(TEXTS)])
    out = ds.map_batches(
        TritonEmbedder,
        fn_constructor_kwargs={"url": server.grpc_url, "dimensions": 64, "prompt_name": "document"},
        concurrency=2,
        batch_size=8,
    ).take_all()
    rows = sorted(out, key=lambda r: r["id"])
    assert [r["text"] for r in rows] == TEXTS
    got = np.stack([r["embedding"] for r in rows])
    assert got.shape == (40, 64) and np.abs(got - expected).max() <= SAME
    pandas = ds.map_batches(
        TritonEmbedder,
        fn_constructor_kwargs={
            "url": [server.grpc_url],
            "output_column": "v",
            "dimensions": 64,
            "prompt_name": "document",
        },
        concurrency=1,
        batch_size=16,
        batch_format="pandas",
    ).take_all()
    got = np.stack([r["v"] for r in sorted(pandas, key=lambda r: r["id"])])
    assert np.abs(got - expected).max() <= SAME


def test_a_bad_option_fails_the_actor_at_once(server):
    with pytest.raises(ValueError, match="parameter 'dimensions' must be >= 1"):
        TritonEmbedder(server.grpc_url, dimensions=0)


def test_engine_embedder_gives_the_served_vectors(demo_dir, local_ray, expected):
    ds = ray.data.from_items([{"id": i, "text": t} for i, t in enumerate(TEXTS)])
    out = ds.map_batches(
        EngineEmbedder,
        fn_constructor_kwargs={
            "model_dir": str(demo_dir),
            "settings": {"dtype": "float32"},
            "dimensions": 64,
            "prompt_name": "document",
        },
        concurrency=1,
        batch_size=16,
    ).take_all()
    got = np.stack([r["embedding"] for r in sorted(out, key=lambda r: r["id"])])
    assert np.abs(got - expected).max() <= SAME


def test_the_parquet_example_end_to_end(server, local_ray, expected, tmp_path):
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    embed_files(
        str(source),
        str(tmp_path / "out"),
        [server.grpc_url],
        dimensions=64,
        prompt_name="document",
        actors=1,
        batch_size=8,
    )
    table = pq.read_table(tmp_path / "out").to_pydict()
    order = np.argsort(table["id"])
    got = np.stack([np.asarray(table["embedding"][i]) for i in order])
    assert np.abs(got - expected).max() <= SAME
