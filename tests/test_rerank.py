"""Reranking in the engine against transformers (Qwen3-Reranker's model card recipe).

Tolerances: fp32 scores within 1e-4 of transformers' full-logit softmax over ("no", "yes"); bf16
within 1e-2. The token ids come from the model card's own construction (reference.py), and the
server's pair tokenizer must produce exactly those ids.
"""

import json
import shutil

import numpy as np
import pytest
from sentence_transformers import CrossEncoder
from tokenizers import Tokenizer

from qwen_embed import Encoder
from qwen_embed.config import ModelConfig
from qwen_embed.hub import resolve_checkpoint
from qwen_embed.sentence_modules import SENTENCE_TRANSFORMERS_CONFIG, SentenceModulesError
from qwen_embed_client.contract import DEFAULT_TASK, RequestError
from qwen_embed_deploy.serving.chat_pairs import compiled
from qwen_embed_deploy.serving.rerank import (
    JINA_M0_PAIRS,
    MXBAI_PAIRS,
    TEXT_PAIRS,
    VISION_PAIRS,
    PairTokenizer,
    RerankOptions,
    pair_tokenizer,
)

from reference import (
    auto_tokenizer,
    make_reranker,
    model_card_pairs,
    mxbai_pairs,
    reference_scores,
)
from replicas import (
    DOCUMENT_FIRST_TEMPLATE,
    QUERY_AS_SYSTEM_TEMPLATE,
    QWEN3_RERANKER_TEMPLATE,
    lora_finetune,
    lora_model,
)

FP32_ABS = 1e-4
BF16_ABS = 1e-2
QUERY = "What is the capital of China?"
DOCUMENTS = [
    "The capital of China is Beijing.",
    "Gravity is a force that attracts two bodies towards each other. " * 12,
    "北京是中华人民共和国的首都。",
    "x",
    "def capital(country):\n    return {'China': 'Beijing'}[country]  # 🎉",
]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return make_reranker(tmp_path_factory.mktemp("classifier"), classifier=True)


@pytest.fixture(scope="module")
def pairs(reranker):
    return model_card_pairs(reranker, QUERY, DOCUMENTS, instruction=DEFAULT_TASK)


@pytest.fixture(scope="module")
def expected(reranker, pairs):
    return reference_scores(reranker, pairs)


def test_pair_tokenizer_builds_the_model_card_ids(reranker, pairs):
    ours = PairTokenizer(reranker, 8192).encode(QUERY, DOCUMENTS, RerankOptions())
    assert ours == pairs
    lengths = sorted(len(p) for p in pairs)
    assert lengths[0] < 80 < lengths[-1]  # mixed lengths, as the cases below need


def test_a_side_that_holds_the_template_is_refused(reranker):
    """A client that formats its pairs itself (vLLM's examples for Qwen3-Reranker served
    without a template: the template's head before the query, its tail after each document)
    would have them wrapped twice: refused, naming the side."""
    query = f"{TEXT_PAIRS.prefix}<Instruct>: {DEFAULT_TASK}\n<Query>: {QUERY}\n"
    document = f"<Document>: {DOCUMENTS[0]}{TEXT_PAIRS.suffix}"
    tok = PairTokenizer(reranker, 8192)
    with pytest.raises(RequestError, match="input 'QUERY' holds this reranker's prompt template"):
        tok.encode(query, DOCUMENTS, RerankOptions())
    with pytest.raises(RequestError, match=r"input 'DOCUMENTS\[1\]' holds this reranker's"):
        tok.encode(QUERY, [DOCUMENTS[0], document], RerankOptions())
    for template in (TEXT_PAIRS, VISION_PAIRS, MXBAI_PAIRS):  # each family's head and tail
        assert template.refusal(QUERY, "") is None
        assert template.refusal(f"{template.prefix}query: {QUERY}", "") is not None
        assert template.refusal(f"document: {DOCUMENTS[0]}{template.suffix}", "") is not None
    assert JINA_M0_PAIRS.refusal(TEXT_PAIRS.prefix, "") is None  # a template of no text


