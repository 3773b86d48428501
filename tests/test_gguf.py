"""GGUF files (llama.cpp's and Ollama's format) served as checkpoints (qwen_embed/gguf_files.py).

The files are written as llama.cpp's converter writes them (replicas.as_gguf: the `gguf` package's
writer, SpecialVocab and TensorNameMap) from the replicas of Qwen3-Embedding-0.6B and
gte-Qwen2-1.5B-instruct. The reference is the model a file holds (replicas.gguf_weights: the
replica with each matrix quantised and dequantised by that package, in fp32) read by
transformers (whose own GGUF loader reads Qwen3's head size as its config class's default, 128,
whatever the file says). Served through Triton: test_checkpoints.py; the files llama.cpp's own
converter writes: bench_peers.py's triton-gguf systems. Each file takes seconds to write (a
151K-token vocabulary in Python): server tier.
"""

import hashlib
import json

import numpy as np
import pytest
import torch
from test_qwen3_vl import (
    FP32_COSINE,
    cases,
    image_files,
    official_vector,
    reference_hidden,
    reference_vector,
    yes_minus_no,
)
from tokenizers import Tokenizer

from qwen_embed import Encoder
from qwen_embed.config import ModelConfig
from qwen_embed.fingerprint import checkpoint_digest
from qwen_embed.gguf_files import FILE, GGUFError
from qwen_embed.gguf_vision import PROJECTOR
from qwen_embed.hub import CheckpointNotFoundError, resolve_checkpoint
from qwen_embed_client.contract import DEFAULT_TASK, EmbedOptions
from qwen_embed_deploy.launcher import served_model_names
from qwen_embed_deploy.serving.config import MODEL_DIR_ENV, RERANK_MODEL_DIR_ENV
from qwen_embed_deploy.serving.rerank import PairTokenizer, RerankOptions
from qwen_embed_deploy.serving.tokenizer import PromptSet, TextTokenizer
from qwen_embed_deploy.triton import TritonServer, free_port

from reference import cosine, model_card_pairs, reference_embeddings, reference_scores
from replicas import (
    QWEN3_QUERY,
    as_gguf,
    as_gguf_tower,
    gguf_weights,
    gte_qwen2,
    hub_snapshot,
    qwen3_embedding,
    qwen3_vl,
)
from triton_helpers import wait_for

TEXTS = [
    "What is the capital of China?",
    "naïve café — emoji 🎉 你好，世界！这是一个多语言测试。",
    "Привет, мир! مرحبا بالعالم こんにちは世界",
    "def f(x):\n\treturn x ** 2  # tabs, newlines\n\n",
    "Cafe\u0301 (decomposed) vs Café",
    "<|im_start|>user\nspecial tokens inside a text<|im_end|>",
]
# (replica, tensor type) of the files written once for the module
MADE = [("qwen3", "F32"), ("qwen3", "BF16"), ("qwen3", "Q8_0"), ("gte", "Q8_0")]
MIN_COSINE = 0.99999
QUERY = "What is the capital of China?"
DOCUMENTS = ["Beijing is the capital of China.", "Gravity pulls bodies together.", "北京是首都。"]

pytestmark = pytest.mark.server  # whole-model checks that take seconds


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {"qwen3": qwen3_embedding(root / "qwen3"), "gte": gte_qwen2(root / "gte")}


@pytest.fixture(scope="module")
def files(replicas, tmp_path_factory):
    """(replica, kind) -> (GGUF file, the model it holds as a checkpoint directory)."""
    root = tmp_path_factory.mktemp("gguf-files")
    made = {}
    for name, kind in MADE:
        source = replicas[name]
        path = as_gguf(root / f"{name}-{kind}.gguf", source, kind, causal=name != "gte")
        made[name, kind] = (path, gguf_weights(source, root / f"{name}-{kind}", kind))
    return made


