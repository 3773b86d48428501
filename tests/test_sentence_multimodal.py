"""sentence-transformers' own saves of multimodal Qwen models, served as sentence-transformers
runs them: Qwen3-VL-Embedding as a SentenceTransformer (its chat template, the prompts as
system turns, last-token pooling), the MultiVectorEncoders sentence-transformers makes of it
and of a bare Qwen3-VL (ColQwen3-VL-Embedding: a Dense of every token, MultiVectorMask,
Normalize) and a CrossEncoder over a Qwen3-VL-Reranker (LogitScore of "yes" against "no"), all
written by sentence-transformers 6.3 itself from Qwen3-VL replicas, with transformers 5's
processor_config.json in place of preprocessor_config.json. The reference is
sentence-transformers' encode_query, encode_document, encode and predict on the same
directories, run in a process of its own (sentence_reference.py: its processor needs
torchvision): fp32 cosine >= 0.9999 per vector and per token, scores within 1e-4.
"""

import json

import numpy as np
import pytest
import sentence_reference
from test_qwen3_vl import image_files

from qwen_embed.config import ModelConfig
from qwen_embed_client.contract import EmbedOptions, RequestError, RerankOptions
from qwen_embed_deploy.serving.images import ImageSettings
from qwen_embed_deploy.serving.tokenizer import TextTokenizer

from reference import cosine
from replicas import QWEN3_VL_CHAT_TEMPLATE, QWEN3_VL_RERANKER_CHAT_TEMPLATE, qwen3_vl

# Every test reads the reference, which runs in a process of its own: the server tier's.
pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(
        not sentence_reference.available(),
        reason="the reference's processor needs torchvision (.venv/video-reference: make setup)",
    ),
]

