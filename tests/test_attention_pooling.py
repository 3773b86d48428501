"""CodeFuse's code embedders, pooled by attention (attention_pooling.py), as published
(tests/replicas.py): C2LLM-0.5B/7B (architecture C2LLMForEmbedding) and CodeFuse-CGE-Large
(CodeFuse_CGE_Large), a causal Qwen2 under `plm_model.` and a PMA head under `mha_pma.`.

The reference is their remote code's recipe (modeling_*.py; CGE's is published, C2LLM's keeps
its configuration keys and layout) written out with transformers: the wrapped
Qwen2ForCausalLM over a padded batch (their padding side) without special tokens, the hidden
states of layer `keep_max_layer` (the final norm's output), then their `PMA` with `MAB_POST`
over the padded rows with the attention mask, transcribed: scores over the whole width's
square root, masked softmax, seed + attention, LayerNorm, + relu(fc_o), LayerNorm; then
normalised. Vectors must reach cosine >= 0.9999 in fp32 and >= 0.999 in bf16, on each CPU
attention backend, under tensor parallelism, per chunk (late chunking), through Triton (HTTP
and gRPC) and through the gateway.
"""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import Qwen2Config, Qwen2ForCausalLM

from qwen_embed import ChunkedText, Encoder
from qwen_embed.config import ModelConfig, UnsupportedModelError
from qwen_embed.loader import checkpoint_files
from qwen_embed.route import resolve_pooling
from qwen_embed_client.contract import EmbedOptions
from qwen_embed_client.gateway.app import create_app
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.serving.tokenizer import PromptSet, TextTokenizer
from qwen_embed_deploy.triton import TritonServer

from reference import cosine
from replicas import c2llm, codefuse_cge_large
from triton_helpers import infer

