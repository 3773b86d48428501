"""Embedders on the Qwen3 architecture beyond Qwen's own, as published (tests/replicas.py):

- voyage-4-nano: `use_bidirectional_attention`, a top-level `linear` projection to a wider
  vector (2048 in the real model) after the final norm, mean pooling, its prompts;
- pplx-embed-v1: architecture PPLXQwen3Model, bidirectional, mean pooling, then its
  sentence-transformers quantizer (int8 codes round(127 tanh(x))), no prompts;
- pplx-embed-context-v1: pplx-embed-v1's model under architecture PPLXQwen3ContextualModel,
  without sentence-transformers modules: a document's chunks joined by the tokenizer's
  sep_token, read as one text, one mean (then tanh) per chunk between the separators
  (`chunk_by_separator`; the client's embed_contextual, Perplexity's
  /v1/contextualizedembeddings with the `perplexityai` SDK);
- jina-embeddings-v5-text-small: a causal Qwen3 with one LoRA adapter per task beside it
  (`adapter` picks one, merged at load; its reference is peft's unmerged forward), last-token
  pooling, its "Query: " prompt.

Their reference is their remote code's recipe, written out with transformers' Qwen3Model
(the remote code is not downloadable here): every layer attending both ways (`is_causal`
false), voyage's `linear` on every token, the mean over the tokens, pplx's tanh. Vectors must
reach cosine >= 0.9999 in fp32 and >= 0.999 in bf16, on each CPU attention backend, through
Triton (HTTP and gRPC) and through the gateway.

A sentence-transformers `Dense` module after the Pooling (any checkpoint may carry one) is
checked against sentence-transformers itself.
"""

import json
import shutil
import subprocess
import sys
from base64 import b64decode

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file
from sentence_transformers import SentenceTransformer
from tokenizers import Tokenizer
from transformers import Qwen3Config, Qwen3Model

from qwen_embed import ChunkedText, Encoder, adapters
from qwen_embed.adapters import adapter_names
from qwen_embed.config import ModelConfig
from qwen_embed_client import EmbeddingClient, EmbeddingError
from qwen_embed_client.contract import EmbedOptions, RequestError
from qwen_embed_client.gateway.app import create_app
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.serving.tokenizer import PromptSet, TextTokenizer
from qwen_embed_deploy.triton import TritonServer

from reference import cosine
from replicas import (
    JINA_TASKS,
    PPLX_SEPARATOR,
    QWEN3_QUERY,
    VOYAGE_PROMPTS,
    jina_embeddings_v5,
    pplx_embed,
    pplx_embed_context,
    qwen3_embedding,
    voyage_4_nano,
    with_dense,
)
from triton_helpers import gateway_process, infer, send_json

# Three replicas with the real vocabulary take ~10 s to build: the server tier's.
pytestmark = pytest.mark.server

FP32_COSINE = 0.9999
BF16_COSINE = 0.999
PROJECTION = 96  # the replica's num_labels (hidden 64)
TEXTS = [
    "Which planet is known as the Red Planet?",
    "Mars is often called the Red Planet because of its iron oxide surface.",
    "naïve café — emoji 🎉 你好",
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bidirectional")
    return {
        "voyage": voyage_4_nano(root / "voyage-4-nano", projection=PROJECTION),
        "pplx": pplx_embed(root / "pplx-embed-v1-0.6b"),
        "pplx_context": pplx_embed_context(root / "pplx-embed-context-v1-0.6b"),
        "dense": with_dense(qwen3_embedding(root / "qwen3-dense"), 48),
    }


def token_ids(model_dir, texts, prefix=""):
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tok.encode(prefix + t).ids for t in texts]


def _qwen3(model_dir, dtype=torch.float32, causal=False) -> Qwen3Model:
    config = Qwen3Config.from_pretrained(model_dir)
    config.is_causal = causal  # what their remote code sets on every layer
    return Qwen3Model.from_pretrained(
        model_dir, config=config, dtype=dtype, attn_implementation="eager"
    ).eval()