@pytest.mark.parametrize("name", ["qwen3", "gte"])
def test_texts_get_the_checkpoints_ids(replicas, files, name):
    """The tokenizer rebuilt from the file's vocabulary, merges and special tokens serves the
    ids the checkpoint's own files give, the EOS llama.cpp appends among them (Qwen3-Embedding's
    post-processor's, gte-Qwen2's add_eos_token)."""
    converted = resolve_checkpoint(files[name, "Q8_0"][0])
    ours = TextTokenizer(converted, 8192).encode(TEXTS, EmbedOptions())
    assert ours == TextTokenizer(replicas[name], 8192).encode(TEXTS, EmbedOptions())
    assert all(ids[-1] == 151643 for ids in ours)
    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    assert tok.decode(ours[1], skip_special_tokens=True) == TEXTS[1]


@pytest.mark.parametrize("name, kind", MADE)
def test_vectors_are_the_model_the_file_holds(replicas, files, name, kind):
    path, held = files[name, kind]
    tok = Tokenizer.from_file(str(held / "tokenizer.json"))
    id_lists = [tok.encode(text).ids + ([151643] if name == "gte" else []) for text in TEXTS]
    with Encoder.from_pretrained(path, dtype="float32") as encoder:
        vectors = encoder.embed(id_lists)
    want = reference_embeddings(held, id_lists)
    assert cosine(vectors, want).min() >= MIN_COSINE
    assert np.abs(vectors - want).max() <= 1e-4
    if kind.startswith("Q"):  # the test can fail: quantising moves the vectors (the replica is
        # bf16: BF16 and F32 files hold it exactly)
        exact = reference_embeddings(replicas[name], id_lists)
        assert cosine(want, exact).min() < 1.0 - 1e-6


def test_the_int8_route_quantises_what_the_file_holds(files):
    """quantization int8 over a Q8_0 file: the route's codes made from the dequantised
    weights, as from any checkpoint's (tests/test_cpu_route.py's bound)."""
    path, held = files["qwen3", "Q8_0"]
    tok = Tokenizer.from_file(str(held / "tokenizer.json"))
    id_lists = [tok.encode(text).ids for text in TEXTS]
    with Encoder.from_pretrained(path, dtype="float32", quantization="int8") as encoder:
        vectors = encoder.embed(id_lists)
    assert cosine(vectors, reference_embeddings(held, id_lists)).min() >= 0.999


def test_the_checkpoint_directory(files):
    path, _ = files["qwen3", "Q8_0"]
    converted = resolve_checkpoint(path)
    assert resolve_checkpoint(path.parent / path.name) == converted  # made once per file
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 16
    assert (converted / FILE).resolve() == path.resolve()
    assert not (converted / "modules.json").exists()  # last token: as a bare checkpoint
    assert PromptSet.from_dir(converted).prompts["query"] == QWEN3_QUERY
    gte = json.loads((resolve_checkpoint(files["gte", "Q8_0"][0]) / "config.json").read_text())
    assert gte["architectures"] == ["Qwen2ForCausalLM"] and gte["is_causal"] is False


def test_mean_pooling_from_the_metadata(replicas, files, tmp_path):
    _, held = files["qwen3", "F32"]
    path = as_gguf(tmp_path / "mean.gguf", replicas["qwen3"], "F32", pooling="MEAN")
    tok = Tokenizer.from_file(str(held / "tokenizer.json"))
    id_lists = [tok.encode(text).ids for text in TEXTS[:3]]
    want = reference_embeddings(held, id_lists, pooling="mean")
    with Encoder.from_pretrained(path, dtype="float32") as encoder:
        assert cosine(encoder.embed(id_lists), want).min() >= MIN_COSINE


def test_a_folder_of_one_file_or_a_file_without_the_suffix(files, tmp_path):
    path, _ = files["qwen3", "Q8_0"]
    (tmp_path / "sha256-0a1b2c").symlink_to(path)  # as Ollama keeps it
    assert (resolve_checkpoint(tmp_path / "sha256-0a1b2c") / FILE).resolve() == path.resolve()
    (tmp_path / "sha256-0a1b2c").unlink()
    (tmp_path / path.name).symlink_to(path)
    assert (resolve_checkpoint(tmp_path) / FILE).resolve() == path.resolve()
    (tmp_path / "other.gguf").symlink_to(path)
    with pytest.raises(GGUFError, match="holds 2 GGUF model files"):
        resolve_checkpoint(tmp_path)