@pytest.mark.server  # whole-model runs: seconds each
def test_truncation_cuts_the_document_like_the_model_card(reranker):
    limit = 150
    ours = PairTokenizer(reranker, limit).encode(QUERY, DOCUMENTS, RerankOptions())
    card = model_card_pairs(reranker, QUERY, DOCUMENTS, instruction=DEFAULT_TASK, max_length=limit)
    assert ours == card
    assert max(len(p) for p in ours) == limit
    full = PairTokenizer(reranker, 8192).encode(QUERY, DOCUMENTS, RerankOptions())
    long = max(range(len(full)), key=lambda i: len(full[i]))
    # The template's end survives the cut, and everything up to the document is whole.
    tok = Tokenizer.from_file(str(reranker / "tokenizer.json"))
    tail = len(tok.encode(TEXT_PAIRS.suffix, add_special_tokens=False).ids)
    head = len(
        tok.encode(
            TEXT_PAIRS.prefix + TEXT_PAIRS.pieces(DEFAULT_TASK, QUERY, "")[0].rstrip(),
            add_special_tokens=False,
        ).ids
    )
    assert ours[long][-tail:] == full[long][-tail:]
    assert ours[long][:head] == full[long][:head]
    with pytest.raises(RequestError, match=r"DOCUMENTS\[1\].*limit of 150"):
        PairTokenizer(reranker, limit).encode(QUERY, DOCUMENTS, RerankOptions(truncate=False))
    with pytest.raises(RequestError, match="QUERY.*no room"):
        PairTokenizer(reranker, limit).encode("long query " * 60, ["d"], RerankOptions())


@pytest.mark.server  # whole-model runs: seconds each
def test_instruction_changes_the_ids_and_the_score(reranker):
    tok = PairTokenizer(reranker, 8192)
    custom = tok.encode(QUERY, DOCUMENTS[:1], RerankOptions(instruction="Find the city"))
    assert custom == model_card_pairs(reranker, QUERY, DOCUMENTS[:1], instruction="Find the city")
    with Encoder.from_pretrained(reranker, task="rerank", dtype="float32") as enc:
        base = enc.score(tok.encode(QUERY, DOCUMENTS[:1], RerankOptions()))
        assert abs(float(enc.score(custom)[0]) - float(base[0])) > 1e-6


@pytest.mark.server  # whole-model runs against transformers': seconds each
@pytest.mark.parametrize("max_batch_tokens", [16384, 128])  # 128: several forward batches
def test_fp32_scores_match_transformers(reranker, pairs, expected, max_batch_tokens):
    with Encoder.from_pretrained(
        reranker, task="rerank", dtype="float32", max_batch_tokens=max_batch_tokens
    ) as enc:
        scores = enc.score(pairs)
    assert scores.shape == (len(pairs),) and scores.dtype == np.float32
    assert np.abs(scores - expected).max() <= FP32_ABS
    assert np.ptp(expected) > 1e-3  # the replica tells documents apart


@pytest.mark.server
def test_bf16_scores_match_transformers(reranker, pairs, expected):
    with Encoder.from_pretrained(reranker, task="rerank", dtype="bfloat16") as enc:
        assert np.abs(enc.score(pairs) - expected).max() <= BF16_ABS


@pytest.mark.server
def test_tp2_scores_match_transformers(reranker, pairs, expected):
    with Encoder.from_pretrained(reranker, task="rerank", dtype="float32", tp_size=2) as enc:
        assert np.abs(enc.score(pairs) - expected).max() <= FP32_ABS