def reference(model_dir, sequences, *, causal=False, dtype=torch.float32) -> np.ndarray:
    """The checkpoint's remote-code recipe in transformers, one unpadded sequence at a time,
    L2-normalised."""
    model = _qwen3(model_dir, dtype, causal)
    tensors = load_file(model_dir / "model.safetensors")
    linear = tensors.get("linear.weight")
    quantized = "pplx" in model_dir.name
    rows = []
    with torch.no_grad():
        for ids in sequences:
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            if linear is not None:
                hidden = hidden @ linear.to(hidden.dtype).t()
            pooled = hidden.float().mean(0)
            rows.append(torch.tanh(pooled) if quantized else pooled)
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1).numpy()


def test_the_checkpoints_say_what_follows_their_transformer(dirs):
    voyage = ModelConfig.from_dir(dirs["voyage"])
    assert not voyage.is_causal and voyage.family == "qwen3"
    assert voyage.sentence.pooling == "mean" and voyage.embedding_size == PROJECTION
    (dense,) = voyage.sentence.dense
    assert (dense.in_features, dense.out_features, dense.bias) == (64, PROJECTION, False)
    pplx = ModelConfig.from_dir(dirs["pplx"])
    assert not pplx.is_causal and pplx.embedding_size == pplx.hidden_size == 64
    assert (pplx.sentence.pooling, pplx.sentence.final_activation) == ("mean", "tanh")
    assert PromptSet.from_dir(dirs["voyage"]).prompts == VOYAGE_PROMPTS
    assert PromptSet.from_dir(dirs["pplx"]).prompts == {}  # none; not Qwen3-Embedding's