def _ollama_store(root, manifests: dict, blob: bytes):
    """An Ollama store as `ollama pull` leaves it: each manifest (its path below manifests/ ->
    its layers' media types), every layer naming the one blob, kept as blobs/sha256-DIGEST."""
    digest = hashlib.sha256(blob).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(blob)
    for where, kinds in manifests.items():
        layers = [{"mediaType": kind, "digest": f"sha256:{digest}", "size": 1} for kind in kinds]
        (root / "manifests" / where).parent.mkdir(parents=True, exist_ok=True)
        (root / "manifests" / where).write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return root / "blobs" / f"sha256-{digest}"


def test_a_model_ollama_pulled_by_its_name(files, tmp_path, monkeypatch):
    """`ollama:NAME[:TAG]` is the GGUF file its manifest in Ollama's store names (OLLAMA_MODELS;
    registry.ollama.ai, library and latest where the name leaves them out; any case), served
    under the names Ollama's clients send."""
    model, template = "application/vnd.ollama.image.model", "application/vnd.ollama.image.template"
    library = "registry.ollama.ai/library"
    blob = _ollama_store(
        tmp_path,
        {
            f"{library}/tiny/latest": [model, template],
            f"{library}/tiny/0.6b-q8_0": [model],
            "registry.ollama.ai/acme/tiny/latest": [model],
            "example.org/acme/tiny/v1": [model],
            "registry.ollama.ai/acme/Tiny-Mixed/Q8_0": [model],  # kept in the case pulled
            f"{library}/two/latest": [model, model],
            f"{library}/none/latest": [template],
        },
        files["qwen3", "Q8_0"][0].read_bytes(),
    )
    odd = {"layers": [{"mediaType": model, "digest": "sha256:../../outside"}]}
    (tmp_path / "manifests" / library / "odd" / "latest").parent.mkdir()
    (tmp_path / "manifests" / library / "odd" / "latest").write_text(json.dumps(odd))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    for name in (
        "tiny",
        "tiny:latest",
        "tiny:0.6b-q8_0",
        "acme/tiny",
        "example.org/acme/tiny:v1",
        "acme/Tiny-Mixed:Q8_0",
        "acme/tiny-mixed:q8_0",  # Ollama's names match whatever their case
    ):
        assert (resolve_checkpoint(f"ollama:{name}") / FILE).resolve() == blob
    # the gateway answers to the names Ollama's clients send for it (make serve, the launcher)
    assert served_model_names("ollama:tiny") == ["embed", "tiny", "tiny:latest"]
    assert served_model_names("ollama:acme/tiny:v1") == ["embed", "acme/tiny:v1"]
    assert served_model_names(str(files["qwen3", "Q8_0"][0])) is None  # the gateway's default
    assert served_model_names("ollama:acme/tiny:v1", "rerank") == ["rerank", "acme/tiny:v1"]
    assert served_model_names("ollama:rerank", "rerank") == ["rerank", "rerank:latest"]
    # the blob hashed by its name: the fingerprint of the same file anywhere else
    direct = checkpoint_digest(resolve_checkpoint(files["qwen3", "Q8_0"][0]))
    checkpoint_digest.cache_clear()
    assert checkpoint_digest(resolve_checkpoint("ollama:tiny")) == direct
    for name, message in [
        ("tiny:q4", r"not in .* \(no manifests/registry.ollama.ai/library/tiny/q4\): pull it"),
        ("two", "holds 2 GGUF files"),
        ("none", "holds 0 GGUF files .*vnd.ollama.image.template"),
        ("odd", "names its model file 'sha256:../"),
        ("a/b/c/d", "not an Ollama model name"),
        ("", "not an Ollama model name"),
    ]:
        with pytest.raises(CheckpointNotFoundError, match=message):
            resolve_checkpoint(f"ollama:{name}")