FP32_COSINE = 0.9999
BF16_COSINE = 0.999
WIDTHS = {"c2llm": 64, "cge": 48}
INSTRUCTION = "Retrieve the code that solves the following query: "
TEXTS = [
    "Retrieve the Python code that solves the following query: sort a list in place",
    "def sort_in_place(items):\n    items.sort()\n    return items",
    "naïve café — emoji 🎉 你好",
    "x",  # one token: a softmax over one row
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("codefuse")
    return {
        "c2llm": c2llm(root / "C2LLM-0.5B"),
        "cge": codefuse_cge_large(root / "CodeFuse-CGE-Large"),
    }


def token_ids(model_dir, texts):
    """As their remote code's encode tokenizes: no special tokens."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tok.encode(t, add_special_tokens=False).ids for t in texts]


def _tensors(model_dir) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in checkpoint_files(model_dir):
        tensors |= load_file(path)
    return tensors


def recipe_parts(model_dir, dtype=torch.float32):
    """Their model as their remote code builds it: config.json, the wrapped causal LM
    (`plm_model.`, eager attention) and the PMA's tensors (`mha_pma.`)."""
    hf = json.loads((model_dir / "config.json").read_text())
    config = Qwen2Config.from_dict({k: v for k, v in hf.items() if k != "model_type"})
    config._attn_implementation = "eager"
    tensors = _tensors(model_dir)
    lm = Qwen2ForCausalLM(config).eval()
    parts = {
        prefix: {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        for prefix in ("plm_model.", "mha_pma.")
    }
    lm.load_state_dict(parts["plm_model."])
    pma = {k: v.to(dtype) for k, v in parts["mha_pma."].items()}
    return hf, lm.to(dtype), pma


def reference(model_dir, sequences, dtype=torch.float32) -> np.ndarray:
    """Their recipe over one padded batch, L2-normalised (see the module's docstring)."""
    hf, lm, pma = recipe_parts(model_dir, dtype)
    longest = max(map(len, sequences))
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros(len(sequences), longest, dtype=torch.long)
    for i, s in enumerate(sequences):
        place = slice(longest - len(s), None) if hf["padding_side"] == "left" else slice(len(s))
        ids[i, place], mask[i, place] = torch.tensor(s), 1
    with torch.no_grad():
        out = lm.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        states = out.hidden_states[hf.get("keep_max_layer", -1)]
        pooled = pma_post(pma, states, mask, hf["pma_num_heads"])
    return F.normalize(pooled.float(), dim=-1).numpy()


def pma_post(w: dict, X: torch.Tensor, pad_mask: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Their PMA (one seed) with MAB_POST, transcribed over a padded batch."""
    S = w["S"].repeat(X.size(0), 1, 1)

    def fc(name, x):
        return F.linear(x, w[f"mab.{name}.weight"], w[f"mab.{name}.bias"])

    def ln(name, x):
        return F.layer_norm(x, x.shape[-1:], w[f"mab.{name}.weight"], w[f"mab.{name}.bias"])

    dim_V = S.shape[-1]
    Q_, K_, V_ = fc("fc_q", S), fc("fc_k", X), fc("fc_v", X)
    split = dim_V // num_heads
    Q_ = torch.cat(Q_.split(split, 2), 0)
    K_ = torch.cat(K_.split(split, 2), 0)
    V_ = torch.cat(V_.split(split, 2), 0)
    pad_mask = pad_mask.unsqueeze(1).repeat(num_heads, S.size(1), 1)
    score = Q_.bmm(K_.transpose(1, 2)) / math.sqrt(dim_V)
    score = score.masked_fill(pad_mask == 0, -1e12)
    A = torch.softmax(score, 2) * pad_mask
    out = torch.cat(A.bmm(V_).split(S.size(0), 0), 2)
    out = ln("ln0", S + out)
    out = ln("ln1", out + F.relu(fc("fc_o", out)))
    return out.squeeze(1)


def test_the_checkpoints_say_they_pool_by_attention(dirs):
    for name, width, heads in (("c2llm", 64, 8), ("cge", 48, 4)):
        config = ModelConfig.from_dir(dirs[name])
        assert config.family == "qwen2" and config.is_causal, name
        spec = config.attention_pooling
        assert (spec.width, spec.num_heads, spec.layer_norm) == (width, heads, True), name
        assert config.sentence.pooling == "attention" and config.embedding_size == width, name
    # CGE's tokenizer_config asks for a BOS token; its recipe leaves special tokens out
    tok_config = json.loads((dirs["cge"] / "tokenizer_config.json").read_text())
    assert tok_config["add_bos_token"]
    ids = TextTokenizer(dirs["cge"], max_input_tokens=512).encode(TEXTS, EmbedOptions())
    assert [list(i) for i in ids] == token_ids(dirs["cge"], TEXTS)
    # no prompts: an instruction is the text's own prefix (parameter `prompt`), as C2LLM's
    # README prepends it
    assert PromptSet.from_dir(dirs["c2llm"]).prompts == {}


@pytest.mark.parametrize("attn_backend", ["native", "torch"])
@pytest.mark.parametrize("name", ["c2llm", "cge"])
def test_vectors_match_the_reference_recipe(dirs, name, attn_backend):
    seqs = token_ids(dirs[name], TEXTS)
    ref = reference(dirs[name], seqs)
    with Encoder.from_pretrained(dirs[name], dtype="float32", attn_backend=attn_backend) as enc:
        assert enc.route.pooling == "attention" and not enc.route.prefix_reuse
        assert enc.embedding_size == WIDTHS[name]
        vectors = enc.embed(seqs)
        alone = np.concatenate([enc.embed([s]) for s in seqs])
        half = enc.embed(seqs, dimensions=16)
    assert vectors.shape == (len(TEXTS), WIDTHS[name])
    assert cosine(vectors, ref).min() >= FP32_COSINE
    assert np.abs(vectors - ref).max() <= 1e-4
    # a softmax per text: batched or alone, the same vector
    assert np.abs(vectors - alone).max() <= 1e-5
    # Matryoshka: truncated, then normalised
    assert cosine(half, ref[:, :16]).min() >= FP32_COSINE


@pytest.mark.parametrize("name", ["c2llm", "cge"])
def test_bf16_vectors_match_the_bf16_reference(dirs, name):
    seqs = token_ids(dirs[name], TEXTS)
    ref = reference(dirs[name], seqs, dtype=torch.bfloat16)
    with Encoder.from_pretrained(dirs[name], dtype="bfloat16") as enc:
        assert cosine(enc.embed(seqs), ref).min() >= BF16_COSINE


@pytest.mark.server  # its second rank is a process
def test_attention_pooling_under_tensor_parallelism(dirs):
    """tp_size 2: rank 0 holds the pooling head, rank 1 passes its tensors over."""
    seqs = token_ids(dirs["cge"], TEXTS)
    with Encoder.from_pretrained(dirs["cge"], dtype="float32", tp_size=2) as enc:
        assert cosine(enc.embed(seqs), reference(dirs["cge"], seqs)).min() >= FP32_COSINE


def test_late_chunks_are_pooled_by_attention_over_their_rows(dirs):
    """A chunk's vector: the head over the chunk's rows of the whole text's forward."""
    (ids,) = token_ids(dirs["c2llm"], [TEXTS[1] + " " + TEXTS[0]])
    spans = np.array([[0, 7], [7, 15], [15, len(ids)]])
    hf, lm, pma = recipe_parts(dirs["c2llm"])
    with torch.no_grad():
        full = lm.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    expected = []
    for a, b in spans:
        rows = full[None, a:b]
        pooled = pma_post(pma, rows, torch.ones(1, b - a), hf["pma_num_heads"])
        expected.append(F.normalize(pooled, dim=-1)[0].numpy())
    with Encoder.from_pretrained(dirs["c2llm"], dtype="float32") as enc:
        (chunks,) = enc.embed_chunks([ChunkedText(np.array(ids), spans)])
    assert cosine(chunks, np.stack(expected)).min() >= FP32_COSINE


def test_another_pooling_is_refused_saying_why(dirs):
    with pytest.raises(ValueError, match="pools by attention.*'auto' or 'attention'"):
        Encoder.from_pretrained(dirs["c2llm"], dtype="float32", pooling="mean")
    hf = json.loads((dirs["c2llm"] / "config.json").read_text())
    plain = {k: v for k, v in hf.items() if not k.startswith(("pma_", "embedding_method"))}
    plain["architectures"] = ["Qwen2ForCausalLM"]
    with pytest.raises(ValueError, match="'attention' needs a checkpoint"):
        resolve_pooling("attention", "embed", ModelConfig.from_hf(plain))
    for change, message in (
        ({"pma_norm_mode": "pre_normal"}, "pma_norm_mode 'pre_normal'"),
        ({"keep_max_layer": 1}, "keep_max_layer 1"),
        ({"embedding_method": "weighted"}, "embedding_method 'weighted'"),
        ({"pma_num_heads": 7}, "multiple of pma_num_heads"),
    ):
        with pytest.raises(UnsupportedModelError, match=message):
            ModelConfig.from_hf(hf | change)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vectors_on_a_gpu_match_the_recipe(dirs):
    """bf16 on the GPU (its CUDA graphs, the pooling on the device) against the recipe in
    fp32 on the CPU."""
    seqs = token_ids(dirs["c2llm"], TEXTS)
    with Encoder.from_pretrained(dirs["c2llm"], dtype="bfloat16", device="cuda") as enc:
        vectors = enc.embed(seqs)
    assert cosine(vectors, reference(dirs["c2llm"], seqs)).min() >= BF16_COSINE


@pytest.fixture(scope="module")
def server(dirs, tmp_path_factory):
    where = tmp_path_factory.mktemp("codefuse-triton")
    deployments = {"embed": dirs["c2llm"], "cge": dirs["cge"]}
    repo = render(where / "repo", deployments, {"encoder": {"dtype": "float32"}})
    with TritonServer(repo, log_path=where / "server.log") as s:
        yield s


@pytest.mark.server
@pytest.mark.parametrize("name", ["c2llm", "cge"])
def test_served_through_triton_and_the_gateway(server, dirs, name):
    model = "embed" if name == "c2llm" else "cge"
    seqs = token_ids(dirs[name], TEXTS)
    ref = reference(dirs[name], seqs)
    for protocol in ("http", "grpc"):
        vectors, counts = infer(server, TEXTS, protocol, model=model)
        assert cosine(vectors, ref).min() >= FP32_COSINE, protocol
        assert counts.reshape(-1).tolist() == [len(s) for s in seqs]
    # an instruction as its README gives one: the text's prefix
    instructed = token_ids(dirs[name], [INSTRUCTION + t for t in TEXTS])
    vectors, _ = infer(server, TEXTS, model=model, prompt=INSTRUCTION)
    assert cosine(vectors, reference(dirs[name], instructed)).min() >= FP32_COSINE
    app = create_app([server.grpc_url], model_names=(model,), triton_model=model)
    with TestClient(app) as client:
        response = client.post("/v1/embeddings", json={"input": TEXTS, "model": model})
        assert response.status_code == 200, response.text
        got = np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)
        info = client.get("/info").json()
    assert got.shape == (len(TEXTS), WIDTHS[name])
    assert cosine(got, ref).min() >= FP32_COSINE
    assert info["model_type"] == {"embedding": {"pooling": "attention"}}
