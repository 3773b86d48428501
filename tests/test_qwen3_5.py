"""Qwen3.5's text model (linear-attention layers between gated full-attention ones) against
transformers' Qwen3_5TextModel and Qwen3_5ForCausalLM, one unpadded sequence at a time.

Tolerances as test_parity.py's: fp32 cosine >= 0.99999 and max-abs <= 1e-4 on unit vectors;
bf16 cosine >= 0.999; reranker probabilities within 1e-5 in fp32 (1e-4 through Triton, as
test_rerank_serving.py's). The gated delta rule against its per-token recurrence in float64:
max-abs <= 1e-5. The server tests: one tritonserver serving a Qwen3.5 embedder and reranker.
"""

import json

import numpy as np
import pytest
import torch
import transformers
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from sentence_transformers import CrossEncoder, SentenceTransformer

from qwen_embed import ChunkedText, Encoder, int8
from qwen_embed.config import ModelConfig, UnsupportedModelError
from qwen_embed.cpu import cpu_features
from qwen_embed.gated_delta import CHUNK, SequencePlan, gated_delta_rule
from qwen_embed.kernels.reference import causal_conv_silu
from qwen_embed.layers import _Linear
from qwen_embed.route import Linear, choose_route
from qwen_embed.settings import EncoderSettings
from qwen_embed_client import EmbeddingClient
from qwen_embed_client.contract import DEFAULT_TASK, RerankOptions
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.serving.rerank import pair_tokenizer
from qwen_embed_deploy.triton import TritonServer

import replicas
from reference import (
    _base_model_class,
    cosine,
    model_card_pairs,
    random_sequences,
    reference_embeddings,
    reference_scores,
)
from triton_helpers import infer, text_input

FP32_COSINE = 0.99999
FP32_MAX_ABS = 1e-4
BF16_COSINE = 0.999
INT8_COSINE = 0.98
VOCAB = 151000
# Lengths around the chunks: one token, one chunk exactly, one more, several, many texts.
LENGTHS = [1, 7, CHUNK, CHUNK + 1, 130, 5, 300, 12]
# The last layer full attention (as Qwen3.5's every fourth), or linear (the pruned layer's
# rows taken after the recurrence).
QUERY = "Which city is the capital of China?"
TEXTS = [
    "The capital of China is Beijing.",
    "Gravity is a force that attracts two bodies towards each other. " * 12,
    "北京是中华人民共和国的首都。",
    "Paris",
]
LAYERS = {
    "full_last": ("linear_attention", "linear_attention", "full_attention"),
    "linear_last": ("full_attention", "linear_attention"),
}