def test_make_serve_on_models_ollama_pulled(files, reranker, tmp_path):
    """`make serve MODEL_DIR=ollama:NAME RERANK_MODEL_DIR=ollama:NAME` (the launcher with the
    checked-in repository and its gateway): Ollama's own client embeds under the names it
    sends; a Qwen3-Reranker file as Ollama's users pull it (a causal LM: community uploads
    such as dengcao/Qwen3-Reranker-0.6B) scores on /v1/rerank under its Ollama name; another
    name is refused."""
    import httpx
    import ollama

    path = files["qwen3", "Q8_0"][0]
    reranker_file = as_gguf(tmp_path / "reranker.gguf", reranker, "Q8_0", pooling=None)
    model = "application/vnd.ollama.image.model"
    _ollama_store(
        tmp_path / "store", {"registry.ollama.ai/library/tiny/latest": [model]}, path.read_bytes()
    )
    pulled = "registry.ollama.ai/acme/Qwen3-Reranker-0.6B/Q8_0"
    _ollama_store(tmp_path / "store", {pulled: [model]}, reranker_file.read_bytes())
    env = {
        "OLLAMA_MODELS": str(tmp_path / "store"),
        MODEL_DIR_ENV: "ollama:tiny",
        RERANK_MODEL_DIR_ENV: "ollama:acme/Qwen3-Reranker-0.6B:Q8_0",
    }
    port = free_port()
    launcher = ["--gateway-port", str(port)]
    with TritonServer(env=env, log_path=tmp_path / "server.log", launcher_args=launcher):
        base = f"http://127.0.0.1:{port}"
        wait_for(f"{base}/health")
        client = ollama.Client(host=base)
        names = ("tiny", "tiny:latest")  # what Ollama's clients send for ollama:tiny
        answers = {name: client.embed(model=name, input=TEXTS[:2]) for name in names}
        assert {answer.model for answer in answers.values()} == {"tiny", "tiny:latest"}
        with pytest.raises(ollama.ResponseError, match="does not exist"):
            client.embed(model="other", input="x")
        listed = {m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]}
        assert {"rerank", "acme/Qwen3-Reranker-0.6B:Q8_0"} <= listed
        ranked = {}
        for name in ("acme/Qwen3-Reranker-0.6B:Q8_0", "rerank"):
            body = {"model": name, "query": QUERY, "documents": DOCUMENTS}
            answer = httpx.post(f"{base}/v1/rerank", json=body, timeout=60).json()
            assert "results" in answer, answer
            ranked[name] = {r["index"]: r["relevance_score"] for r in answer["results"]}
        refused = httpx.post(f"{base}/v1/rerank", json=body | {"model": "other"}, timeout=60)
        assert refused.status_code == 404 and "does not exist" in refused.text
    ids = TextTokenizer(resolve_checkpoint(path), 8192).encode(TEXTS[:2], EmbedOptions())
    with Encoder.from_pretrained(path) as encoder:  # the served route's dtype
        expected = encoder.embed(ids)
    for answer in answers.values():
        assert answer.prompt_eval_count == sum(map(len, ids))
        assert cosine(np.array(answer.embeddings), expected).min() >= 0.9999
    pairs = PairTokenizer(resolve_checkpoint(reranker_file), 8192).encode(
        QUERY, DOCUMENTS, RerankOptions()
    )
    with Encoder.from_pretrained(reranker_file, task="rerank") as encoder:
        scores = encoder.score(pairs)
    assert np.ptp(scores) > 1e-3  # the replica tells documents apart
    for answer in ranked.values():
        served = np.array([answer[i] for i in range(len(DOCUMENTS))])
        assert np.abs(served - scores).max() <= 2e-3, (served, scores)