@pytest.mark.parametrize("attn_backend", ["native", "torch"])
@pytest.mark.parametrize("name", ["voyage", "pplx"])
def test_vectors_match_the_reference_recipe(dirs, name, attn_backend):
    model_dir = dirs[name]
    seqs = token_ids(model_dir, TEXTS, VOYAGE_PROMPTS["query"] if name == "voyage" else "")
    ref = reference(model_dir, seqs)
    with Encoder.from_pretrained(model_dir, dtype="float32", attn_backend=attn_backend) as enc:
        assert enc.route.pooling == "mean" and not enc.route.prefix_reuse
        vectors = enc.embed(seqs)
        half = enc.embed(seqs, dimensions=PROJECTION // 2 if name == "voyage" else 32)
    assert vectors.shape == (len(TEXTS), PROJECTION if name == "voyage" else 64)
    assert cosine(vectors, ref).min() >= FP32_COSINE
    # Matryoshka: truncated after the projection, then normalised
    assert cosine(half, ref[:, : half.shape[1]]).min() >= FP32_COSINE
    # the mask matters: the causal recipe is far from it, so this test can fail
    assert cosine(vectors, reference(model_dir, seqs, causal=True)).min() < 0.99


@pytest.mark.parametrize("name", ["voyage", "pplx"])
def test_bf16_vectors_match_the_bf16_reference(dirs, name):
    model_dir = dirs[name]
    seqs = token_ids(model_dir, TEXTS)
    ref = reference(model_dir, seqs, dtype=torch.bfloat16)
    with Encoder.from_pretrained(model_dir, dtype="bfloat16") as enc:
        assert cosine(enc.embed(seqs), ref).min() >= BF16_COSINE


def test_pplx_codes_are_its_quantizers(dirs):
    """normalize=false gives tanh of the mean: x 127, rounded, the quantizer's int8 codes."""
    seqs = token_ids(dirs["pplx"], TEXTS)
    model = _qwen3(dirs["pplx"])
    with torch.no_grad():
        pooled = torch.stack(
            [model(input_ids=torch.tensor([s])).last_hidden_state[0].mean(0) for s in seqs]
        )
    codes = torch.clamp(torch.round(torch.tanh(pooled) * 127), -128, 127).numpy()
    with Encoder.from_pretrained(dirs["pplx"], dtype="float32") as enc:
        ours = np.clip(np.rint(enc.embed(seqs, normalize=False) * 127), -128, 127)
    assert np.abs(ours - codes).max() <= 1  # a value at a rounding boundary may go either way
    assert (ours == codes).mean() >= 0.99


def test_a_dense_module_as_sentence_transformers_applies_it(dirs):
    st = SentenceTransformer(str(dirs["dense"]), device="cpu")
    expected = st.encode(TEXTS, prompt_name="query")
    seqs = [st.tokenizer(QWEN3_QUERY + t)["input_ids"] for t in TEXTS]
    with Encoder.from_pretrained(dirs["dense"], dtype="float32") as enc:
        assert enc.route.pooling == "last" and enc.embedding_size == 48
        vectors = enc.embed(seqs)
    assert vectors.shape == expected.shape == (len(TEXTS), 48)
    assert cosine(vectors, expected).min() >= FP32_COSINE


def test_a_projection_under_tensor_parallelism(dirs):
    """tp_size 2: rank 0 holds the projection and applies it to the gathered hidden states."""
    seqs = token_ids(dirs["voyage"], TEXTS)
    with Encoder.from_pretrained(dirs["voyage"], dtype="float32", tp_size=2) as enc:
        assert cosine(enc.embed(seqs), reference(dirs["voyage"], seqs)).min() >= FP32_COSINE


DOCUMENTS = [
    [
        "Mars is the fourth planet from the Sun.",
        "Its red colour comes from iron oxide on its surface.",
        "naïve café — emoji 🎉 你好",
    ],
    ["Phobos and Deimos are its two small moons."],
]


def contextual_reference(model_dir, documents, dtype=torch.float32) -> list[np.ndarray]:
    """pplx-embed-context's remote-code `encode` written out in transformers: a document's
    chunks joined by the tokenizer's sep_token and tokenized as one text, every layer
    attending both ways, each chunk the mean of its tokens between the separators, then its
    quantizer's tanh; L2-normalised per chunk."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    separator = tok.token_to_id(PPLX_SEPARATOR)
    model = _qwen3(model_dir, dtype)
    out = []
    with torch.no_grad():
        for chunks in documents:
            ids = tok.encode(PPLX_SEPARATOR.join(chunks)).ids
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0].float()
            cuts = [i for i, t in enumerate(ids) if t == separator]
            bounds = zip([0] + [c + 1 for c in cuts], cuts + [len(ids)], strict=True)
            pooled = torch.tanh(torch.stack([hidden[a:b].mean(0) for a, b in bounds]))
            out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
    return out


def separated(model_dir, documents, **options):
    """The tokenizer model's ids and chunks of the documents joined by the separator."""
    texts = [PPLX_SEPARATOR.join(chunks) for chunks in documents]
    opts = EmbedOptions(chunk_by_separator=True, **options)
    return TextTokenizer(model_dir, 512).encode_chunks(texts, opts)


def test_a_contextual_checkpoint_reads_its_chunks_between_its_separators(dirs, tmp_path):
    model_dir = dirs["pplx_context"]
    config = ModelConfig.from_dir(model_dir)  # no modules.json: its remote code's mean, tanh
    assert not config.is_causal and config.embedding_size == 64
    assert (config.sentence.pooling, config.sentence.final_activation) == ("mean", "tanh")
    assert PromptSet.from_dir(model_dir).prompts == {}
    assert TextTokenizer(model_dir, 512).separator == PPLX_SEPARATOR
    assert TextTokenizer(dirs["pplx"], 512).separator is None
    other = tmp_path / "pplx-embed-v1-with-a-sep-token"  # a sep_token alone joins nothing
    shutil.copytree(dirs["pplx"], other)
    tokenizer_config = json.loads((other / "tokenizer_config.json").read_text())
    tokenizer_config["sep_token"] = PPLX_SEPARATOR
    (other / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert TextTokenizer(other, 512).separator is None
    ids, chunks, counts = separated(model_dir, DOCUMENTS)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for chunked, text_ids, count, doc in zip(chunks, ids, counts, DOCUMENTS, strict=True):
        joined = PPLX_SEPARATOR.join(doc)
        assert text_ids == tok.encode(joined).ids and count == len(text_ids)
        # each chunk's characters in the joined text, its tokens alone its own
        assert [joined[a:b] for a, b in chunked.chars] == doc
        for (a, b), chunk in zip(chunked.tokens, doc, strict=True):
            assert text_ids[a:b] == tok.encode(chunk).ids


@pytest.mark.parametrize("attn_backend", ["native", "torch"])
def test_contextual_chunks_match_the_reference_recipe(dirs, attn_backend):
    model_dir = dirs["pplx_context"]
    ids, chunks, _ = separated(model_dir, DOCUMENTS)
    texts = [ChunkedText(np.array(i), c.tokens, c.tail) for i, c in zip(ids, chunks, strict=True)]
    refs = contextual_reference(model_dir, DOCUMENTS)
    with Encoder.from_pretrained(model_dir, dtype="float32", attn_backend=attn_backend) as enc:
        vectors = enc.embed_chunks(texts)
        half = enc.embed_chunks(texts, dimensions=32)
    for ours, short, ref, doc in zip(vectors, half, refs, DOCUMENTS, strict=True):
        assert ours.shape == (len(doc), 64)
        assert cosine(ours, ref).min() >= FP32_COSINE
        assert cosine(short, ref[:, :32]).min() >= FP32_COSINE
    # each chunk sees the others: alone, a chunk's vector is another (this can fail)
    alone = contextual_reference(model_dir, [[c] for c in DOCUMENTS[0]])
    assert cosine(vectors[0], np.concatenate(alone)).max() < 0.99
    with Encoder.from_pretrained(model_dir, dtype="bfloat16") as enc:
        bf16 = enc.embed_chunks(texts)
    bf16_refs = contextual_reference(model_dir, DOCUMENTS, torch.bfloat16)
    for ours, ref in zip(bf16, bf16_refs, strict=True):
        assert cosine(ours, ref).min() >= BF16_COSINE


@pytest.mark.parametrize(
    ("name", "documents", "options", "message"),
    [
        ("pplx", DOCUMENTS, {}, r"'chunk_by_separator' needs a model whose recipe joins"),
        ("pplx_context", [["a", "", "b"]], {}, r"'TEXT\[0\]' chunk 1 holds no tokens"),
        ("pplx_context", [["word " * 600]], {}, r"'TEXT\[0\]' has 601 tokens, more than the lim"),
        ("pplx_context", DOCUMENTS, {"chunk_size": 4}, r"\['chunk_size', 'chunk_by_separator'\]"),
    ],
)
def test_chunks_by_separator_refused_saying_why(dirs, name, documents, options, message):
    with pytest.raises(RequestError, match=message):
        separated(dirs[name], documents, **options)


@pytest.fixture(scope="module")
def server(dirs, tmp_path_factory):
    where = tmp_path_factory.mktemp("bidirectional-triton")
    deployments = {name: dirs[name] for name in ("voyage", "pplx")}
    deployments["embed"] = dirs["pplx_context"]  # what the gateway's process fronts
    repo = render(where / "repo", deployments, {"encoder": {"dtype": "float32"}})
    with TritonServer(repo, log_path=where / "server.log") as s:
        yield s


@pytest.mark.parametrize("name", ["voyage", "pplx"])
def test_served_through_triton_and_the_gateway(server, dirs, name):
    model_dir = dirs[name]
    prompt = "query" if name == "voyage" else None
    seqs = token_ids(model_dir, TEXTS, VOYAGE_PROMPTS["query"] if prompt else "")
    ref = reference(model_dir, seqs)
    params = {"prompt_name": prompt} if prompt else {}
    for protocol in ("http", "grpc"):
        vectors, counts = infer(server, TEXTS, protocol, model=name, **params)
        assert cosine(vectors, ref).min() >= FP32_COSINE, protocol
        assert counts.reshape(-1).tolist() == [len(s) for s in seqs]
    app = create_app([server.grpc_url], model_names=(name,), triton_model=name)
    with TestClient(app) as client:
        body = {"input": TEXTS, "model": name} | ({"prompt_name": prompt} if prompt else {})
        response = client.post("/v1/embeddings", json=body)
        assert response.status_code == 200, response.text
        got = np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)
        info = client.get("/info").json()
    assert cosine(got, ref).min() >= FP32_COSINE
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert got.shape[1] == (PROJECTION if name == "voyage" else 64)


def test_voyages_sdk_on_voyage_4_nano(server, dirs):
    """Voyage AI's SDK against a gateway in front of voyage-4-nano's replica (served under
    another name: the SDK computes a model it names "voyage-4-nano" itself): no input type
    embeds the text as it is, "query" and "document" with the checkpoint's prompts, as
    Voyage's own local backend does; a shorter output dimension renormalised; its bit codes
    those sentence-transformers makes of the same floats."""
    import voyageai
    from sentence_transformers.util.quantization import quantize_embeddings

    model_dir = dirs["voyage"]
    names = ("--triton-model", "voyage", "--served-model-name", "nano")
    with gateway_process(server, *names) as base:
        vo = voyageai.Client(api_key="unused", base_url=f"{base}/v1")
        for input_type in (None, "query", "document"):
            prompt = VOYAGE_PROMPTS[input_type] if input_type else ""
            ref = reference(model_dir, token_ids(model_dir, TEXTS, prompt))
            answer = vo.embed(TEXTS, model="nano", input_type=input_type)
            got = np.array(answer.embeddings, dtype=np.float32)
            assert cosine(got, ref).min() >= FP32_COSINE, input_type
            assert answer.total_tokens == sum(map(len, token_ids(model_dir, TEXTS, prompt)))
        short = vo.embed(TEXTS, model="nano", input_type="document", output_dimension=32)
        short = np.array(short.embeddings, dtype=np.float32)
        cut = ref[:, :32] / np.linalg.norm(ref[:, :32], axis=1, keepdims=True)
        assert cosine(short, cut).min() >= FP32_COSINE
        for kind in ("binary", "ubinary"):
            codes = vo.embed(
                TEXTS, model="nano", input_type="document", output_dimension=32, output_dtype=kind
            )
            want = quantize_embeddings(short, precision=kind)
            assert np.array_equal(np.array(codes.embeddings), want), kind


def perplexity_codes(items) -> np.ndarray:
    """The SDK's base64_int8 embeddings as int8 rows."""
    return np.array([np.frombuffer(b64decode(item.embedding), np.int8) for item in items])


def perplexity_signs(items) -> np.ndarray:
    """The SDK's base64_binary embeddings as rows of bits (least significant first)."""
    rows = [np.frombuffer(b64decode(item.embedding), np.uint8) for item in items]
    return np.array([np.unpackbits(row, bitorder="little") for row in rows])


def test_contextual_chunks_through_triton_the_client_and_perplexitys_sdk(server, dirs):
    from perplexity import Perplexity

    refs = contextual_reference(dirs["pplx_context"], DOCUMENTS)
    for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
        with EmbeddingClient(url, protocol=protocol) as client:
            results = client.embed_contextual(DOCUMENTS)
            raw = client.embed_contextual(DOCUMENTS, normalize=False, dimensions=32)
            whole = client.embed(TEXTS, normalize=False)  # the texts themselves: mean, tanh
        with EmbeddingClient(url, protocol=protocol, model="pplx") as client:
            with pytest.raises(EmbeddingError, match="has no chunk separator"):
                client.embed_contextual(DOCUMENTS)
        for result, ref, doc in zip(results, refs, DOCUMENTS, strict=True):
            assert cosine(result.embeddings, ref).min() >= FP32_COSINE, protocol
            joined = PPLX_SEPARATOR.join(doc)
            assert [joined[a:b] for a, b in result.spans] == doc
            assert result.token_count == len(token_ids(dirs["pplx_context"], [joined])[0])
    name = "pplx-embed-context-v1-0.6b"
    # Perplexity's SDK sends its embeddings API pplx-embed-v1's names only: one is an alias here
    with gateway_process(server, "--served-model-name", name, "pplx-embed-v1-0.6b") as base:
        api = Perplexity(api_key="none", base_url=base)
        codes = api.contextualized_embeddings.create(input=DOCUMENTS, model=name, dimensions=32)
        bits = api.contextualized_embeddings.create(
            input=DOCUMENTS, model=name, encoding_format="base64_binary"
        )
        # OpenAI's default format is the route's (floats): Perplexity's codes are asked for
        plain = api.embeddings.create(
            input=TEXTS, model="pplx-embed-v1-0.6b", encoding_format="base64_int8"
        )
        plain_bits = api.embeddings.create(
            input=TEXTS, model="pplx-embed-v1-0.6b", encoding_format="base64_binary", dimensions=32
        )
        url = f"{base}/v1/contextualizedembeddings"
        refused = send_json("POST", url, {"model": name, "input": [["a", ""]]})
        overlong = send_json("POST", url, {"model": name, "input": [["word " * 40000]]})
        holding = send_json("POST", url, {"input": [["a", f"b{PPLX_SEPARATOR}c"]]})
        listed = send_json("GET", f"{base}/v1/models")[1]["data"]
        jina = {"model": name, "input": DOCUMENTS[0], "late_chunking": True}
        late = send_json("POST", f"{base}/v1/embeddings", jina)
        jina_holding = send_json(
            "POST", f"{base}/v1/embeddings", jina | {"input": ["a", f"b{PPLX_SEPARATOR}"]}
        )
        twice = {"input": ["a"], "encoding_format": "base64_int8", "embedding_type": "int8"}
        coded_twice = send_json("POST", f"{base}/v1/embeddings", twice)
        cast = twice | {"embedding_type": None, "embed_dtype": "bfloat16"}
        coded_cast = send_json("POST", f"{base}/v1/embeddings", cast)
    assert codes.usage.total_tokens == sum(r.token_count for r in results)
    for coded, binary, scaled, ref in zip(codes.data, bits.data, raw, refs, strict=True):
        assert cosine(scaled.embeddings, ref[:, :32]).min() >= FP32_COSINE  # tanh, unnormalised
        int8 = perplexity_codes(coded.data)
        expected = np.clip(np.rint(scaled.embeddings * 127), -128, 127)
        assert int8.shape == expected.shape and np.abs(int8 - expected).max() <= 1
        assert (int8 == expected).mean() >= 0.99  # a value at a rounding boundary may differ
        signs = perplexity_signs(binary.data)
        assert signs.shape == ref.shape and (signs == (ref >= 0)).mean() >= 0.99
    assert refused[0] == 400 and refused[1]["error"]["param"] == "input"
    assert overlong[0] == 400
    # /v1/embeddings in Perplexity's encodings: the unnormalised vectors' codes and signs
    seqs = token_ids(dirs["pplx_context"], TEXTS)
    assert cosine(whole, reference(dirs["pplx_context"], seqs)).min() >= FP32_COSINE
    int8 = perplexity_codes(plain.data)
    assert np.abs(int8 - np.clip(np.rint(whole * 127), -128, 127)).max() <= 1
    assert plain.usage.total_tokens == sum(map(len, seqs))
    assert coded_twice[0] == 400 and coded_twice[1]["error"]["param"] == "encoding_format"
    assert coded_cast[0] == 400 and "send no 'embed_dtype'" in coded_cast[1]["error"]["message"]
    signs = perplexity_signs(plain_bits.data)
    assert signs.shape == (len(TEXTS), 32) and (signs == (whole[:, :32] >= 0)).mean() >= 0.99
    assert holding[0] == 400 and holding[1]["error"]["param"] == "input"
    assert {m["id"]: m.get("chunk_separator") for m in listed}[name] == PPLX_SEPARATOR
    # Jina's late chunking on this model: the inputs as one document's contextual chunks
    assert late[0] == 200, late[1]
    vectors = np.array([d["embedding"] for d in late[1]["data"]], dtype=np.float32)
    assert cosine(vectors, refs[0]).min() >= FP32_COSINE
    assert jina_holding[0] == 400
    assert jina_holding[1]["error"]["message"].startswith("'input[1]' holds the separator")
    assert holding[1]["error"]["message"].startswith("'input[0][1]' holds the separator")
    assert overlong[1]["error"]["message"].startswith("'input[0]' has 40001 tokens, more than the")


def test_contextual_chunks_through_voyages_sdk(server, dirs):
    """Voyage AI's `contextualized_embed` on pplx-embed-context: each chunk's vector in its
    document's context, normalised as Voyage's are, at a shorter output dimension too, its
    codes those sentence-transformers makes of the same floats; server-side chunking and a
    chunk holding the separator refused as its InvalidRequestError, naming `inputs`."""
    import voyageai
    from sentence_transformers.util.quantization import quantize_embeddings

    refs = contextual_reference(dirs["pplx_context"], DOCUMENTS)
    with EmbeddingClient(server.grpc_url) as client:
        tokens = sum(r.token_count for r in client.embed_contextual(DOCUMENTS))
    with gateway_process(server) as base:
        vo = voyageai.Client(api_key="unused", base_url=f"{base}/v1")
        answer = vo.contextualized_embed(DOCUMENTS, model="embed", input_type="document")
        for result, ref in zip(answer.results, refs, strict=True):
            assert cosine(np.array(result.embeddings), ref).min() >= FP32_COSINE
        assert answer.total_tokens == tokens
        short = vo.contextualized_embed(DOCUMENTS, model="embed", output_dimension=32)
        for result, ref in zip(short.results, refs, strict=True):
            cut = ref[:, :32] / np.linalg.norm(ref[:, :32], axis=1, keepdims=True)
            assert cosine(np.array(result.embeddings), cut).min() >= FP32_COSINE
        for kind in ("int8", "ubinary"):
            codes = vo.contextualized_embed(
                DOCUMENTS, model="embed", output_dimension=32, output_dtype=kind
            )
            for coded, floats in zip(codes.results, short.results, strict=True):
                want = np.array(floats.embeddings, dtype=np.float32)
                if kind == "int8":  # scaled by each vector's largest value, as the server's
                    want = np.rint(want * (np.float32(127) / np.abs(want).max(1, keepdims=True)))
                else:
                    want = quantize_embeddings(want, precision=kind)
                assert np.array_equal(np.array(coded.embeddings), want), kind
        with pytest.raises(voyageai.error.InvalidRequestError, match="'enable_auto_chunking'"):
            vo.contextualized_embed(
                ["one long document"],
                model="embed",
                input_type="document",
                enable_auto_chunking=True,
                chunk_size=100,
            )
        with pytest.raises(voyageai.error.InvalidRequestError, match="'inputs\\[0\\]\\[1\\]'"):
            vo.contextualized_embed([["a", f"b{PPLX_SEPARATOR}c"]], model="embed")
        with pytest.raises(voyageai.error.InvalidRequestError, match="'output_dimension'"):
            vo.contextualized_embed(DOCUMENTS, model="embed", output_dimension=4096)


def test_contextual_chunks_through_the_cli(server, dirs, tmp_path):
    """qwen-embed embed --contextual: a JSONL line per document (its chunks, or an object's
    --text-field holding them), a line of chunk vectors per document."""
    source = tmp_path / "documents.jsonl"
    lines = [json.dumps(DOCUMENTS[0]), json.dumps({"text": DOCUMENTS[1], "id": "b"})]
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "vectors.jsonl"
    command = [sys.executable, "-m", "qwen_embed_client", "embed", "--url", server.grpc_url]
    run = subprocess.run(
        [*command, "--contextual", "--input", str(source), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    refs = contextual_reference(dirs["pplx_context"], DOCUMENTS)
    for row, ref in zip(rows, refs, strict=True):
        assert cosine(np.array(row["embeddings"]), ref).min() >= FP32_COSINE
    source.write_text(json.dumps({"text": "one string"}) + "\n", encoding="utf-8")
    run = subprocess.run(
        [*command, "--contextual", "--input", str(source)], capture_output=True, text=True
    )
    assert run.returncode != 0 and "line 1: a document must be a list of its chunks" in run.stderr


@pytest.fixture(scope="module")
def jina(tmp_path_factory):
    return jina_embeddings_v5(tmp_path_factory.mktemp("jina") / "jina-embeddings-v5-text-small")


def jina_reference(model_dir, sequences, task) -> np.ndarray:
    """peft's forward of the task's adapter on the base model (unmerged), last token."""
    from peft import PeftModel

    base = Qwen3Model.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, model_dir / "adapters" / task).eval()
    with torch.no_grad():
        rows = [model(input_ids=torch.tensor([s])).last_hidden_state[0, -1] for s in sequences]
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1).numpy()


def test_task_adapters_are_merged_at_load(jina):
    seqs = token_ids(jina, TEXTS, "Query: ")
    for task in ("retrieval", "clustering"):
        ref = jina_reference(jina, seqs, task)
        with Encoder.from_pretrained(jina, dtype="float32", adapter=task) as enc:
            assert enc.route.adapter == task and enc.route.pooling == "last"
            assert cosine(enc.embed(seqs), ref).min() >= FP32_COSINE
    with Encoder.from_pretrained(jina, dtype="float32") as enc:  # auto: retrieval
        assert enc.route.adapter == "retrieval"
        retrieval = enc.embed(seqs)
    with Encoder.from_pretrained(jina, dtype="bfloat16") as enc:  # merged in fp32, then cast
        assert cosine(enc.embed(seqs), retrieval).min() >= BF16_COSINE
    with Encoder.from_pretrained(jina, dtype="float32", adapter="none") as enc:
        base = enc.embed(seqs)
    assert cosine(retrieval, base).max() < 0.99  # the adapter matters: this can fail
    with pytest.raises(ValueError, match=r"adapter 'summaries' is not among the checkpoint's"):
        Encoder.from_pretrained(jina, adapter="summaries")
    assert adapter_names(jina) == sorted(JINA_TASKS)


def test_an_adapters_deltas_are_made_one_at_a_time_as_their_tensors_load(jina, monkeypatch):
    """adapters.LoraDeltas: the loader asks for each adapted tensor's delta once, as it reads
    that tensor; none is made before (an eager dict of them all would hold an fp32 copy of
    every adapted weight at once)."""
    made = []
    make = adapters.LoraDeltas.__getitem__
    monkeypatch.setattr(
        adapters.LoraDeltas, "__getitem__", lambda self, name: made.append(name) or make(self, name)
    )
    deltas = adapters.lora_deltas(jina, "retrieval")
    assert made == [] and len(deltas) == 7 * 2  # q, k, v, o, gate, up, down in 2 layers
    with Encoder.from_pretrained(jina, dtype="float32", adapter="retrieval"):
        pass
    assert sorted(made) == sorted(deltas)


def test_an_adapter_through_triton(jina, tmp_path):
    seqs = token_ids(jina, TEXTS, "Query: ")
    ref = jina_reference(jina, seqs, "text-matching")
    overrides = {"encoder": {"dtype": "float32", "adapter": "text-matching"}}
    repo = render(tmp_path / "repo", {"jina": jina}, overrides)
    with TritonServer(repo, log_path=tmp_path / "server.log") as server:
        vectors, counts = infer(server, TEXTS, "grpc", model="jina", prompt_name="query")
        plain, _ = infer(server, TEXTS, "grpc", model="jina")
        # Jina's `task` on the gateway: the merged adapter's task takes the default prompt,
        # another adapter's task is refused
        app = create_app([server.grpc_url], model_names=("jina",), triton_model="jina")
        with TestClient(app) as client:
            body = {"input": TEXTS, "model": "jina", "task": "text-matching"}
            matching = client.post("/v1/embeddings", json=body)
            refused = client.post("/v1/embeddings", json=body | {"task": "retrieval.query"})
    assert cosine(vectors, ref).min() >= FP32_COSINE
    assert counts.reshape(-1).tolist() == [len(s) for s in seqs]
    got = np.array([d["embedding"] for d in matching.json()["data"]], dtype=np.float32)
    assert np.abs(got - plain).max() <= 1e-6
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "task"
    assert "takes the checkpoint's 'retrieval' adapter" in refused.json()["error"]["message"]


def test_every_task_adapter_per_request(jina, tmp_path):
    """lora_modules naming the checkpoint's own adapters: one deployment serves every task,
    the request's parameter `adapter` (or Jina's `task` on the gateway) picking it."""
    seqs = token_ids(jina, TEXTS, "Query: ")
    overrides = {"encoder": {"dtype": "float32", "lora_modules": ",".join(JINA_TASKS)}}
    repo = render(tmp_path / "repo", {"jina": jina}, overrides)
    with TritonServer(repo, log_path=tmp_path / "server.log") as server:
        queries = {}
        for task in ("retrieval", "text-matching"):
            ref = jina_reference(jina, seqs, task)
            got, _ = infer(server, TEXTS, model="jina", prompt_name="query", adapter=task)
            assert cosine(got, ref).min() >= FP32_COSINE, task
            queries[task] = got
        clustering, _ = infer(server, TEXTS, model="jina", adapter="clustering")
        app = create_app([server.grpc_url], model_names=("jina",), triton_model="jina")
        with TestClient(app) as client:
            for task, expected in (
                ("retrieval.query", queries["retrieval"]),
                ("separation", clustering),
            ):
                body = {"input": TEXTS, "model": "jina", "task": task}
                answer = client.post("/v1/embeddings", json=body)
                assert answer.status_code == 200, answer.text
                got = np.array([d["embedding"] for d in answer.json()["data"]], np.float32)
                assert np.abs(got - expected).max() <= 1e-6, task
