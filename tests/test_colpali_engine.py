"""ColQwen2 and ColQwen2.5 as colpali-engine, which trained them, publishes them: a base
checkpoint (vidore/colqwen2-base, colqwen2.5-base: Qwen2-VL or Qwen2.5-VL in transformers 4.x's
flat layout, its architecture `ColQwen2` or `ColQwen2_5`, a top-level `custom_text_proj` of
128) and the LoRA fine-tune users download (vidore/colqwen2-v1.0, colqwen2.5-v0.2: an adapter
on the text model's linear layers and the projection, naming its base), merged at load. On
replicas of both layouts (replicas.colpali_engine, colpali_adapter). The reference is
colpali-engine (0.3.18) itself on the same directories, in a process of its own
(colpali_reference.py: its processor needs torchvision): its `process_queries` with the
`Query: ` prefix the checkpoints were trained with and `process_images`, through its models.
Asserted: fp32 cosine >= 0.9999 per token, MaxSim within 1e-3 per query token.
"""

import dataclasses
import json

import colpali_reference
import numpy as np
import pytest
from test_colqwen3 import large_page
from test_qwen3_vl import image_files

from qwen_embed.adapters import read_lora
from qwen_embed.config import ModelConfig, UnsupportedModelError
from qwen_embed.hub import resolve_checkpoint
from qwen_embed_deploy.serving.retrievers import ColPaliTemplate

from reference import cosine
from replicas import COLPALI_WIDTH, colpali_adapter, colpali_engine

FP32_COSINE = 0.9999
QUERIES = ["which chart shows a yellow circle?", "quarterly report, page 2"]
GENERATIONS = {"colqwen2": False, "colqwen2_5": True}  # name -> over Qwen2.5-VL


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple]:
    """name -> (base, fine-tune) directories, with Qwen's tokenizer and processor files."""
    root = tmp_path_factory.mktemp("colpali-engine")
    built = {}
    for name, qwen2_5 in GENERATIONS.items():
        base = colpali_engine(root / f"{name}-base", qwen2_5=qwen2_5, files=True)
        built[name] = (base, colpali_adapter(root / f"{name}-lora", base))
    return built


def test_the_layouts_are_read(checkpoints, tmp_path):
    for name, (base, finetune) in checkpoints.items():
        config = ModelConfig.from_dir(base)
        assert config.family == "qwen2" and config.multi_vector, name
        assert config.token_size == config.embedding_size == COLPALI_WIDTH, name
        assert config.sentence.token_projection.prefix == "custom_text_proj.", name
        generation = "qwen2_5_vl" if GENERATIONS[name] else "qwen2_vl"
        assert config.media.vision.generation == generation, name
        assert config.media.mrope_section == (8, 12, 12), name
        merged = resolve_checkpoint(finetune)  # the fine-tune over its base, one checkpoint
        assert ModelConfig.from_dir(merged).adapters == ("lora",), name
    # a projection belongs to its architecture: colpali-engine's under another retriever's
    # name (whose processor forms differ) is refused, not served with the other's forms
    base = checkpoints["colqwen2"][0]
    hf = json.loads((base / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(hf | {"architectures": ["ColQwen3"]}))
    (tmp_path / "model.safetensors").symlink_to(base / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match=r"projection found \(custom_text_proj"):
        ModelConfig.from_dir(tmp_path)
    # the adapter's pairs keyed as the loader and the token head read them: the projection's
    # included (it is trained as a LoRA pair too, over the base's own weights)
    pairs, scale = read_lora(checkpoints["colqwen2"][1])
    assert "custom_text_proj.weight" in pairs and "layers.1.mlp.down_proj.weight" in pairs
    assert len(pairs) == 2 * 7 + 1 and scale == 2.0


def test_the_processor_forms(checkpoints, tmp_path):
    template = ColPaliTemplate.from_dir(checkpoints["colqwen2_5"][0], "<|endoftext|>")
    pads = "<|endoftext|>" * 10
    assert template.parts(None, "", False, " a query ") == ("Query: ", " a query ", pads)
    # pages (an image alone, text beside it refused) are transformers' port's
    # (test_colqwen2.py), and so is the rest but the query's newline
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["ColQwen2ForRetrieval"]}))
    port = ColPaliTemplate.from_dir(tmp_path, "<|endoftext|>")
    assert template == dataclasses.replace(port, query_end="")
    # colpali-engine's augmentation token is <|endoftext|> whatever the pad token
    assert ColPaliTemplate.from_dir(checkpoints["colqwen2"][0], "<pad>").augmentation == pads


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    from qwen_embed_deploy.repository import render
    from qwen_embed_deploy.triton import TritonServer

    where = tmp_path_factory.mktemp("colpali-served")
    deployments = {name: finetune for name, (_, finetune) in checkpoints.items()}
    repo = render(where / "repo", deployments, {"encoder": {"dtype": "float32"}})
    with TritonServer(repo, log_path=where / "server.log") as server:
        yield server