def test_a_gguf_repositorys_file_by_type_from_the_cache(files, tmp_path, monkeypatch):
    """`owner/name:TYPE`, as llama.cpp's `-hf` names a file of a Hugging Face GGUF repository
    (Qwen/Qwen3-Embedding-0.6B-GGUF:Q8_0), read from a pre-filled cache with HF_HUB_OFFLINE."""
    snapshot = hub_snapshot(tmp_path, "acme/tiny-GGUF")
    for kind in ("F32", "Q8_0"):
        (snapshot / f"tiny-{kind}.gguf").symlink_to(files["qwen3", kind][0])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("acme/tiny-GGUF:Q8_0", "acme/tiny-GGUF:q8_0"):
        linked = (resolve_checkpoint(name) / FILE).resolve()
        assert linked == files["qwen3", "Q8_0"][0].resolve()
    with pytest.raises(CheckpointNotFoundError, match="HF_HUB_OFFLINE is set"):
        resolve_checkpoint("acme/tiny-GGUF:Q4_K_M")


@pytest.mark.parametrize("form", ["rank", "causal"])
def test_a_qwen3_reranker_file_scores_as_the_model_card(reranker, tmp_path, form):
    """As llama.cpp's converter writes a Qwen3-Reranker now (`rank`: its `cls.output` rows, yes
    and no, as one classifier row whose sigmoid is the model card's P(yes) over the two), and
    as it wrote one before it read rerankers (`causal`: a causal LM without pooling, the form
    of the Qwen3-Reranker files Ollama's users pull, which Ollama cannot score): the model
    card's scores of the model the file holds; the causal form reranks where the deployment
    says so (the rerank model's task), as Qwen3-Reranker's own safetensors do."""
    kind = {"reranker": True} if form == "rank" else {"pooling": None}
    path = as_gguf(tmp_path / "reranker-Q8_0.gguf", reranker, "Q8_0", **kind)
    held = gguf_weights(reranker, tmp_path / "held", "Q8_0")
    pairs = model_card_pairs(held, QUERY, DOCUMENTS, instruction=DEFAULT_TASK)
    converted = resolve_checkpoint(path)
    assert PairTokenizer(converted, 8192).encode(QUERY, DOCUMENTS, RerankOptions()) == pairs
    expected = reference_scores(held, pairs)
    task = "auto" if form == "rank" else "rerank"  # the rank form reranks by itself
    with Encoder.from_pretrained(path, dtype="float32", task=task) as encoder:
        assert encoder.task == "rerank"
        scores = encoder.score(pairs)
    assert np.abs(scores - expected).max() <= 1e-4
    assert np.ptp(expected) > 1e-3  # the replica tells documents apart


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """Qwen3-VL-Embedding's replica (real tokenizer) and its GGUF files as llama.cpp's
    converter writes them (its text model in F32 and in Q8_0, each beside its tower's file,
    as published repositories keep them), with the model the Q8_0 file holds."""
    root = tmp_path_factory.mktemp("gguf-vl")
    source = qwen3_vl(root / "source", files=True)
    for kind in ("F32", "Q8_0"):
        (root / kind).mkdir()
        as_gguf(root / kind / f"Qwen3-VL-Embedding-{kind}.gguf", source, kind, pooling=None)
        as_gguf_tower(root / kind / "mmproj-Qwen3-VL-Embedding-F32.gguf", source)
    held = gguf_weights(source, root / "held", "Q8_0", keys="model.language_model.")
    return source, root, held


def test_qwen3_vl_files_are_the_model_they_hold(vl):
    """The text model's file with its tower's file beside it (named as a file, or as their
    folder) is the Qwen3-VL checkpoint they hold: transformers' Qwen3-VL on text alone, an
    image, text with an image, two images and a short video; the Q8_0 file against the model
    it holds."""
    from transformers import Qwen3VLForConditionalGeneration

    source, root, held = vl
    for kind, model_dir in (("F32", source), ("Q8_0", held)):
        model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
        media = ModelConfig.from_dir(source).media
        texts = list(cases(media).values())
        want = np.stack([reference_vector(model.eval(), text) for text in texts])
        for named in (root / kind, root / kind / f"Qwen3-VL-Embedding-{kind}.gguf"):
            with Encoder.from_pretrained(named, dtype="float32") as encoder:
                got = encoder.embed_media(texts)
            assert cosine(got, want).min() >= FP32_COSINE, (kind, named, cosine(got, want))
    assert cosine(want[:1], want[1:]).max() < 0.999  # the inputs tell the vectors apart