@pytest.mark.server
def test_sequence_classification_checkpoint_scores_by_its_own_head(classifier, pairs, tmp_path):
    """sigmoid(its `score` head), or the logit itself where a CrossEncoder saved by
    sentence-transformers 4-5 says no activation in config.json (as its `predict`)."""
    expected = reference_scores(classifier, pairs)
    with Encoder.from_pretrained(classifier, dtype="float32") as enc:  # task auto -> rerank
        assert enc.task == "rerank"
        scores = enc.score(pairs)
    assert np.abs(scores - expected).max() <= FP32_ABS
    assert np.ptp(expected) > 1e-3
    raw = shutil.copytree(classifier, tmp_path / "raw")
    config = json.loads((raw / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (raw / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_dir(raw).score_kind == "logit"
    logits = reference_scores(classifier, pairs, probability=False)
    with Encoder.from_pretrained(raw, dtype="float32") as enc:
        assert np.abs(enc.score(pairs) - logits).max() <= FP32_ABS
    assert np.abs(logits - expected).max() > 1e-2  # the logits are not the probabilities


@pytest.mark.server
def test_a_lora_finetune_of_the_reranker_scores_as_peft_does(reranker, pairs, tmp_path):
    """A reranker fine-tuned with peft and saved as its adapter alone (qwen_embed.finetunes)
    against peft's unmerged forward over the base; its pairs are the base's template."""
    finetune = lora_model(tmp_path / "finetune", reranker)
    expected = reference_scores(reranker, pairs, adapter=finetune)
    served = resolve_checkpoint(finetune)
    assert PairTokenizer(served, 8192).encode(QUERY, DOCUMENTS, RerankOptions()) == pairs
    with Encoder.from_pretrained(finetune, task="rerank", dtype="float32") as enc:
        assert enc.route.adapter == "lora"
        scores = enc.score(pairs)
    assert np.abs(scores - expected).max() <= FP32_ABS
    base = reference_scores(reranker, pairs)
    assert np.abs(expected - base).max() > 1e-3  # it can fail
    # the same adapter named per request over the base (lora.py)
    with Encoder.from_pretrained(
        reranker, task="rerank", dtype="float32", lora_modules=f"ft={finetune}"
    ) as enc:
        assert np.abs(enc.score(pairs, adapter="ft") - expected).max() <= FP32_ABS
        assert np.abs(enc.score(pairs) - base).max() <= FP32_ABS


CHAT_TEMPLATES = [
    QWEN3_RERANKER_TEMPLATE,
    QUERY_AS_SYSTEM_TEMPLATE,
    DOCUMENT_FIRST_TEMPLATE,  # a namespace's attributes set in a loop
    # what chat templates use beside: loop controls, tojson, dict(), strftime_now, raise_exception
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.role }}:"
    "{{ m.content | tojson }}\n{% endfor %}{{ dict(a=1) | tojson }}{{ bos_token or '' }}"
    "{% if messages[0].role == 'nobody' %}{{ raise_exception('no') }}{% endif %}",
]


def test_chat_templates_render_as_transformers_renders_them():
    """chat_pairs.compiled: the sandbox transformers renders chat templates in (the production
    image has no transformers), rendering what its render_jinja_template renders; a namespace
    attribute that starts with "_" is refused by both."""
    from jinja2.exceptions import SecurityError
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [
        {"role": "system", "content": "Find the city"},
        {"role": "query", "content": 'a "quoted" query <b>'},
        {"role": "document", "content": "naïve café — 北京\n"},
    ]
    for template in CHAT_TEMPLATES:
        for kwargs in ({}, {"add_generation_prompt": True, "bos_token": "<s>"}):
            ours = compiled(template).render(
                messages=messages, tools=None, documents=None, **kwargs
            )
            want = render_jinja_template([messages], chat_template=template, **kwargs)[0][0]
            assert ours == want and ours.strip(), (template, kwargs)
    escape = "{% set ns = namespace(_x=1) %}{{ ns._x }}"
    with pytest.raises(SecurityError):
        compiled(escape).render(messages=messages)
    with pytest.raises(SecurityError):
        render_jinja_template([messages], chat_template=escape)


@pytest.fixture(scope="module")
def st_cross_encoders(cross_encoders):
    """sentence-transformers' CrossEncoder on each (its own reading of the files)."""
    return {name: CrossEncoder(str(d), device="cpu") for name, d in cross_encoders.items()}


@pytest.mark.server  # sentence-transformers' CrossEncoder loads each model
def test_a_cross_encoder_forms_its_pairs_as_sentence_transformers_does(
    cross_encoders, st_cross_encoders, reranker
):
    """A reranker in sentence-transformers 6's CrossEncoder form (chat_pairs.py): its chat
    template's pairs, an instruction as the system message, cut at the limit with the
    template's tail written back, as `CrossEncoder.preprocess` makes them."""
    built = {}  # each takes a load of the tokenizer's files
    for name, model_dir in cross_encoders.items():
        model = st_cross_encoders[name]
        for limit in (60, 8192):  # 8192 last: the fixture's own limit after the test
            model.max_seq_length = limit
            ours = built[name, limit] = pair_tokenizer(model_dir, limit)
            for instruction in (None, "Find the city"):
                got = ours.encode(QUERY, DOCUMENTS, RerankOptions(instruction=instruction))
                want = [
                    model[0].preprocess([(QUERY, d)], prompt=instruction)["input_ids"][0].tolist()
                    for d in DOCUMENTS
                ]
                assert got == want, (name, limit, instruction)
                if limit == 60:  # the cut is exercised
                    assert max(map(len, got)) == 60
    # The model card's template as a chat template gives the model card's ids.
    for instruction in (DEFAULT_TASK, "Find the city"):
        got = built["qwen3", 8192].encode(QUERY, DOCUMENTS, RerankOptions(instruction=instruction))
        assert got == model_card_pairs(reranker, QUERY, DOCUMENTS, instruction=instruction)
    with pytest.raises(RequestError, match=r"DOCUMENTS\[0\]' makes a pair of 85 .*limit of 60"):
        built["qwen3", 60].encode(QUERY, DOCUMENTS, RerankOptions(truncate=False))


@pytest.mark.server
def test_a_cross_encoder_scores_as_its_predict(cross_encoders, st_cross_encoders, tmp_path):
    """Its LogitScore's rows (two: sigmoid of their difference; one: its logit, as zerank-2's
    `activation_fn` says, or that logit's sigmoid, the default) against
    `CrossEncoder.predict`; what cannot be served is named."""
    scores, kinds = {}, {"qwen3": "probability", "zerank": "logit", "ctxl": "logit"}
    for name, model_dir in cross_encoders.items():
        assert ModelConfig.from_dir(model_dir).score_kind == kinds[name]
        pairs = pair_tokenizer(model_dir, 8192).encode(QUERY, DOCUMENTS, RerankOptions())
        with Encoder.from_pretrained(model_dir, dtype="float32") as enc:  # task auto: rerank
            assert enc.task == "rerank"
            scores[name] = enc.score(pairs)
        want = st_cross_encoders[name].predict([(QUERY, d) for d in DOCUMENTS])
        assert np.abs(scores[name] - want).max() <= FP32_ABS, name
        assert np.ptp(want) > 1e-3
    assert np.abs(scores["qwen3"] - scores["zerank"]).max() > 1e-3  # another head: can fail
    # the same files with the default activation: the logit's sigmoid, as its predict
    sigmoid = shutil.copytree(cross_encoders["zerank"], tmp_path / "sigmoid")
    config = json.loads((sigmoid / SENTENCE_TRANSFORMERS_CONFIG).read_text())
    del config["activation_fn"]
    (sigmoid / SENTENCE_TRANSFORMERS_CONFIG).write_text(json.dumps(config))
    pairs = pair_tokenizer(sigmoid, 8192).encode(QUERY, DOCUMENTS, RerankOptions())
    with Encoder.from_pretrained(sigmoid, dtype="float32") as enc:
        probabilities = enc.score(pairs)
    want = CrossEncoder(str(sigmoid), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    assert np.abs(probabilities - want).max() <= FP32_ABS
    assert np.abs(probabilities - 1 / (1 + np.exp(-scores["zerank"]))).max() <= FP32_ABS
    broken = shutil.copytree(cross_encoders["zerank"], tmp_path / "broken")
    (broken / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="without a chat template"):
        pair_tokenizer(broken, 8192)
    config["activation_fn"] = "torch.nn.modules.activation.Tanh"
    (broken / SENTENCE_TRANSFORMERS_CONFIG).write_text(json.dumps(config))
    with pytest.raises(SentenceModulesError, match="activation_fn 'torch.nn.modules.activation"):
        Encoder.from_pretrained(broken, dtype="float32")


@pytest.mark.server
def test_a_lora_finetune_of_a_cross_encoder_scores_as_its_predict(cross_encoders, tmp_path):
    """A CrossEncoder fine-tuned with a LoRA adapter and saved by sentence-transformers (the
    adapter, its LogitScore and chat template, no weights): served over its base as
    `CrossEncoder.predict` scores it."""
    finetune = lora_finetune(tmp_path / "finetune", cross_encoders["qwen3"], cross_encoder=True)
    pairs = pair_tokenizer(resolve_checkpoint(finetune), 8192).encode(
        QUERY, DOCUMENTS, RerankOptions()
    )
    with Encoder.from_pretrained(finetune, dtype="float32") as enc:
        assert (enc.task, enc.route.adapter) == ("rerank", "lora")
        scores = enc.score(pairs)
    texts = [(QUERY, d) for d in DOCUMENTS]
    want = CrossEncoder(str(finetune), device="cpu").predict(texts)
    assert np.abs(scores - want).max() <= FP32_ABS
    base = CrossEncoder(str(cross_encoders["qwen3"]), device="cpu").predict(texts)
    assert np.abs(want - base).max() > 1e-3  # the adapter matters: this can fail


def test_mxbai_pairs_are_its_librarys_ids(mxbai):
    """A Qwen2 reranker is mxbai-rerank-v2: its library's template, each part tokenized alone
    (here it matters: "?" and the separator's newline would merge in one text)."""
    tok = PairTokenizer(mxbai, 8192)
    assert tok.encode(QUERY, DOCUMENTS, RerankOptions()) == mxbai_pairs(mxbai, QUERY, DOCUMENTS)
    instructed = tok.encode(QUERY, DOCUMENTS, RerankOptions(instruction="Find the city"))
    assert instructed == mxbai_pairs(mxbai, QUERY, DOCUMENTS, instruction="Find the city")
    hf = auto_tokenizer(mxbai)
    apart = [hf(t, add_special_tokens=False)["input_ids"] for t in (f"query: {QUERY}", "\n")]
    assert hf(f"query: {QUERY}\n", add_special_tokens=False)["input_ids"] != sum(apart, [])
    # A cut keeps the template's end and everything before the document's text: the parts
    # two documents' pairs share.
    limit = 130
    cut = PairTokenizer(mxbai, limit).encode(QUERY, DOCUMENTS, RerankOptions())
    full = mxbai_pairs(mxbai, QUERY, DOCUMENTS)
    long = max(range(len(full)), key=lambda i: len(full[i]))
    assert len(full[long]) > limit == len(cut[long])
    a, b = mxbai_pairs(mxbai, QUERY, ["", "x"])
    head = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    tail = next(i for i, (x, y) in enumerate(zip(a[::-1], b[::-1], strict=True)) if x != y)
    assert tail > 40 and cut[long][-tail:] == full[long][-tail:]
    assert head > 20 and cut[long][:head] == full[long][:head]


@pytest.mark.server
def test_mxbai_scores_match_transformers(mxbai):
    """Its score is the sigmoid of the "1" logit minus the "0" logit at the last token."""
    pairs = mxbai_pairs(mxbai, QUERY, DOCUMENTS)
    expected = reference_scores(mxbai, pairs, answers=("1", "0"))
    with Encoder.from_pretrained(mxbai, task="rerank", dtype="float32") as enc:
        scores = enc.score(pairs)
    assert np.abs(scores - expected).max() <= FP32_ABS
    assert np.ptp(expected) > 1e-3
    # Not Qwen3-Reranker's answer rows: those give other scores.
    assert np.abs(reference_scores(mxbai, pairs) - expected).max() > 1e-3


def test_task_is_checked(reranker):
    with Encoder.from_pretrained(reranker, dtype="float32") as enc:  # auto: a causal LM embeds
        assert enc.task == "embed"
        with pytest.raises(ValueError, match="task='embed'.*'rerank' needs"):
            enc.score([[1, 2, 3]])
    with pytest.raises(ValueError, match="pooling must be 'last'"):
        Encoder.from_pretrained(reranker, task="rerank", pooling="mean")
    with pytest.raises(ValueError, match="task must be one of"):
        Encoder.from_pretrained(reranker, task="summarize")
    with pytest.raises(ValueError, match="task 'classify' needs a sequence-classification"):
        Encoder.from_pretrained(reranker, task="classify")


@pytest.mark.server
def test_no_rerank_leaves_every_reranking_model_unloaded(demo_dir, reranker, tmp_path):
    """`--no-rerank` finds the reranking models by their task, whatever they are named."""
    from qwen_embed_deploy.launcher import repository_models
    from qwen_embed_deploy.repository import render
    from qwen_embed_deploy.serving.config import REPO

    checked_in = REPO / "model_repository"
    assert repository_models(checked_in, rerank=False) == ["embed", "encoder", "tokenizer"]
    repo = render(tmp_path / "repo", {"embed": demo_dir}, rerankers={"judge": reranker})
    assert repository_models(repo) == [
        "embed",
        "encoder",
        "judge",
        "judge_encoder",
        "judge_tokenizer",
        "tokenizer",
    ]
    assert repository_models(repo, rerank=False) == ["embed", "encoder", "tokenizer"]