@pytest.mark.server
@pytest.mark.skipif(
    not colpali_reference.available(),
    reason="the reference is colpali-engine with torchvision (.venv/video-reference: make setup)",
)
@pytest.mark.parametrize("name", list(GENERATIONS))
def test_queries_and_pages_through_triton_match_colpali_engine(checkpoints, served, name, tmp_path):
    _, finetune = checkpoints[name]
    pages, paths = page_files(tmp_path)
    spec = {
        "model_dir": str(finetune),
        "model": "ColQwen2_5" if GENERATIONS[name] else "ColQwen2",
        "queries": QUERIES,
        "images": [str(p) for p in paths],
    }
    queries, want = colpali_reference.run(spec, tmp_path)
    preprocessor = json.loads((finetune / "preprocessor_config.json").read_text())
    budget = preprocessor["max_pixels"] // (4 * 2) ** 2  # text-model tokens of 8 x 8 pixels
    image_tokens = len(want[2]) - len(page_tokens(finetune, "<|image_pad|>"))
    assert budget * 0.8 < image_tokens + 1 <= budget  # resized into the budget, and near it
    assert_served_as(served, name, QUERIES, pages, queries, want)


def page_files(tmp_path) -> tuple[list[bytes], list]:
    """A PNG, a JPEG and a page larger than the budget (resized into it): their bytes, and the
    files holding them (the reference reads files)."""
    files = image_files()
    pages = [files["png"], files["jpeg"], large_page()]
    paths = [tmp_path / f"page{i}" for i in range(len(pages))]
    for path, data in zip(paths, pages, strict=True):
        path.write_bytes(data)
    return pages, paths


def assert_served_as(server, model, queries, pages, expected_queries, expected_pages) -> None:
    """Each query's and page's vectors from `model` through Triton (HTTP and gRPC) against the
    reference's: cosine >= FP32_COSINE per token, each query's MaxSim over the pages within
    1e-3 per query token; the reference's pages score apart (a check that can fail)."""
    from qwen_embed_client import EmbeddingClient, maxsim_scores

    n = len(queries)
    for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
        with EmbeddingClient(url, protocol=protocol, model=model) as client:
            got = client.embed_tokens(
                queries + [""] * len(pages), images=[[]] * n + [[p] for p in pages]
            )
        expected = expected_queries + expected_pages
        for i, (vectors, want) in enumerate(zip(got, expected, strict=True)):
            assert vectors.shape == want.shape, (protocol, i)
            assert cosine(vectors, want).min() >= FP32_COSINE, (protocol, i)
        for query, want_query in zip(got[:n], expected_queries, strict=True):
            scores = maxsim_scores(query, got[n:])
            want = maxsim_scores(want_query, expected_pages)
            assert np.abs(scores - want).max() <= 1e-3 * len(want_query)
    assert np.ptp(want) > 0.01


@pytest.mark.server
@pytest.mark.skipif(
    not colpali_reference.available(),
    reason="the reference is colpali-engine with torchvision (.venv/video-reference: make setup)",
)
def test_the_adapter_changes_what_the_base_gives(checkpoints, tmp_path):
    """The fine-tune's queries are not its base's (the merge did something); the base alone
    is served as colpali-engine runs it, and so is the save colpali-engine makes of it
    (transformers 5's config.json: the text model's fields in `text_config`)."""
    from qwen_embed import Encoder

    base, finetune = checkpoints["colqwen2"]
    saved = tmp_path / "saved"
    spec = {
        "model_dir": str(base),
        "model": "ColQwen2",
        "queries": QUERIES[:1],
        "images": [],
        "save": str(saved),
    }
    (want,), _ = colpali_reference.run(spec, tmp_path)
    assert "text_config" in json.loads((saved / "config.json").read_text())
    before, text, after = ColPaliTemplate.from_dir(base, "<|endoftext|>").parts(
        None, "", False, QUERIES[0]
    )
    tokens = page_tokens(base, before + text + after)
    assert len(tokens) == len(want)
    for model_dir in (base, saved):
        with Encoder.from_pretrained(model_dir, dtype="float32") as enc:
            (got,) = enc.embed_tokens([tokens])
        assert cosine(got, want).min() >= FP32_COSINE, model_dir
    with Encoder.from_pretrained(resolve_checkpoint(finetune), dtype="float32") as enc:
        (tuned,) = enc.embed_tokens([tokens])
    assert cosine(tuned, want).min() < 0.99


def page_tokens(model_dir, text: str) -> list[int]:
    """`text`'s ids as the checkpoint's tokenizer writes them; a page's prefix with one
    placeholder for `text` "<|image_pad|>"."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if text == "<|image_pad|>":
        text = ColPaliTemplate.from_dir(model_dir, "<|endoftext|>").image_prefix
    return tokenizer.encode(text, add_special_tokens=False).ids