FP32_COSINE = 0.9999
PROMPTS = {
    "query": "Retrieve images or text relevant to the user's query",  # no full stop
    "document": "Represent the user's input.",
}
QUERY = "which chart shows a yellow circle?"
# (task, text, image): encode_query, encode_document or encode (None: the default prompt)
CASES = [
    ("query", QUERY, None),
    ("document", "a chart of quarterly sales", None),
    ("document", "", "png"),
    ("document", "quarterly report, page 2", "jpeg"),
    (None, "a chart of quarterly sales", None),
]
RERANK_PROMPTS = {
    "query": "Given a search query, retrieve relevant candidates that answer the query."
}
# (query, document) pairs for the CrossEncoder: each side (text, image)
PAIRS = [
    ((QUERY, None), ("a chart of quarterly sales", None)),
    ((QUERY, None), ("", "png")),
    ((QUERY, None), ("quarterly report, page 2", "jpeg")),
    (("", "png"), ("a chart of quarterly sales", None)),
]
# The bare replica's MultiVectorEncoder leaves these tokens' vectors out of every text
BARE_SKIPLIST = {"skiplist_words": ["?", ","], "skiplist_tasks": ["query", "document"]}
# The processor budget of the MultiVectorEncoder made of the SentenceTransformer and of the
# CrossEncoder, smaller than the embedding script's: the PNG is resized down (90 x 60 pixels,
# more than 48 x 48), where the script's budget keeps its size.
PROCESSOR_PIXELS = {"shortest_edge": 16 * 16, "longest_edge": 48 * 48}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"st": the SentenceTransformer's directory, "multi": the MultiVectorEncoder made of it,
    "bare": the one made of the replica as it is (no prompts, no generation prompt; a
    skiplist), "cross": a CrossEncoder of a Qwen3-VL reranker replica, "reranker": that
    replica as published}, the reference's vectors per model per case, and its scores per
    pair."""
    root = tmp_path_factory.mktemp("sentence-multimodal")
    base = qwen3_vl(root / "qwen3-vl", files=True, chat_template=QWEN3_VL_CHAT_TEMPLATE)
    images = {}
    for name, data in image_files().items():
        images[name] = root / f"{name}.{'jpg' if name == 'jpeg' else 'png'}"
        images[name].write_bytes(data)
    dirs = {name: root / name for name in ("st", "multi", "bare", "cross")}
    dirs["reranker"] = qwen3_vl(
        root / "reranker", files=True, tied=False, chat_template=QWEN3_VL_RERANKER_CHAT_TEMPLATE
    )
    build = [
        {"kind": "SentenceTransformer", "base": str(base), "out": str(dirs["st"])}
        | {"prompts": PROMPTS, "default_prompt_name": "document"},
        {"kind": "MultiVectorEncoder", "base": str(dirs["st"]), "out": str(dirs["multi"])}
        | {"seed": 5, "pixels": PROCESSOR_PIXELS},
        {"kind": "MultiVectorEncoder", "base": str(base), "out": str(dirs["bare"]), "seed": 7}
        | {"skiplist": BARE_SKIPLIST},
        {"kind": "CrossEncoder", "base": str(dirs["reranker"]), "out": str(dirs["cross"])}
        | {"prompts": RERANK_PROMPTS, "default_prompt_name": "query"}
        | {"pixels": PROCESSOR_PIXELS},
    ]
    encode = [
        {
            "model_dir": str(d),
            "task": task,
            "text": text or None,
            "image": image and str(images[image]),
        }
        for d in (dirs["st"], dirs["multi"], dirs["bare"])
        for task, text, image in CASES
    ]

    def side(text, image):
        return {"text": text or None, "image": image and str(images[image])}

    predict = [
        {"model_dir": str(dirs["cross"]), "query": side(*q), "document": side(*d)} for q, d in PAIRS
    ]
    found, scores = sentence_reference.run(
        {"build": build, "encode": encode, "predict": predict}, root
    )
    want = {
        name: found[i * len(CASES) : (i + 1) * len(CASES)]
        for i, name in enumerate(("st", "multi", "bare"))
    }
    want["cross"] = scores
    return dirs, want


def test_the_layouts_are_sentence_transformers_own(models):
    """What the reference wrote is what the server reads: the chat template as a modality,
    processor_config.json alone (transformers 5), the MultiVectorEncoder's modules."""
    dirs, _ = models
    for name in ("st", "multi", "bare", "cross"):
        d = dirs[name]
        config = json.loads((d / "sentence_bert_config.json").read_text())
        assert "message" in config["modality_config"]
        assert (d / "processor_config.json").is_file()
        assert not (d / "preprocessor_config.json").exists()
    modules = json.loads((dirs["multi"] / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == [
        "Transformer",
        "Dense",
        "MultiVectorMask",
        "Normalize",
    ]
    config = ModelConfig.from_dir(dirs["multi"])
    assert config.multi_vector and config.token_size == 128 and config.media is not None
    # the patch size is the replica's (4), not the default's (16): read from processor_config
    assert ImageSettings.from_dir(dirs["st"]).patch_size == 4
    budget = ImageSettings.from_dir(dirs["multi"])
    assert (budget.min_pixels, budget.max_pixels) == tuple(PROCESSOR_PIXELS.values())


def test_prompts_are_system_turns(models):
    """A prompt is the system turn as sentence-transformers writes it (no full stop added), the
    default prompt where a request names none; an instruction keeps the script's rule; an
    empty prompt is no system turn; a MultiVectorEncoder reads its own prompts only."""
    dirs, _ = models
    tok = TextTokenizer(dirs["st"], 8192)
    decode = tok._tok.decode

    def system(**options) -> str:
        (ids,), _ = tok.encode_media(["x"], [""], EmbedOptions(**options), ["TEXT"])
        return decode(ids, skip_special_tokens=False).split("<|im_end|>")[0]

    assert system() == "<|im_start|>system\n" + PROMPTS["document"]
    assert system(prompt_name="query") == "<|im_start|>system\n" + PROMPTS["query"]
    assert system(instruction="Find charts") == "<|im_start|>system\nFind charts."
    # the MultiVectorEncoders render their own chat template: with its generation prompt and
    # the task's prompt as the system turn, or (made of the bare replica) with neither
    for name, want in (
        ("multi", f"<|im_start|>system\n{PROMPTS['query']}<|im_end|>\n"),
        ("bare", ""),
    ):
        tok = TextTokenizer(dirs[name], 8192)
        opts = EmbedOptions(prompt_name="query", per_token=True)
        (ids,), _ = tok.encode_media(["x"], [""], opts, ["TEXT"])
        tail = "<|im_start|>assistant\n" if name == "multi" else ""
        with pytest.raises(RequestError, match="its tasks. prompts are its system turns"):
            tok.encode_media(["x"], [""], EmbedOptions(instruction="Find charts"), ["TEXT"])
        assert (
            decode(ids, skip_special_tokens=False) == f"{want}<|im_start|>user\nx<|im_end|>\n{tail}"
        )


def served_vectors(server, model: str, multi: bool) -> list[np.ndarray]:
    from qwen_embed_client import EmbeddingClient

    files = image_files()
    got = []
    with EmbeddingClient(server.grpc_url, model=model) as client:
        for task, text, image in CASES:
            images = [[files[image]]] if image else None
            options = {"prompt_name": task} if task else {}
            call = client.embed_tokens if multi else client.embed
            got.append(call([text], images=images, **options)[0])
    return got


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    from qwen_embed_deploy.repository import render
    from qwen_embed_deploy.triton import TritonServer

    dirs, _ = models
    where = tmp_path_factory.mktemp("sentence-multimodal-served")
    deployments = {"embed": dirs["multi"], "st_vl": dirs["st"], "bare_vl": dirs["bare"]}
    overrides = {"encoder": {"dtype": "float32"}}
    repo = render(where / "repo", deployments, overrides, rerankers={"rerank": dirs["cross"]})
    with TritonServer(repo, log_path=where / "server.log") as server:
        yield server


def test_served_as_sentence_transformers_encodes(models, served):
    """Each case's vector (the SentenceTransformer's) and token vectors (the
    MultiVectorEncoders') through Triton against sentence-transformers' on the same
    directory; the prompts, the image budget and the skiplist each change what is compared."""
    dirs, want = models
    models_served = (("st_vl", "st", False), ("embed", "multi", True), ("bare_vl", "bare", True))
    for model, name, multi in models_served:
        got = served_vectors(served, model, multi)
        for i, (ours, theirs) in enumerate(zip(got, want[name], strict=True)):
            assert ours.shape == theirs.shape, (name, CASES[i])
            assert cosine(np.atleast_2d(ours), np.atleast_2d(theirs)).min() >= FP32_COSINE
    # a query's prompt and a document's move the vector of the same kind of text
    st = want["st"]
    assert cosine(st[0][None], st[1][None])[0] < 0.999
    # the default prompt is the document's: encode() = encode_document()
    assert cosine(st[1][None], st[4][None])[0] >= FP32_COSINE
    # the processor's budget, not the script's: the PNG in fewer tokens, as many as its rows
    assert len(want["multi"][2]) == image_rows(models, "multi") < image_rows(models, "st")
    # the bare one's skiplist: its query's "?" has no vector (the tokenizer's FINISH says so)
    tok = TextTokenizer(dirs["bare"], 8192)
    opts = EmbedOptions(prompt_name="query", per_token=True)
    (ids,), _ = tok.encode_media([QUERY], [""], opts, ["TEXT"])
    assert len(want["bare"][0]) == len(ids) - 1 and tok.finish(opts).skiplist


def image_rows(models, name: str) -> int:
    """The ids of the PNG alone as a document, the image resized within `name`'s budget."""
    from qwen_embed_deploy.serving.images import fit
    from qwen_embed_deploy.serving.tokenizer import image_blocks

    dirs, _ = models
    settings = ImageSettings.from_dir(dirs[name])
    height, width = fit(60, 90, settings)
    blocks = image_blocks([height * width // settings.factor**2])
    tok = TextTokenizer(dirs[name], 8192)
    (ids,), _ = tok.encode_media([""], [blocks], EmbedOptions(prompt_name="document"), ["IMAGES"])
    return len(ids)


def test_what_it_does_not_read_is_refused(served):
    """A video for the MultiVectorEncoder (its processor samples frames its own way) is
    refused for that request, and the next is served."""
    from qwen_embed_client import EmbeddingClient, EmbeddingError

    files = image_files()
    with EmbeddingClient(served.grpc_url) as client:
        with pytest.raises(EmbeddingError, match="VIDEOS"):
            client.embed_tokens(["a clip"], videos=[[[files["png"], files["png"]]]])
        assert client.embed_tokens(["still served"])[0].shape[1] == 128


def test_maxsim_through_the_gateway(models, served):
    """vLLM's score API with the MultiVectorEncoder as the embed model: the query read as
    `encode_query` reads it, a page given as an image part and a text document as
    `encode_document` reads them, scored by MaxSim as sentence-transformers' vectors score."""
    import httpx
    from test_qwen3_vl import data_url

    from qwen_embed_client import maxsim_scores

    from triton_helpers import gateway_process

    _, want = models
    query, document = want["multi"][0], want["multi"][1]
    page = want["multi"][2]
    expected = maxsim_scores(query, [page, document])
    image_part = {"type": "image_url", "image_url": {"url": data_url(image_files()["png"])}}
    with gateway_process(served) as base:
        body = {"model": "embed", "text_1": QUERY, "text_2": [[image_part], CASES[1][1]]}
        scored = httpx.post(f"{base}/v1/score", json=body, timeout=60)
        assert scored.status_code == 200, scored.text
        got = np.array([d["score"] for d in scored.json()["data"]])
        assert np.abs(got - expected).max() <= 1e-3, (got, expected)


def test_a_cross_encoders_pairs_are_the_reranker_scripts(models):
    """The CrossEncoder over Qwen3-VL-Reranker renders its pairs through its chat template
    (the query's and the document's images as image parts before their text); where the
    template writes the reranker script's format, its ids are the script's, image for image."""
    from qwen_embed_deploy.serving.chat_pairs import ChatPairTokenizer
    from qwen_embed_deploy.serving.rerank import PairTokenizer, pair_tokenizer
    from qwen_embed_deploy.serving.tokenizer import image_blocks

    dirs, _ = models
    ours = pair_tokenizer(dirs["cross"], 8192)
    script = PairTokenizer(dirs["reranker"], 8192)
    assert isinstance(ours, ChatPairTokenizer) and ours.reads_images and not ours.reads_video
    opts = RerankOptions(instruction=RERANK_PROMPTS["query"])
    documents = ["a chart", "", "a page"]
    visuals = ["", image_blocks([6]), image_blocks([4, 2])]
    for query, query_visuals in ((QUERY, ""), ("", image_blocks([3]))):
        got = ours.encode(query, documents, opts, query_visuals, visuals)
        assert got == script.encode(query, documents, opts, query_visuals, visuals)
    # the instruction is the checkpoint's default prompt where a request names none
    default = ours.encode(QUERY, documents, RerankOptions(), "", visuals)
    assert default == ours.encode(QUERY, documents, opts, "", visuals)
    budget = ImageSettings.from_dir(dirs["cross"])  # its processor's, as for any it saved
    assert (budget.min_pixels, budget.max_pixels) == tuple(PROCESSOR_PIXELS.values())


def test_a_cross_encoders_scores_through_triton(models, served):
    """The CrossEncoder as the rerank model: text pairs, image documents, a document of text
    and an image, an image query, against its predict (sigmoid of "yes" less "no")."""
    from qwen_embed_client import EmbeddingClient

    _, want = models
    files = image_files()
    with EmbeddingClient(served.grpc_url) as client:
        documents = [d for _, (d, _) in PAIRS[:3]]
        images = [[files[im]] if im else [] for _, (_, im) in PAIRS[:3]]
        scores = list(client.rerank(QUERY, documents, document_images=images).scores)
        (query_text, query_image), (document, _) = PAIRS[3]
        scores += list(
            client.rerank(query_text, [document], query_images=[files[query_image]]).scores
        )
    assert np.abs(np.array(scores) - np.array(want["cross"])).max() <= 1e-4, (scores, want)
    assert np.ptp(want["cross"]) > 1e-3  # the pairs score apart: the check can fail