def test_qwen3_vl_files_through_triton_match_the_official_recipe(vl, tmp_path):
    """Served from the folder of its two files: texts with images through the ensemble
    (the tokenizer writes the chat turns and resizes the images from the laid-out
    checkpoint), against Qwen3-VL-Embedding's recipe on the replica."""
    from transformers import Qwen3VLForConditionalGeneration

    from qwen_embed_client import EmbeddingClient
    from qwen_embed_deploy.repository import render

    source, root, _ = vl
    model = Qwen3VLForConditionalGeneration.from_pretrained(source, dtype=torch.float32).eval()
    files = image_files()
    asked = [("a chart with a legend", [files["jpeg"]]), ("two pictures", [files["png"]] * 2)]
    asked.append(("a text alone", []))
    want = np.stack([official_vector(model, source, t, images) for t, images in asked])
    repo = render(tmp_path / "repo", {"embed": root / "F32"}, {"encoder": {"dtype": "float32"}})
    with TritonServer(repo, log_path=tmp_path / "server.log") as server:
        with EmbeddingClient(server.grpc_url, protocol="grpc") as client:
            got = client.embed([t for t, _ in asked], images=[images for _, images in asked])
    assert cosine(got, want).min() >= FP32_COSINE, cosine(got, want)


def test_a_qwen3_vl_reranker_pair_scores_as_transformers(tmp_path):
    """Qwen3-VL-Reranker's pair (an output head of its own, the 8B's, kept as output.weight)
    served as the deployment's reranker: the "yes" less "no" rows of its head, as transformers'
    Qwen3-VL scores the published checkpoint."""
    from transformers import Qwen3VLForConditionalGeneration

    source = qwen3_vl(tmp_path / "source", files=True, tied=False, seed=7)
    (tmp_path / "files").mkdir()
    as_gguf(tmp_path / "files" / "Qwen3-VL-Reranker-F32.gguf", source, "F32", pooling=None)
    as_gguf_tower(tmp_path / "files" / "mmproj-Qwen3-VL-Reranker-F32.gguf", source)
    model = Qwen3VLForConditionalGeneration.from_pretrained(source, dtype=torch.float32).eval()
    texts = list(cases(ModelConfig.from_dir(source).media).values())
    want = np.array([yes_minus_no(model, source, reference_hidden(model, t)) for t in texts])
    with Encoder.from_pretrained(tmp_path / "files", task="rerank", dtype="float32") as encoder:
        got = encoder.score_media(texts)
    assert np.abs(got - want).max() <= 1e-4, (got, want)
    assert np.ptp(want) > 0.05  # the cases score apart


def test_a_qwen3_vl_model_ollama_pulled_with_its_projector(vl, tmp_path, monkeypatch):
    """A manifest's model layer and its projector layer (the tower's file, as `ollama create`
    takes an mmproj file beside a model) are the pair."""
    _, root, _ = vl
    layers = []
    (tmp_path / "blobs").mkdir()
    for kind, file in (
        ("model", "Qwen3-VL-Embedding-F32.gguf"),
        ("projector", "mmproj-Qwen3-VL-Embedding-F32.gguf"),
    ):
        data = (root / "F32" / file).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (tmp_path / "blobs" / f"sha256-{digest}").write_bytes(data)
        layers.append(
            {"mediaType": f"application/vnd.ollama.image.{kind}", "digest": f"sha256:{digest}"}
        )
    manifest = tmp_path / "manifests" / "registry.ollama.ai" / "acme" / "qwen3-vl-embedding" / "2b"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    laid_out = resolve_checkpoint("ollama:acme/qwen3-vl-embedding:2b")
    digests = [layer["digest"].replace(":", "-") for layer in layers]
    assert (laid_out / FILE).resolve() == tmp_path / "blobs" / digests[0]
    assert (laid_out / PROJECTOR).resolve() == tmp_path / "blobs" / digests[1]
    direct = resolve_checkpoint(root / "F32")
    config = json.loads((laid_out / "config.json").read_text())
    assert config == json.loads((direct / "config.json").read_text())
    assert config["vision_config"]["depth"] == 3