@pytest.fixture(scope="module", params=sorted(LAYERS))
def qwen3_5(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return replicas.qwen3_5(directory, layer_types=LAYERS[request.param], dtype=torch.float32)


def sequence_plan(lengths, cuts=()) -> SequencePlan:
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    return SequencePlan.build(cu, "cpu", cuts)


def recurrent_rule(q, k, v, g, beta, lengths):
    """The gated delta rule token by token, in float64, each sequence from an empty state:
    (outputs, each sequence's states after each of its rows)."""
    repeat = v.shape[1] // k.shape[1]
    q = torch.nn.functional.normalize(q.double(), dim=-1).repeat_interleave(repeat, 1)
    k = torch.nn.functional.normalize(k.double(), dim=-1).repeat_interleave(repeat, 1)
    q = q * q.shape[-1] ** -0.5
    out = torch.zeros(v.shape, dtype=torch.float64)
    after = []
    start = 0
    for n in lengths:
        state = torch.zeros(v.shape[1], k.shape[-1], v.shape[-1], dtype=torch.float64)
        after.append([])
        for t in range(start, start + n):
            state = state * g[t].double().exp()[:, None, None]
            error = v[t].double() - torch.einsum("hkv,hk->hv", state, k[t])
            state = state + torch.einsum("hk,hv->hkv", k[t], beta[t].double()[:, None] * error)
            out[t] = torch.einsum("hkv,hk->hv", state, q[t])
            after[-1].append(state)
        start += n
    return out, after


def random_rule_inputs(t: int, seed: int):
    torch.manual_seed(seed)
    q, k = torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    return q, k, torch.randn(t, 4, 6), -torch.rand(t, 4), torch.rand(t, 4)


def test_gated_delta_rule_matches_its_recurrence():
    q, k, v, g, beta = random_rule_inputs(sum(LENGTHS), 0)
    plan = sequence_plan(LENGTHS)
    counts = [-(-n // CHUNK) for n in LENGTHS]  # each chunk index's sequences, longest first
    assert plan.chunk == CHUNK
    assert [n for _, n in plan.steps] == [sum(c > i for c in counts) for i in range(max(counts))]
    out = gated_delta_rule(q, k, v, g, beta, plan)
    expected, _ = recurrent_rule(q, k, v, g, beta, LENGTHS)
    assert out.dtype == torch.float32
    assert (out.double() - expected).abs().max() <= 1e-5
    # short texts alone: chunks of their longest length rounded up to 8
    short = sequence_plan([3, 9, 1])
    assert short.chunk == 16 and short.steps == ((0, 3),)
    out = gated_delta_rule(q[:13], k[:13], v[:13], g[:13], beta[:13], short)
    expected, _ = recurrent_rule(q[:13], k[:13], v[:13], g[:13], beta[:13], [3, 9, 1])
    assert (out.double() - expected).abs().max() <= 1e-5


def test_the_rule_exports_its_states_at_cuts():
    """Late chunking's read-outs go on from their text's state at a chunk's end: cuts inside a
    chunk, at a chunk's end, at a text's end, twice at one place and after its first row
    leave every output as it was and export the state after each cut's row."""
    lengths = [130, 1, CHUNK, 9]
    q, k, v, g, beta = random_rule_inputs(sum(lengths), 1)
    expected, after = recurrent_rule(q, k, v, g, beta, lengths)
    cuts = [(0, 1), (0, 70), (0, CHUNK), (0, 130), (1, 1), (2, 5), (2, 5), (3, 9), (0, 3)]
    plan = sequence_plan(lengths, cuts)
    assert plan.cuts == len(cuts) and plan.chunk == CHUNK
    # the first text's chunks: 1, 2, 61, 6, 60 rows; the others' 1; 5, 59; 9
    assert [n for _, n in plan.steps] == [4, 2, 1, 1, 1]
    exports = torch.full((len(cuts), 4, 8, 6), float("nan"))
    out = gated_delta_rule(q, k, v, g, beta, plan, exports=exports)
    assert (out.double() - expected).abs().max() <= 1e-5
    for (text, rows), state in zip(cuts, exports, strict=True):
        assert (state.double() - after[text][rows - 1]).abs().max() <= 1e-5


def test_the_rule_goes_on_from_a_prefix_state():
    """Shared-prefix reuse (segments.py): each text in three parts, each part's rows started
    from the state the part before left (the first from an empty one; cut at its end), equal
    the whole text's rows: parts of one row, of a chunk, of more than one chunk."""
    parts = [[1, CHUNK, 70, 9], [3, 1, 130, CHUNK + 2], [2, 65, 1, 8]]
    whole = [sum(p) for p in zip(*parts, strict=True)]
    q, k, v, g, beta = random_rule_inputs(sum(whole), 2)
    expected, _ = recurrent_rule(q, k, v, g, beta, whole)
    states = None
    at = np.concatenate([[0], np.cumsum(whole)[:-1]])  # where each text's next part starts
    for lengths in parts:
        rows = np.concatenate([a + np.arange(n) for a, n in zip(at, lengths, strict=True)])
        plan = sequence_plan(lengths, list(enumerate(lengths)))
        exports = torch.empty(len(lengths), 4, 8, 6)
        out = gated_delta_rule(
            q[rows], k[rows], v[rows], g[rows], beta[rows], plan, states, exports
        )
        assert (out.double() - expected[rows]).abs().max() <= 1e-5
        at, states = at + lengths, exports


def test_causal_convolution_restarts_at_each_sequence():
    torch.manual_seed(1)
    x, weight = torch.randn(sum(LENGTHS), 10), torch.randn(10, 4)
    out = causal_conv_silu(x, weight, sequence_plan(LENGTHS).position)
    expected, start = [], 0
    for n in LENGTHS:
        conv = torch.nn.functional.conv1d(
            x[start : start + n].T[None], weight[:, None], padding=3, groups=10
        )
        expected.append(torch.nn.functional.silu(conv[0, :, :n].T))
        start += n
    assert (out - torch.cat(expected)).abs().max() <= 1e-5


def test_config_reads_the_hybrid_layout(qwen3_5):
    config = ModelConfig.from_dir(qwen3_5)
    spec = config.linear_attention
    assert config.family == "qwen3_5" and config.has_qk_norm and not config.has_qkv_bias
    assert spec.layers == tuple(t == "linear_attention" for t in LAYERS[qwen3_5.name[:-1]])
    assert (spec.key_heads, spec.value_heads, spec.key_head_dim, spec.value_head_dim) == (
        2,
        4,
        16,
        24,
    )
    assert spec.conv_kernel == 4 and config.rotary_dim == 8 and config.rope_theta == 1e7
    # rotary on part of a head is Qwen3.5's alone: under Qwen3's name it is refused, not dropped
    hf = json.loads((qwen3_5 / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.25"):
        ModelConfig.from_hf(hf | {"architectures": ["Qwen3ForCausalLM"], "layer_types": None})


def test_route_shares_prefixes_and_takes_int8_and_adapters_but_not_fp8(qwen3_5):
    config = ModelConfig.from_dir(qwen3_5)

    def route(**settings):
        return choose_route(EncoderSettings(**settings), config, "cpu", cpu_features())

    chosen = route()
    assert chosen.prefix_reuse and chosen.prune and chosen.cuda_graph_tokens == 0
    assert not route(pooling="mean").prefix_reuse
    assert route(quantization="int8").linear is Linear.INT8
    assert route(lora_modules="a=/adapter").lora_names == ("a",)
    with pytest.raises(ValueError, match="quantization must be 'none' or 'int8'"):
        route(quantization="fp8")


def test_int8_matches_transformers(qwen3_5):
    """The int8 route: a linear-attention layer's v|z and full attention's q|k in int8 beside
    the MLP's projections; the linear attention's rates, decays, queries and keys (b|a|q|k),
    full attention's values and both kinds of output projection in floats
    (int8.FLOAT_SHARDS, FLOAT_LAYERS). Against transformers in fp32, with and without shared
    prefixes. (Its queries and keys in int8 too, one text here measures 0.955.)"""
    seqs = prefixed_texts(5)
    ref = reference_embeddings(qwen3_5, seqs)
    out = {}
    for reuse in ("off", "auto"):
        with Encoder.from_pretrained(
            qwen3_5, dtype="float32", quantization="int8", prefix_reuse=reuse
        ) as enc:
            model = enc.model
            linears = {n: m for n, m in model.named_modules() if isinstance(m, _Linear)}
            assert all(
                isinstance(m.kernel, int8.Int8Weight) == int8.quantizes(n)
                for n, m in linears.items()
            )
            last = len(model.layers) - 1
            for i, layer in enumerate(model.layers):
                if layer.linear:
                    assert layer.linear_attn.projections == (("b", "a", "q", "k"), ("v", "z"))
                    assert isinstance(layer.linear_attn.vz_proj.kernel, int8.Int8Weight)
                    floats = (layer.linear_attn.baqk_proj, layer.linear_attn.out_proj)
                    assert not any(isinstance(m.kernel, int8.Int8Weight) for m in floats)
                else:  # the pruned last layer projects q alone
                    q = (("q",), ("k",)) if i == last else (("q", "k"),)
                    assert layer.self_attn.projections == (*q, ("v",))
                assert isinstance(layer.mlp.down_proj.kernel, int8.Int8Weight)
            out[reuse] = np.concatenate([enc.embed(seqs), enc.embed(seqs[:3])])
            if reuse == "auto":
                assert enc.prefix_cache.hits >= 1
    ref = np.concatenate([ref, ref[:3]])
    for vectors in out.values():
        assert cosine(vectors, ref).min() >= INT8_COSINE
    assert np.abs(out["auto"] - out["off"]).max() <= 1e-3


def prefixed_texts(seed: int) -> list[list[int]]:
    """Texts after a 75-token prefix (more than a chunk) going on by 1 to 130 tokens, two after
    a 9-token one, and one of its own."""
    rng = np.random.default_rng(seed)

    def ids(n):
        return rng.integers(100, VOCAB, n).tolist()

    long, short = ids(CHUNK + 11), ids(9)
    return [long + ids(n) for n in (3, 1, 70, 130, 5)] + [short + ids(2), short + ids(40), ids(40)]


def test_shared_prefixes_equal_whole_texts(qwen3_5):
    """A prefix's state and last convolution inputs stand for it: texts sharing one, in a
    batch and from the cache, equal reuse off and transformers on the whole texts; a cache
    too small for one prefix's states keeps none."""
    seqs = prefixed_texts(7)
    ref = reference_embeddings(qwen3_5, seqs)
    with Encoder.from_pretrained(qwen3_5, dtype="float32", prefix_reuse="off") as enc:
        off = enc.embed(seqs)
    with Encoder.from_pretrained(qwen3_5, dtype="float32") as enc:
        together = enc.embed(seqs)
        assert enc.stats["computed_tokens"] < enc.stats["received_tokens"] - 4 * (CHUNK + 10)
        alone = np.concatenate([enc.embed([s]) for s in seqs])  # discovered, then hits
        cache = enc.prefix_cache
        assert cache.hits >= 5
        # the cache counts what an entry holds: keys and values per token of the full layers,
        # a state and kernel - 1 inputs of each linear layer whatever the prefix's length
        linear = ModelConfig.from_dir(qwen3_5).linear_attention.layers
        for entry in cache.entries.values():
            held = [sum(t.nbytes for t in kv) for kv in entry.kv]
            assert (
                sum(n for n, lin in zip(held, linear, strict=True) if lin) == cache.bytes_per_entry
            )
            per_token = cache.bytes_per_token * len(entry.ids)
            assert sum(n for n, lin in zip(held, linear, strict=True) if not lin) == per_token
    with Encoder.from_pretrained(qwen3_5, dtype="float32", prefix_cache_mb=0.01) as enc:
        tiny = np.concatenate([enc.embed([s]) for s in seqs])
        assert len(enc.prefix_cache.entries) == 0 and enc.prefix_cache.hits == 0
    for out in (together, alone, tiny):
        assert np.abs(out - off).max() <= 1e-5
        assert cosine(out, ref).min() >= FP32_COSINE
    with Encoder.from_pretrained(qwen3_5, dtype="float32", task="rerank") as enc:
        scores = np.concatenate([enc.score(seqs[:4]), enc.score(seqs[4:])])
        assert enc.prefix_cache.hits >= 1
    assert np.abs(scores - reference_scores(qwen3_5, seqs)).max() <= 1e-5


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_fp32_matches_transformers(qwen3_5, pooling):
    seqs = random_sequences(LENGTHS, vocab_size=VOCAB, seed=2)
    ref = reference_embeddings(qwen3_5, seqs, pooling=pooling)
    # 128 tokens a forward: the 300-token text alone, the others batched
    with Encoder.from_pretrained(
        qwen3_5, dtype="float32", pooling=pooling, max_batch_tokens=128
    ) as enc:
        out = enc.embed(seqs)
    assert cosine(out, ref).min() >= FP32_COSINE
    assert np.abs(out - ref).max() <= FP32_MAX_ABS


def test_bf16_matches_transformers(qwen3_5):
    seqs = random_sequences(LENGTHS, vocab_size=VOCAB, seed=3)
    ref = reference_embeddings(qwen3_5, seqs, dtype=torch.bfloat16)
    with Encoder.from_pretrained(qwen3_5, dtype="bfloat16") as enc:
        out = enc.embed(seqs)
    assert cosine(out, ref).min() >= BF16_COSINE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(
    not hasattr(transformers, "Qwen3_5TextModel"), reason="transformers before Qwen3.5 (5.2)"
)
def test_bf16_on_a_gpu_matches_transformers(qwen3_5):
    """The rule's chunks and carries on the GPU (its batched products and triangular solves),
    the full-attention layers on the GPU's attention backend."""
    seqs = random_sequences(LENGTHS, vocab_size=VOCAB, seed=6)
    ref = reference_embeddings(qwen3_5, seqs, dtype=torch.bfloat16)
    with Encoder.from_pretrained(qwen3_5, dtype="bfloat16", device="cuda") as enc:
        out = enc.embed(seqs)
    assert cosine(out, ref).min() >= BF16_COSINE


EOS = 7  # stands for the token a tokenizer appends: the replicas' ids go in as given
# Overlapping chunks, two ending together, ends before the convolution's reach, at a rule
# chunk's end and one row past it, at the text's end
SPANS = [(0, 40), (40, 95), (95, 160), (10, 20), (159, 160), (0, 1), (1, 2), (60, CHUNK)]
SPANS += [(CHUNK, CHUNK + 1), (30, 40)]


def chunked_texts(seed: int) -> tuple[list[list[int]], list[ChunkedText]]:
    bodies = random_sequences([160, 9, 70], vocab_size=VOCAB, seed=seed)
    spans = [SPANS, [(0, 9), (2, 5)], [(0, 35), (35, 70)]]
    return bodies, [
        ChunkedText(np.array(b + [EOS]), np.array(s), tail=1)
        for b, s in zip(bodies, spans, strict=True)
    ]


def cut_after_chunks(model_dir, bodies, texts) -> list[np.ndarray]:
    """transformers' vector of each text cut after each of its chunks, EOS appended."""
    return [
        reference_embeddings(model_dir, [b[:end] + [EOS] for _, end in t.spans])
        for b, t in zip(bodies, texts, strict=True)
    ]


def test_late_chunks_are_the_text_cut_after_them(qwen3_5):
    """Late chunking: each chunk read out at the appended token after its end, going on in
    every linear-attention layer from its text's state there and its last convolution inputs,
    equals transformers on the text cut after the chunk; texts in one forward, and a text
    over the budget in pieces (the last layer pruned to the read-out rows in both)."""
    bodies, texts = chunked_texts(9)
    expected = cut_after_chunks(qwen3_5, bodies, texts)
    forwards = {}
    for budget in (4096, 128):
        with Encoder.from_pretrained(qwen3_5, dtype="float32", max_batch_tokens=budget) as enc:
            assert enc.model.planner.readout and enc.model.planner.prune
            outs = enc.embed_chunks(texts)
            forwards[budget] = enc.stats["forwards"]
        for out, ref in zip(outs, expected, strict=True):
            assert cosine(out, ref).min() >= FP32_COSINE
            assert np.abs(out - ref).max() <= FP32_MAX_ABS
    assert forwards[4096] == 1 and forwards[128] >= 3


def test_late_chunks_without_read_outs(qwen3_5):
    """A tokenizer appending nothing: a chunk is its last token's state in the text's
    forward; mean pooling: the mean of its tokens' states there (transformers' whole text)."""
    bodies, _ = chunked_texts(10)
    text = ChunkedText(np.array(bodies[0]), np.array(SPANS), tail=0)
    model = _base_model_class("qwen3_5").from_pretrained(qwen3_5, attn_implementation="eager")
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([bodies[0]])).last_hidden_state[0]
    expected = {
        "last": torch.stack([hidden[end - 1] for _, end in SPANS]),
        "mean": torch.stack([hidden[a:b].mean(0) for a, b in SPANS]),
    }
    for pooling, ref in expected.items():
        with Encoder.from_pretrained(qwen3_5, dtype="float32", pooling=pooling) as enc:
            (out,) = enc.embed_chunks([text])
        ref = torch.nn.functional.normalize(ref, dim=-1).numpy()
        assert cosine(out, ref).min() >= FP32_COSINE
        assert np.abs(out - ref).max() <= FP32_MAX_ABS


def test_rerank_matches_the_causal_lm(qwen3_5):
    seqs = random_sequences([4, 70, 19, 1], vocab_size=VOCAB, seed=4)
    with Encoder.from_pretrained(qwen3_5, dtype="float32", task="rerank") as enc:
        scores = enc.score(seqs)
    assert np.abs(scores - reference_scores(qwen3_5, seqs)).max() <= 1e-5


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(server, {deployment: directory}, reranker): a tritonserver serving a Qwen3.5 embedder
    with its sentence-transformers files (`embed`), a LoRA fine-tune of it over every linear
    layer as sentence-transformers saves one (`finetune`) and a Qwen3.5 reranker (`rerank`),
    all in fp32."""
    where = tmp_path_factory.mktemp("qwen3_5-triton")
    embedder = replicas.qwen3_5(where / "embedder", dtype=torch.float32, sentence=True)
    finetune = replicas.lora_finetune(
        where / "finetune", embedder, targets=replicas.QWEN3_5_LORA_TARGETS
    )
    reranker = replicas.qwen3_5(where / "reranker", seed=20, dtype=torch.float32, append_eos=False)
    embedders = {"embed": embedder, "finetune": finetune}
    float32 = {"dtype": "float32"}
    repo = render(
        where / "repo",
        embedders,
        {"encoder": float32, "rerank.encoder": float32},
        rerankers={"rerank": reranker},
    )
    with TritonServer(repo, log_path=where / "server.log") as server:
        yield server, embedders, reranker


@pytest.mark.server
@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("deployment", ["embed", "finetune"])
def test_triton_embeds_as_sentence_transformers(stack, deployment, protocol):
    server, embedders, _ = stack
    model = SentenceTransformer(
        str(embedders[deployment]), device="cpu", model_kwargs={"dtype": torch.float32}
    )
    for prompt_name in (None, "query"):
        prefix = model.prompts[prompt_name] if prompt_name else ""
        counts = [len(model.tokenizer(prefix + t)["input_ids"]) for t in TEXTS]
        params = {"prompt_name": prompt_name} if prompt_name else {}
        vectors, got = infer(server, TEXTS, protocol, model=deployment, **params)
        assert got.reshape(-1).tolist() == counts
        ref = model.encode(TEXTS, prompt_name=prompt_name)
        assert cosine(vectors, ref).min() >= FP32_COSINE
        assert np.abs(vectors - ref).max() <= FP32_MAX_ABS
    if deployment == "finetune":  # the adapter changes the vectors: the test can fail
        base, _ = infer(server, TEXTS, protocol)
        assert cosine(vectors, base).min() < 0.999


def sentence_vectors(model: SentenceTransformer, id_lists) -> np.ndarray:
    """sentence-transformers' unit vectors of token id lists, each as given."""
    rows = []
    with torch.no_grad():
        for ids in id_lists:
            ids = torch.tensor([ids])
            features = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            rows.append(model(features)["sentence_embedding"][0])
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1).numpy()


@pytest.mark.server
@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("deployment", ["embed", "finetune"])
def test_triton_late_chunks_as_sentence_transformers(stack, deployment, protocol):
    """chunk_size through the ensemble: each chunk's vector is sentence-transformers' of the
    text's tokens cut after the chunk, its tokenizer's EOS appended (a fine-tune's too); the
    chunk that ends a text gives the text's vector."""
    server, embedders, _ = stack
    model = SentenceTransformer(
        str(embedders[deployment]), device="cpu", model_kwargs={"dtype": torch.float32}
    )
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(
        server.http_url if protocol == "http" else server.grpc_url
    )
    params = {"chunk_size": 4}
    result = client.infer(deployment, [text_input(module, TEXTS)], parameters=params)
    vectors, spans = result.as_numpy("CHUNK_EMBEDDING"), result.as_numpy("CHUNK_SPANS")
    whole, _ = infer(server, TEXTS, protocol, model=deployment)
    for i, text in enumerate(TEXTS):
        *body, eos = model.tokenizer(text)["input_ids"]
        ends = [*range(4, len(body), 4), len(body)]
        assert (spans[i, : len(ends)] >= 0).all() and (spans[i, len(ends) :] == -1).all()
        got = vectors[i, : len(ends)]
        ref = sentence_vectors(model, [body[:end] + [eos] for end in ends])
        assert cosine(got, ref).min() >= FP32_COSINE
        assert np.abs(got - ref).max() <= FP32_MAX_ABS
        assert np.abs(got[-1] - whole[i]).max() <= FP32_MAX_ABS


@pytest.mark.server
def test_triton_reranks_as_the_causal_lm(stack):
    server, _, reranker = stack
    pairs = model_card_pairs(reranker, QUERY, TEXTS, instruction=DEFAULT_TASK)
    expected = reference_scores(reranker, pairs)
    with EmbeddingClient(server.grpc_url) as client:
        result = client.rerank(QUERY, TEXTS)
    assert result.token_counts.tolist() == [len(p) for p in pairs]
    assert np.abs(result.scores - expected).max() <= 1e-4


@pytest.mark.server  # starts a tensor-parallel worker process
def test_tp2_matches_transformers(qwen3_5):
    """Both kinds of layer split by heads over two ranks (gloo): each rank's q|k|v of the
    convolution and the rule, its z, b, a, decays and value heads; one all-reduce per
    out_proj; with shared prefixes and late chunking too."""
    seqs = random_sequences(LENGTHS, vocab_size=VOCAB, seed=5)
    ref = reference_embeddings(qwen3_5, seqs)
    with Encoder.from_pretrained(qwen3_5, dtype="float32", tp_size=2, max_batch_tokens=128) as enc:
        out = enc.embed(seqs)
        # shared prefixes: each rank keeps its heads' states, and their caches agree
        prefixed = prefixed_texts(8)
        shared = np.concatenate([enc.embed(prefixed[:3]), enc.embed(prefixed[3:])])
        assert enc.prefix_cache.hits >= 2
        # late chunking: each rank's states at the chunks' ends (the long text in pieces)
        bodies, texts = chunked_texts(11)
        chunks = enc.embed_chunks(texts)
    assert cosine(out, ref).min() >= FP32_COSINE
    assert np.abs(out - ref).max() <= FP32_MAX_ABS
    assert cosine(shared, reference_embeddings(qwen3_5, prefixed)).min() >= FP32_COSINE
    for got, expected in zip(chunks, cut_after_chunks(qwen3_5, bodies, texts), strict=True):
        assert cosine(got, expected).min() >= FP32_COSINE


@pytest.mark.server  # whole fine-tunes against sentence-transformers, a tensor-parallel worker
def test_each_request_gets_its_adapter(tmp_path):
    """lora_modules on Qwen3.5: two LoRA fine-tunes over every linear layer (the linear
    attention's in_proj_qkv, z, b, a and out_proj among them) beside one base, named per call
    and per text, on one rank and two: each as sentence-transformers computes its fine-tune;
    a shared prompt's states kept per adapter and found again; on the int8 route too."""
    base = replicas.qwen3_5(tmp_path / "base", dtype=torch.float32, sentence=True)
    tunes = {
        name: replicas.lora_finetune(
            tmp_path / name, base, seed=seed, rank=rank, targets=replicas.QWEN3_5_LORA_TARGETS
        )
        for name, seed, rank in (("legal", 1, 4), ("code", 2, 8))
    }
    models = {
        name: SentenceTransformer(str(d), device="cpu", model_kwargs={"dtype": torch.float32})
        for name, d in {None: base, **tunes}.items()
    }
    query = models[None].prompts["query"]
    ids = [models[None].tokenizer(query + t)["input_ids"] for t in TEXTS]
    want = {name: model.encode(TEXTS, prompt_name="query") for name, model in models.items()}
    assert cosine(want["legal"], want[None]).max() < 0.999  # the adapters matter
    lora_modules = ",".join(f"{name}={d}" for name, d in tunes.items())
    for tp_size in (1, 2):
        with Encoder.from_pretrained(
            base, dtype="float32", lora_modules=lora_modules, tp_size=tp_size
        ) as enc:
            for name in [None, "legal", "code"] * 2:
                got = enc.embed(ids, adapter=name)
                assert cosine(got, want[name]).min() >= FP32_COSINE, (tp_size, name)
                assert np.abs(got - want[name]).max() <= FP32_MAX_ABS, (tp_size, name)
            assert enc.prefix_cache.hits >= 3 * len(TEXTS)  # each adapter's second round
            names = ["legal", None, "code", "legal"]
            got = enc.embed(ids, adapter=names)
            for i, name in enumerate(names):
                assert cosine(got[i : i + 1], want[name][i : i + 1]).min() >= FP32_COSINE
    # over the int8 route's layers, each adapter's product added to the int8 one
    with Encoder.from_pretrained(base, quantization="int8", lora_modules=lora_modules) as enc:
        for name in (None, "legal", "code"):
            assert cosine(enc.embed(ids, adapter=name), want[name]).min() >= INT8_COSINE, name


# Prism-Qwen3.5-Reranker's form as it publishes it (a sentence-transformers CrossEncoder): its
# system message (no "Note that ...", a trailing space) and its instruction baked into its chat
# template; the instruction abridged here
PRISM_TEMPLATE = """\
{%- set query_text = messages | selectattr("role", "eq", "query") | map(attribute="content") \
| first -%}
{%- set document_text = messages | selectattr("role", "eq", "document") \
| map(attribute="content") | first -%}
<|im_start|>system
Judge whether the Document meets the requirements based on the Query and the Instruct \
provided. <|im_end|>
<|im_start|>user
<Instruct>: Judge if the document is relevant to the query. Reply "yes" or "no".
<Query>: {{ query_text }}
<Document>: {{ document_text }}<|im_end|>
<|im_start|>assistant
<think>

</think>

"""


@pytest.mark.server  # sentence-transformers' CrossEncoder loads the model
def test_a_prism_form_cross_encoder_scores_as_its_predict(tmp_path):
    """A Qwen3.5 reranker saved as Prism-Qwen3.5-Reranker is (a CrossEncoder: its chat
    template, a LogitScore of "yes" against "no") is read by its own template, not
    Qwen3-Reranker's: pairs and scores as `CrossEncoder.predict` makes them."""
    base = replicas.qwen3_5(tmp_path / "base", seed=20, dtype=torch.float32, append_eos=False)
    prism = replicas.cross_encoder(tmp_path / "prism", base, PRISM_TEMPLATE)
    pairs = pair_tokenizer(prism, 8192).encode(QUERY, TEXTS, RerankOptions())
    model = CrossEncoder(str(prism), device="cpu")
    want_ids = [model[0].preprocess([(QUERY, d)])["input_ids"][0].tolist() for d in TEXTS]
    assert pairs == want_ids
    with Encoder.from_pretrained(prism, dtype="float32") as enc:
        assert enc.task == "rerank"
        scores = enc.score(pairs)
    want = model.predict([(QUERY, d) for d in TEXTS])
    assert np.abs(scores - want).max() <= 1e-4 and np.ptp(want) > 1e-3