def test_a_qwen3_vl_repositorys_files_by_type_from_the_cache(vl, tmp_path, monkeypatch):
    """`owner/name:TYPE` of a Qwen3-VL GGUF repository: the model file of that type (a tower's
    file of the same type is not one), and its tower as llama.cpp's `-hf` picks it: of the
    "mmproj" files, the one of the nearest type's bits."""
    _, root, _ = vl
    snapshot = hub_snapshot(tmp_path, "acme/Tiny-VL-GGUF")
    text = root / "Q8_0" / "Qwen3-VL-Embedding-Q8_0.gguf"
    tower = root / "Q8_0" / "mmproj-Qwen3-VL-Embedding-F32.gguf"
    (snapshot / "Tiny-VL.Q8_0.gguf").symlink_to(text)
    for kind in ("Q8_0", "f16"):  # two files (the same tower): which one is linked tells
        (snapshot / f"Tiny-VL.mmproj-{kind}.gguf").write_bytes(tower.read_bytes())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    laid_out = resolve_checkpoint("acme/Tiny-VL-GGUF:Q8_0")
    assert (laid_out / FILE).resolve() == text.resolve()
    assert (laid_out / PROJECTOR).resolve() == snapshot / "Tiny-VL.mmproj-Q8_0.gguf"
    (snapshot / "Tiny-VL.mmproj-Q8_0.gguf").unlink()
    laid_out = resolve_checkpoint("acme/Tiny-VL-GGUF:Q8_0")
    assert (laid_out / PROJECTOR).resolve() == snapshot / "Tiny-VL.mmproj-f16.gguf"
    (snapshot / "Tiny-VL.mmproj-f16.gguf").unlink()
    with pytest.raises(GGUFError, match="none"):
        resolve_checkpoint("acme/Tiny-VL-GGUF:Q8_0")


def test_a_qwen3_vl_file_needs_its_tower_beside_it(vl, tmp_path):
    source, root, _ = vl
    alone = tmp_path / "alone"
    alone.mkdir()
    text = alone / "model.gguf"
    text.symlink_to(root / "F32" / "Qwen3-VL-Embedding-F32.gguf")
    with pytest.raises(GGUFError, match="Qwen3-VL text model, .*mmproj.*none"):
        resolve_checkpoint(text)
    for i in range(2):
        (alone / f"mmproj-{i}.gguf").symlink_to(root / "F32" / "mmproj-Qwen3-VL-Embedding-F32.gguf")
    with pytest.raises(GGUFError, match="2 are beside it .*mmproj-0.gguf, mmproj-1.gguf"):
        resolve_checkpoint(text)
    for i in range(2):
        (alone / f"mmproj-{i}.gguf").unlink()
    as_gguf_tower(alone / "mmproj-other.gguf", source, projector="QWEN2VL")
    with pytest.raises(GGUFError, match="a tower of projector 'qwen2vl_merger'"):
        resolve_checkpoint(text)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architecture": "llama"}, "architecture 'llama'"),
        ({"pooling": "RANK"}, "reranker's GGUF file"),
        ({"pre": "llama-bpe"}, "not Qwen2's byte-level BPE"),
    ],
)
def test_files_not_read_are_refused_by_name(replicas, tmp_path, change, message):
    path = as_gguf(tmp_path / "x.gguf", replicas["qwen3"], "F32", tokens=False, **change)
    with pytest.raises(GGUFError, match=message):
        resolve_checkpoint(path)
    assert not list((path.parent).glob("*/config.json"))


def test_a_file_that_is_not_gguf(files, tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointNotFoundError, match="directory .*, a GGUF file, nor"):
        resolve_checkpoint(path)
    path.write_bytes(files["qwen3", "Q8_0"][0].read_bytes()[:4000])  # cut short
    with pytest.raises(GGUFError, match="is not a GGUF file llama.cpp wrote"):
        resolve_checkpoint(path)
