"""The gateway's request bodies (gateway/bodies.py and each API's models): what a body may
hold, each refusal naming its field in the API's words, and the mapping onto the request
contract; and what its headers say of how long its caller waits. The routes themselves, against a
real server: test_gateway.py, test_drop_in_apis.py."""

import asyncio
import base64
import functools
import json
import math
import re
import typing

import numpy as np
import pytest
import torch

from qwen_embed_client.contract import (
    MAX_DOCUMENTS,
    MAX_INPUTS,
    MAX_VIDEOS_PER_TEXT,
    EmbedOptions,
)
from qwen_embed_client.gateway import cohere, jina, media, nim, ollama, openai, score, tei
from qwen_embed_client.gateway.common import Encoding, log_odds, prompt_options
from qwen_embed_client.gateway.deadlines import waits_s
from qwen_embed_client.gateway.errors import BACKEND, EMPTY, INVALID, APIError
from qwen_embed_client.gateway.state import VectorResponse, check_finite, dumps

EMBED = ("embed",)


def refusal(parse, body) -> APIError:
    with pytest.raises(APIError) as e:
        parse(body)
    return e.value


def embeddings(body: dict):
    return openai.parse_request({"model": "embed", **body}, EMBED)


def test_openai_embeddings_map_onto_the_contract():
    texts, options, encoding, kinds, keyed = embeddings(
        {"input": "hi", "dimensions": 8, "instruction": "find", "priority": "bulk"}
    )
    assert (texts, encoding, kinds, keyed) == (["hi"], Encoding("float"), ["float"], False)
    assert options == {"dimensions": 8, "instruction": "find", "priority": "bulk"}
    ids, options, *_ = embeddings({"input": [[1, 2], [3]]})
    assert ids == [[1, 2], [3]] and options == {"token_ids": True}
    assert embeddings({"input": [5, 6]})[0] == [[5, 6]]  # one id list
    _, options, *_ = embeddings({"input": ["a"], "chunks": {"spans": [[0, 2], [2, 4]]}})
    assert options == {"chunk_spans": [[0, 2], [2, 4]]}
    assert embeddings({"input": "x", "encoding_format": "int8"})[2:] == (
        Encoding(),
        ["int8"],
        False,
    )
    # null is the default, as OpenAI takes it (LiteLLM sends it when none is set)
    assert embeddings({"input": "x", "encoding_format": None})[2:] == (Encoding(), ["float"], False)
    keyed = embeddings({"input": "x", "embedding_types": ["binary", "float"]})
    assert keyed[2:] == (Encoding(), ["binary", "float"], True)


def test_every_extension_option_is_typed_as_the_contract_types_it():
    hints = typing.get_type_hints(EmbedOptions)
    fields = openai.EmbeddingsRequest.model_fields
    for name in ("dimensions", *openai.EXTENSION_OPTIONS):
        assert fields[name].annotation == hints[name] | None, name


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": []}, "input", "'input' cannot be empty"),
        ({"input": ["a"] * (MAX_INPUTS + 1)}, "input", f"more than the limit of {MAX_INPUTS}"),
        ({"input": ["a", 3]}, "input", "not a mix of texts and ids"),
        ({"input": [[1], [2**40]]}, "input", "'input[1]' holds token id"),
        ({"input": ["ok", "\ud800"]}, "input", "'input[1]' is not valid UTF-8"),
        ({"input": "x", "dimensions": "8"}, "dimensions", "must be an integer"),  # no coercion
        ({"input": "x", "dimensions": True}, "dimensions", "must be an integer"),
        ({"input": "x", "dimensions": 0}, "dimensions", "must be >= 1"),  # the contract's rule
        ({"input": "x", "normalize": "yes"}, "normalize", "must be a boolean"),
        ({"input": "x", "truncation_direction": "up"}, "truncation_direction", "one of"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format", "'base64'"),
        ({"input": "x", "embedding_types": ["int8", "int8"]}, "embedding_types", "distinct"),
        ({"input": "x", "priority": "urgent"}, "priority", "'interactive'"),
        ({"input": "x", "chunks": {"size": 4, "more": 1}}, "chunks", '{"size": tokens}'),
        ({"input": "x", "chunks": {"size": 4}, "embedding_type": "int8"}, "chunks", "float"),
        ({"input": "x", "prompt": "p", "instruction": "i"}, "prompt", "send one of them"),
    ],
)
def test_openai_embeddings_refusals_name_the_field(body, param, words):
    e = refusal(embeddings, body)
    assert e.param == param and words in e.message, e.message
    assert e.kind == (EMPTY if body["input"] == [] else INVALID)


def test_a_body_that_is_not_an_object_or_lacks_a_field():
    assert "must be a JSON object" in refusal(lambda b: openai.parse_request(b, EMBED), [1]).message
    assert refusal(embeddings, {}).message == "send one of 'input' and 'messages'"


QWEN3_PROMPTS = ["document", "query"]  # Qwen3-Embedding's prompt names


def nim_options(body: dict, prompt_names=QWEN3_PROMPTS, route=None) -> dict:
    facts = {"prompt_names": prompt_names, "route": route or {"adapter": None}}
    return openai.parse_request({"model": "embed", "input": "x", **body}, EMBED, facts)[1]


def test_nim_input_types_pick_the_checkpoints_prompts():
    """NVIDIA NIM's `input_type` (its clients send "query" from embed_query, "passage" from
    embed_documents): the checkpoint's query or document prompt, none where it has none."""
    assert nim_options({"input_type": "query"}) == {"prompt_name": "query"}
    assert nim_options({"input_type": "passage"}) == {"prompt_name": "document"}
    assert nim_options({"input_type": "passage"}, ["query"]) == {}  # no document prompt
    assert nim_options({"input_type": "passage"}, ["query", "passage"]) == {
        "prompt_name": "passage"  # a prompt named like the input type comes first
    }
    assert nim_options({"input_type": "query"}, []) == {}
    with_task = nim_options({"input_type": "query", "instruction": "find code"})
    assert with_task == {"prompt_name": "query", "instruction": "find code"}
    # Cohere's input types through the same rule, with its tasks
    tasks = cohere.INPUT_TYPE_TASKS
    assert prompt_options("clustering", QWEN3_PROMPTS, cohere.INPUT_TYPE_PROMPTS, tasks) == {
        "instruction": tasks["clustering"]
    }


def test_nim_truncate_modes_are_the_contracts_options():
    assert nim_options({"truncate": "END"}) == {"truncate": True}
    assert nim_options({"truncate": "START"}) == {"truncate": True, "truncation_direction": "left"}
    assert nim_options({"truncate": "NONE", "input_type": "passage"}) == {
        "truncate": False,
        "prompt_name": "document",
    }
    assert nim_options({"truncate": False}) == {"truncate": False}  # ours, a boolean, still


def test_voyage_fields_are_the_contracts_options():
    """Voyage AI's (its SDK sends every one, null where unset): `input_type` "document" the
    checkpoint's document prompt, `truncation`, `output_dimension` and `output_dtype`."""
    assert nim_options({"input_type": "document"}) == {"prompt_name": "document"}
    unset = {"input_type": None, "truncation": None, "output_dtype": None}
    assert nim_options(unset | {"output_dimension": None}) == {}
    given = {"truncation": False, "output_dimension": 8, "output_dtype": "ubinary"}
    request = openai.checked_request({"model": "embed", "input": "x", **given}, EMBED)
    assert request.options() == {"truncate": False, "dimensions": 8}
    encoding, kinds, keyed = request.kinds()
    assert kinds == ["ubinary"] and not keyed


def test_vllm_truncation_fields_are_the_contracts_options():
    assert nim_options({"truncate_prompt_tokens": 8}) == {"max_tokens": 8}
    assert nim_options({"truncate_prompt_tokens": -1}) == {}  # the model's limit
    assert nim_options({"truncate_prompt_tokens": 8, "truncation_side": "left"}) == {
        "max_tokens": 8,
        "truncation_direction": "left",
    }


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1 (the model's limit) or >= 1"),
        ({"truncate_prompt_tokens": 8, "max_tokens": 4}, "truncate_prompt_tokens", "not both"),
        ({"truncation_side": "left", "truncation_direction": "left"}, "truncation_side", "not"),
        ({"truncation_side": "up"}, "truncation_side", "one of ['left', 'right']"),
        ({"truncate": "START", "truncation_side": "left"}, "truncation_side", "send no"),
        ({"truncate": "MIDDLE"}, "truncate", "a boolean or one of 'END', 'START', 'NONE'"),
        ({"truncate": "{x}"}, "truncate", "a boolean or one of"),  # not echoed into a template
        ({"truncate": "START", "truncation_direction": "left"}, "truncation_direction", "no"),
        ({"input_type": "doc"}, "input_type", "one of ['query', 'passage', 'document']"),
        ({"input_type": "query", "prompt_name": "query"}, "prompt_name", "not both"),
        ({"input_type": "query", "prompt": "p: "}, "prompt", "not both"),
        ({"input_type": "passage", "instruction": "i"}, "instruction", "'passage' embeds passages"),
        ({"input_type": "document", "instruction": "i"}, "instruction", "'document' embeds"),
        ({"output_dimension": 8, "dimensions": 8}, "output_dimension", "not both"),
        ({"truncation": False, "truncate": False}, "truncation", "not both"),
        ({"truncation": "no"}, "truncation", "a boolean"),
        ({"output_dtype": "int8", "embedding_type": "int8"}, "output_dtype", "not both"),
        ({"output_dtype": "int4"}, "output_dtype", "one of ['float', 'int8'"),
        ({"use_activation": False, "normalize": False}, "use_activation", "not both"),
        ({"embed_dtype": "float64"}, "embed_dtype", "one of ['float32', 'float16', 'bfloat16'"),
        ({"endianness": "middle"}, "endianness", "one of ['native', 'big', 'little']"),
        ({"embed_dtype": "float16", "encoding_format": "int8"}, "embed_dtype", "'int8'"),
        ({"encoding_format": "bytes", "embedding_type": "int8"}, "encoding_format", "not with"),
        ({"encoding_format": "bytes_only", "chunks": {"size": 4}}, "encoding_format", "chunks"),
        ({"encoding_format": "bytes", "late_chunking": True}, "encoding_format", "late_chunking"),
        ({"add_special_tokens": False}, "add_special_tokens", "not served for texts"),
        ({"padding": "max_length"}, "padding", "'do_not_pad'"),
        ({"task": "retrieval"}, "task", "one of ['retrieval.query', 'retrieval.passage'"),
        ({"task": "Code Search.query"}, "task", "NAME.query / NAME.passage"),
        ({"task": "retrieval.query", "input_type": "query"}, "task", "not both"),
        ({"task": "retrieval.query", "prompt_name": "query"}, "prompt_name", "not both"),
        ({"task": "code.passage", "instruction": "i"}, "instruction", "embeds passages"),
        ({"task": "text-matching", "instruction": "i"}, "instruction", "gives the instruction"),
        ({"normalized": True, "normalize": True}, "normalized", "not both"),
        ({"normalized": "yes"}, "normalized", "a boolean"),
        ({"embedding_type": "base64", "encoding_format": "int8"}, "encoding_format", "one of"),
        ({"embedding_type": "int8", "encoding_type": "float"}, "encoding_type", "not both"),
        ({"late_chunking": True, "input": [[1, 2]]}, "input", "must be strings"),
        ({"late_chunking": True, "input": ["a", " "]}, "input", "'input[1]' is blank"),
        ({"late_chunking": True, "chunks": {"size": 4}}, "chunks", "send no 'chunks'"),
        ({"late_chunking": True, "embedding_type": "int8"}, "late_chunking", "float vectors"),
    ],
)
def test_nim_vllm_and_jina_fields_refusals_name_the_field(body, param, words):
    e = refusal(nim_options, body)
    assert e.param == param and words in e.message, e.message


def test_vllm_activation_and_token_ids_fields():
    assert nim_options({"use_activation": False}) == {"normalize": False}
    # ids are taken as given: no special tokens are added to them either way
    assert nim_options({"input": [[1, 2]], "add_special_tokens": False}) == {"token_ids": True}
    assert nim_options({"add_special_tokens": True, "padding": "do_not_pad"}) == {}


def test_jina_tasks_pick_the_checkpoints_prompts_or_an_instruction():
    assert nim_options({"task": "retrieval.query"}) == {"prompt_name": "query"}
    assert nim_options({"task": "retrieval.passage"}) == {"prompt_name": "document"}
    assert nim_options({"task": "code.passage"}, ["query"]) == {}  # no document prompt
    for task, instruction in jina.TASK_INSTRUCTIONS_BY_TASK.items():
        assert nim_options({"task": task}) == {"instruction": instruction}
    assert nim_options({"task": "retrieval.query", "instruction": "find code"}) == {
        "prompt_name": "query",
        "instruction": "find code",
    }
    assert nim_options({"normalized": False}) == {"normalize": False}
    # NAME.query / NAME.passage: the checkpoint's own NAME_query / NAME_document prompt
    # (jina-code-embeddings' prompts)
    code = ["nl2code_document", "nl2code_query", "qa_query"]
    assert nim_options({"task": "nl2code.query"}, code) == {"prompt_name": "nl2code_query"}
    assert nim_options({"task": "nl2code.passage"}, code) == {"prompt_name": "nl2code_document"}
    e = refusal(functools.partial(nim_options, prompt_names=code), {"task": "qa.passage"})
    assert e.param == "task" and "'qa_document', which this checkpoint lacks" in e.message
    e = refusal(nim_options, {"task": "nl2code.passage", "instruction": "i"})
    assert e.param == "instruction"
    # a checkpoint with task adapters (jina-embeddings-v5) serves the task of the one merged
    retrieval, matching = {"adapter": "retrieval"}, {"adapter": "text-matching"}
    assert nim_options({"task": "retrieval.passage"}, route=retrieval) == {
        "prompt_name": "document"
    }
    assert nim_options({"task": "text-matching"}, route=matching) == {}  # its default prompt
    for task, route in [("text-matching", retrieval), ("retrieval.query", matching)]:
        e = refusal(functools.partial(nim_options, route=route), {"task": task})
        assert e.param == "task" and f"merged '{route['adapter']}'" in e.message
    # a fine-tune's adapter (qwen_embed.finetunes) is no task of Jina's: tasks take prompts
    for task in ("retrieval.query", "text-matching"):
        fine_tuned = nim_options({"task": task}, route={"adapter": "lora"})
        assert fine_tuned == nim_options({"task": task}) and fine_tuned
    for field in ("embedding_type", "encoding_type"):  # Jina's clients send either
        _, _, encoding, kinds, _ = openai.parse_request({"input": "x", field: "base64"}, EMBED)
        assert (encoding, kinds) == (Encoding("base64"), ["float"])
        _, _, encoding, kinds, _ = openai.parse_request({"input": "x", field: "ubinary"}, EMBED)
        assert (encoding, kinds) == (Encoding("float"), ["ubinary"])


VECTOR = np.concatenate(
    [  # unit-scale values, tiny and huge ones, and past fp8 e4m3's largest value (448)
        np.random.default_rng(0).standard_normal(4096).astype(np.float32),
        np.array([0.0, -0.0, 1e-9, -3e-6, 447.9, 449.0, -1e4, 6e4, 7e4], np.float32),
    ]
)


@pytest.mark.parametrize(
    "embed_dtype, like",
    [
        ("float32", torch.float32),
        ("float16", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("fp8_e4m3", torch.float8_e4m3fn),
        ("fp8_e5m2", torch.float8_e5m2),
    ],
)
@pytest.mark.parametrize("endianness", ["little", "big", "native"])
def test_vllm_embed_dtype_bytes_are_torchs_cast(embed_dtype, like, endianness):
    """A base64 vector as vLLM writes one (its serial_utils: torch's cast, viewed as
    unsigned ints, byte-swapped for an order other than the host's)."""
    body = {"input": "x", "encoding_format": "base64"}
    body |= {"embed_dtype": embed_dtype, "endianness": endianness}
    encoding = openai.parse_request(body, EMBED)[2]
    cast = torch.from_numpy(VECTOR).to(like)
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[cast.element_size()]
    expected = cast.view(view).numpy()
    if endianness == "big":
        expected = expected.byteswap()  # these hosts are little-endian
    assert base64.b64decode(encoding(VECTOR)) == expected.tobytes()
    # a compact type's codes go out as they are
    codes = np.arange(-3, 4, dtype=np.int8)
    assert base64.b64decode(Encoding("base64", "float16")(codes)) == codes.tobytes()


def test_a_body_is_written_with_each_float32_value_as_it_is():
    """state.dumps: a float vector's values in their shortest text (no float32 needs more
    than 9 significant digits), read back as float32 bit for bit; codes as integers, arrays
    in a body's lists and dicts, views that are not contiguous too. A body with NaN or
    infinity in a float array is refused (check_finite), where JSON would write null."""
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((3, 1024)).astype(np.float32)
    vectors[0, :4] = [1e-30, 3.4028235e38, -0.0, 1.0]
    codes = np.arange(-3, 4, dtype=np.int8)
    body = {"data": [{"embedding": v} for v in vectors], "codes": codes, "odd": vectors[:, ::2]}
    check_finite(body)
    text = dumps(body)
    read = json.loads(text)
    got = np.array([d["embedding"] for d in read["data"]], np.float32)
    assert np.array_equal(got.view(np.int32), vectors.view(np.int32))
    assert np.array_equal(np.array(read["odd"], np.float32), vectors[:, ::2])
    assert read["codes"] == codes.tolist()
    mantissas = re.findall(rb"([0-9.]+)(?:e[-+]?[0-9]+)?", text)
    assert max(len(m.replace(b".", b"").lstrip(b"0")) for m in mantissas) <= 9  # digits
    for bad in (np.nan, np.inf):
        broken = vectors.copy()
        broken[2, 7] = bad
        with pytest.raises(APIError) as e:
            check_finite({"data": [{"embedding": v} for v in broken]})
        assert e.value.kind == BACKEND and "NaN or infinity" in e.value.message
        with pytest.raises(APIError):  # a response's rendering, where the null shows
            VectorResponse({"data": [{"embedding": v} for v in broken]})
    assert VectorResponse({"code": None, "v": vectors[0]}).status_code == 200  # a real null
    check_finite({"codes": codes, "scores": [0.5, 1.0]})  # integers and Python floats pass


def test_nim_ranking_body():
    asked = nim.RankingRequest.parse(
        {"model": "rerank", "query": {"text": "q"}, "passages": [{"text": "a"}, {"text": ""}]}
    )
    assert (asked.query.text, [p.text for p in asked.passages], asked.truncate) == (
        "q",
        ["a", ""],
        "END",
    )
    for body, param in [
        ({"query": {"text": "q"}, "passages": []}, "passages"),
        ({"query": {"text": " "}, "passages": [{"text": "a"}]}, "query"),
        ({"query": "q", "passages": [{"text": "a"}]}, "query"),
        ({"query": {"text": "q"}, "passages": ["a"]}, "passages"),
        ({"query": {"text": "q"}, "passages": [{"text": "a"}], "truncate": "START"}, "truncate"),
    ]:
        assert refusal(nim.RankingRequest.parse, body).param == param, body


def test_log_odds_keep_the_scores_order_and_stay_finite():
    """A reranker's logit from its float32 P("yes") (NIM's `logit`, TEI's raw scores): the
    inverse of the sigmoid, and at the saturated 0 and 1 the nearest float32's logit."""
    logits = [-30.0, -5.0, 0.0, 0.5, 7.0, 10.0]  # near 1, float32 resolves P less finely
    scores = torch.sigmoid(torch.tensor(logits)).tolist()  # float32, as the encoder gives
    assert [log_odds(s) for s in scores] == pytest.approx(logits, abs=1e-2)
    edges = [log_odds(0.0), log_odds(scores[0]), log_odds(scores[-1]), log_odds(1.0)]
    assert edges == sorted(edges) and all(math.isfinite(x) for x in edges)
    assert log_odds(1.0) > log_odds(1 - 2**-23) and log_odds(0.0) < log_odds(2**-126)


def rerank_v1(body: dict):
    return openai.parse_rerank_request({"model": "rerank", **body}, "rerank")


def test_rerank_bodies_of_every_api():
    request, options = rerank_v1({"query": "q", "documents": ["a", {"text": "b"}], "top_n": 1})
    assert (request.inputs, options) == (("q", ["a", "b"]), {"top_n": 1})
    # content parts (a multimodal reranker): per document, or vLLM's one document per part
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    request, _ = rerank_v1(
        {"query": [image], "documents": [[image, {"type": "text", "text": "c"}]]}
    )
    query, (document,) = request.inputs
    assert [p.type for p in query] == ["image_url"]
    assert [p.type for p in document] == ["image_url", "text"]
    request, _ = rerank_v1({"query": {"content": [image]}, "documents": {"content": [image] * 2}})
    assert [[p.type for p in d] for d in request.inputs[1]] == [["image_url"], ["image_url"]]
    e = refusal(rerank_v1, {"query": "q", "documents": [[{"type": "audio", "audio": "x"}]]})
    assert e.param == "documents", e.message
    assert refusal(rerank_v1, {"query": {"content": []}, "documents": ["a"]}).param == "query"
    assert refusal(rerank_v1, {"query": "q", "documents": ["a"], "top_n": -1}).param == "top_n"
    e = refusal(rerank_v1, {"query": " ", "documents": ["a"]})
    assert e.param == "query" and e.message == "'query' must be a non-empty string"
    e = refusal(rerank_v1, {"query": "q", "documents": ["a"] * (MAX_DOCUMENTS + 1)})
    assert e.param == "documents" and f"limit of {MAX_DOCUMENTS}" in e.message
    e = refusal(tei.RerankRequest.parse, {"query": "q", "texts": ["a", 2]})
    assert e.message == "`texts[1]` must be a string"  # TEI's quotes
    e = refusal(cohere.RerankRequest.parse, {"query": "q", "documents": []})
    assert e.kind == EMPTY and e.message == "invalid request: documents cannot be empty"
    e = refusal(cohere.RerankRequest.parse, {"query": "q", "documents": ["a"], "priority": -1})
    assert e.param == "priority" and ">= 0" in e.message


def test_vllm_rerank_fields():
    """vLLM's rerank fields are ours (top_n 0: every document; a cut per document, 0: none;
    the chat template's instruction; logits, as Infinity's raw_scores), or refused where they
    would cut what is not cut."""
    body = {"query": "q", "documents": ["a"]}
    assert rerank_v1(body | {"top_n": 0, "max_tokens_per_doc": 0})[1] == {}
    request, options = rerank_v1(body | {"max_tokens_per_doc": 8, "use_activation": False})
    assert options == {"max_document_tokens": 8} and request.logits
    # Infinity's raw_scores is the same switch; neither: the scores
    assert rerank_v1(body | {"raw_scores": True})[0].logits
    assert not rerank_v1(body | {"raw_scores": False})[0].logits
    assert not rerank_v1(body | {"use_activation": True})[0].logits
    assert not rerank_v1(body)[0].logits
    kwargs = {"chat_template_kwargs": {"instruction": "find"}}
    assert rerank_v1(body | kwargs)[1] == {"instruction": "find"}
    assert rerank_v1(body | {"max_tokens_per_query": 0, "truncate_prompt_tokens": -1})[1] == {}
    for extra, param, words in [
        ({"max_tokens_per_doc": -1}, "max_tokens_per_doc", ">= 0"),
        (kwargs | {"instruction": "x"}, "chat_template_kwargs", "not both"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs", "only"),
        ({"max_tokens_per_query": 16}, "max_tokens_per_query", "read whole"),
        ({"truncate_prompt_tokens": 64}, "truncate_prompt_tokens", "'max_tokens_per_doc'"),
        ({"raw_scores": True, "use_activation": False}, "raw_scores", "not both"),
    ]:
        e = refusal(rerank_v1, body | extra)
        assert e.param == param and words in e.message, e.message


def test_voyage_rerank_fields_and_shape():
    """Voyage AI's `top_k` and `truncation` are `top_n` and `truncate`; its response shape is
    ours relabelled, each document's text only where asked."""
    body = {"query": "q", "documents": ["a", "b"]}
    assert rerank_v1(body | {"top_k": 1, "truncation": False})[1] == {"top_n": 1, "truncate": False}
    assert rerank_v1(body | {"top_k": None, "truncation": None})[1] == {}
    e = refusal(rerank_v1, body | {"top_k": 1, "top_n": 1})
    assert e.param == "top_k" and "'top_k' or 'top_n'" in e.message
    ours = {
        "model": "rerank",
        "results": [{"index": 1, "relevance_score": 0.9, "document": {"text": "b"}}],
        "usage": {"total_tokens": 7},
    }
    assert openai.voyage_ranking(ours, True) == {
        "object": "list",
        "data": [{"relevance_score": 0.9, "index": 1, "document": "b"}],
        "model": "rerank",
        "usage": {"total_tokens": 7},
    }
    assert openai.voyage_ranking(ours, False)["data"] == [{"relevance_score": 0.9, "index": 1}]


def test_tei_bodies():
    asked = tei.EmbedRequest.parse({"inputs": "x", "truncation_direction": "Left"})
    assert asked.options(normalize=True) == {"truncation_direction": "left", "normalize": True}
    assert tei.EmbedRequest.parse({"inputs": [1, 2]}).options(False)["token_ids"] is True
    e = refusal(tei.EmbedRequest.parse, {"inputs": []})
    assert e.kind == EMPTY and e.message == "`inputs` cannot be empty"
    e = refusal(tei.EmbedRequest.parse, {"inputs": "x", "truncation_direction": "Up"})
    assert e.param == "truncation_direction" and "'Left' or 'Right'" in e.message
    e = refusal(tei.PredictRequest.parse, {"inputs": [["a", "b"]]})  # a pair
    assert e.param == "inputs"
    e = refusal(tei.PredictRequest.parse, {"inputs": "a", "parameters": {"top_k": 0}})
    assert e.message == "`parameters.top_k` must be >= 1"
    e = refusal(tei.SimilarityRequest.parse, {"inputs": {"source_sentence": "a"}})
    assert e.message == "`inputs.sentences` is required"
    assert tei.DecodeRequest.parse({"ids": [1, 2]}).ids == [[1, 2]]
    assert refusal(tei.TokenizeRequest.parse, {"inputs": [1, 2]}).param == "inputs"


def test_cohere_embed_body():
    asked = cohere.EmbedRequest.parse(
        {"inputs": [{"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    )
    assert [[p.text for p in item] for item in asked.items] == [["a", "b"]]
    assert asked.server_types() == ["float"]
    asked = cohere.EmbedRequest.parse({"texts": ["a"], "embedding_types": ["base64", "int8"]})
    assert asked.items == ["a"] and asked.server_types() == ["float", "int8"]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    asked = cohere.EmbedRequest.parse({"inputs": [{"content": [image]}]})
    assert asked.items[0][0].image_url.url == image["image_url"]["url"]
    asked = cohere.EmbedRequest.parse({"images": ["data:image/png;base64,AA=="]})
    assert asked.items[0][0].image_url.url == "data:image/png;base64,AA=="
    e = refusal(cohere.EmbedRequest.parse, {"inputs": [{"content": [{"type": "image_url"}]}]})
    assert e.message == "invalid request: inputs[0].content[0].image_url is required"
    e = refusal(cohere.EmbedRequest.parse, {"inputs": [{"content": [{"type": "audio"}]}]})
    assert e.message.startswith("invalid request: inputs[0].content[0]"), e.message
    e = refusal(cohere.EmbedRequest.parse, {"texts": ["a"], "input_type": "poem"})
    assert "input_type must be one of ['search_query'" in e.message
    for both_or_neither in ({"texts": ["a"], "images": ["data:,"]}, {}):
        e = refusal(cohere.EmbedRequest.parse, both_or_neither)
        assert e.message == "invalid request: send one of 'texts', 'inputs' and 'images'"


def test_openai_content_parts_and_messages():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    inputs, options, *_ = embeddings({"input": ["plain", [{"type": "text", "text": "t"}, image]]})
    assert inputs[0] == "plain" and [p.type for p in inputs[1]] == ["text", "image_url"]
    assert options == {}
    body = {
        "messages": [
            {"role": "system", "content": "Find the chart."},
            {"role": "user", "content": [image]},
        ]
    }
    inputs, options, *_ = embeddings(body)
    assert [p.type for p in inputs[0]] == ["image_url"]
    assert options == {"instruction": "Find the chart."}
    e = refusal(embeddings, {"input": "x", "messages": body["messages"]})
    assert e.message == "send one of 'input' and 'messages'"
    e = refusal(embeddings, {"input": [[image]], "chunks": {"size": 4}})
    assert e.param == "chunks"


@pytest.mark.parametrize("kind", ["image", "video"])
@pytest.mark.parametrize(
    "url, words",
    [
        ("data:{kind}/png;base64,@@", "{kind} data URL is not valid base64"),
        ("data:{kind}/png,plain", "{kind} data URL must be base64"),
        ("ftp://example.com/a.png", "{kind} URL must be a data URL"),
        ("https://example.com/a.png", "remote {kind} URLs are not allowed"),
    ],
)
def test_image_and_video_urls(url, words, kind):
    with pytest.raises(APIError, match=words.format(kind=kind)) as e:
        asyncio.run(media.file_bytes(url.format(kind=kind), "input[0]", kind, remote=None))
    assert e.value.param == "input"
    assert asyncio.run(media.file_bytes("data:image/png;base64,QUJD", "x", kind, False)) == b"ABC"


def test_video_parts_are_taken_as_vllm_writes_them():
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,QUJD"}}
    parts = [{"type": "text", "text": "a clip"}, video, video]
    inputs = embeddings({"input": [parts, "plain"]})[0]
    texts, images, videos = asyncio.run(media.texts_and_media(inputs, "input", None))
    assert (texts, images, videos) == (["a clip", "plain"], [[], []], [[b"ABC", b"ABC"], []])
    too_many = [video] * (MAX_VIDEOS_PER_TEXT + 1)
    inputs = embeddings({"input": [too_many]})[0]
    e = refusal(lambda i: asyncio.run(media.texts_and_media(i, "input", None)), inputs)
    assert "5 videos, more than the limit of 4" in e.message and e.param == "input"


def test_a_video_as_its_frames_is_taken_as_qwens_api_writes_it():
    """{"type": "video", "video": [frame URLs]}: one video, its frames' files in order, beside
    vLLM's video_url parts in the order given; a bad frame is named."""
    frames = {
        "type": "video",
        "video": ["data:image/png;base64,QUJD", "data:image/png;base64,REVG"],
    }
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,QUJD"}}
    inputs = embeddings({"input": [[video, {"type": "text", "text": "clips"}, frames]]})[0]
    texts, _, videos = asyncio.run(media.texts_and_media(inputs, "input", None))
    assert (texts, videos) == (["clips"], [[b"ABC", [b"ABC", b"DEF"]]])
    frames["video"][1] = "data:image/png;base64,@@"
    inputs = embeddings({"input": [[video, frames]]})[0]
    e = refusal(lambda i: asyncio.run(media.texts_and_media(i, "input", None)), inputs)
    assert e.message == "'input[0] video 1 frame 1' image data URL is not valid base64"
    assert e.param == "input"
    assert refusal(embeddings, {"input": [[{"type": "video", "video": []}]]}).param == "input"
    too_many = [video, frames, frames, video, frames]
    inputs = embeddings({"input": [too_many]})[0]
    e = refusal(lambda i: asyncio.run(media.texts_and_media(i, "input", None)), inputs)
    assert "5 videos, more than the limit of 4" in e.message


def test_an_input_as_qwens_scripts_write_it_is_its_content_parts():
    """{"text", "image", "video"}, each one or a list (format_model_input's): a list of URLs
    whose first is an image's is one video's frames, else a list of videos; the per-input
    options of those scripts are refused, naming the request's; a content part is not one."""
    png, mp4 = "data:image/png;base64,QUJD", "data:video/mp4;base64,REVG"
    inputs = embeddings(
        {
            "input": [
                {"text": ["a ", "chart"], "image": png},
                {"video": [png, png]},
                {"video": [mp4, [png]], "image": [png, png]},
                "plain",
            ]
        }
    )[0]
    texts, images, videos = asyncio.run(media.texts_and_media(inputs, "input", None))
    assert texts == ["a chart", "", "", "plain"]
    assert images == [[b"ABC"], [], [b"ABC", b"ABC"], []]
    assert videos == [[], [[b"ABC", b"ABC"]], [b"DEF", [b"ABC"]], []]
    for item, words in [
        ({"text": "x", "instruction": "find"}, "send 'instruction' beside the inputs"),
        ({"video": mp4, "fps": 2}, "send 'video_fps' beside the inputs"),
        ({"text": ""}, "holds no 'text', 'image' or 'video'"),
        ({"video": [png, [png]]}, "'video' mixes frames and videos"),
        ({"type": "text", "text": "x"}, "content parts"),
    ]:
        e = refusal(embeddings, {"input": [item]})
        assert words in e.message and e.param == "input", e.message


def test_ollama_bodies():
    asked = ollama.EmbedRequest.parse({"model": "embed", "input": "x", "keep_alive": "5m"})
    assert (asked.input, asked.truncate, asked.dimensions) == ("x", True, None)
    options = {"num_ctx": 64, "temperature": 0.2, "num_gpu": None}  # only num_ctx counts
    assert ollama._options(options, truncate=False) == {"truncate": False, "max_tokens": 64}
    assert ollama._options(None, normalize=False) == {"normalize": False}
    for options in [{"num_ctx": 0}, {"num_ctx": "64"}, {"num_ctx": True}]:
        e = refusal(lambda o: ollama._options(o), options)
        assert e.param == "options" and "'options.num_ctx' must be an integer >= 1" in e.message
    for body, param in [
        ({"input": "x"}, "model"),
        ({"model": "embed", "input": [1, 2]}, "input"),
        ({"model": "embed", "input": "x", "dimensions": -1}, "dimensions"),
        ({"model": "embed", "input": "x", "truncate": "yes"}, "truncate"),
    ]:
        assert refusal(ollama.EmbedRequest.parse, body).param == param
    assert (
        refusal(ollama.EmbeddingsRequest.parse, {"model": "embed", "prompt": 3}).param == "prompt"
    )


def test_images_as_jina_writes_them():
    """An input object's image as its file's bytes in base64 (Jina's API), and {"url"} or
    {"bytes"} (Jina's older inputs, LlamaIndex's JinaEmbedding): images; a path stays a path
    (refused as one)."""
    raw = base64.b64encode(b"an image file's bytes").decode()
    png = "data:image/png;base64," + raw
    inputs = embeddings({"input": [{"image": raw}, {"url": png}, {"bytes": raw}]})[0]
    _, images, _ = asyncio.run(media.texts_and_media(inputs, "input", None))
    assert images == [[b"an image file's bytes"]] * 3
    inputs = embeddings({"input": [{"image": "/data/images/photo.png"}]})[0]
    with pytest.raises(APIError, match="must be a data URL"):
        asyncio.run(media.texts_and_media(inputs, "input", None))
    for item in [{"url": png, "bytes": raw}, {"url": png, "text": "x"}]:
        assert refusal(embeddings, {"input": [item]}).param == "input"


def test_infinity_modality_reads_the_inputs_as_images():
    """Infinity's `modality` "image": each input an image's URL, read as one (not as the URL's
    text); "text" changes nothing; audio, and inputs that are not URLs, refused naming the
    field."""
    raw = base64.b64encode(b"an image file's bytes").decode()
    png = "data:image/png;base64," + raw
    for given in (png, [png, png]):
        inputs = embeddings({"input": given, "modality": "image"})[0]
        texts, images, _ = asyncio.run(media.texts_and_media(inputs, "input", None))
        assert images == [[b"an image file's bytes"]] * len(inputs) and texts == [""] * len(inputs)
    assert embeddings({"input": [png], "modality": "text"})[0] == [png]
    assert refusal(embeddings, {"input": "x", "modality": "audio"}).param == "modality"
    for bad in ([1, 2], [], [[{"type": "text", "text": "x"}]]):
        refused = refusal(embeddings, {"input": bad, "modality": "image"})
        assert refused.param == "input" and "image URLs" in refused.message


def test_rerank_objects_as_qwens_scripts_write_them():
    """A query, or a document with an image or a video, of the scripts' fields is its
    content parts; a document of Cohere's and Jina's {"text", ...} stays a text; the
    scripts' per-input options are refused."""
    png = "data:image/png;base64,QUJD"
    body = {
        "query": {"text": "q", "image": png},
        "documents": [{"text": "a", "title": "kept out"}, {"text": "b", "image": png}, "c"],
    }
    request, _ = openai.parse_rerank_request(body, "rerank")
    query, documents = request.inputs
    assert [type(p).__name__ for p in query] == ["ImagePart", "TextPart"]
    assert documents[0] == "a" and documents[2] == "c"
    assert [type(p).__name__ for p in documents[1]] == ["ImagePart", "TextPart"]
    for body, param in [
        ({"query": {"text": "q", "fps": 2}, "documents": ["a"]}, "query"),
        ({"query": "q", "documents": [{"text": "a", "max_frames": 8}]}, "documents"),
    ]:
        e = refusal(lambda b: openai.parse_rerank_request(b, "rerank"), body)
        assert "beside the inputs" in e.message and e.param == param, e.message


def test_vllm_pooling_fields_are_read_or_refused():
    """vLLM's `mm_processor_kwargs`: its `fps` is `video_fps`, on embeddings and rerank
    bodies; the processor's other arguments (pixel budgets, frame counts) and
    `media_io_kwargs` are the server's settings, and its `cache_salt` (a client's own prefix
    cache) and chat-template switches, and Cohere v1's `rank_fields` beyond a document's text,
    are not served: refused by name rather than silently ignored."""
    part = {"type": "text", "text": "q"}
    _, options, *_ = embeddings({"input": [[part]], "mm_processor_kwargs": {"fps": 0.5}})
    assert options["video_fps"] == 0.5
    _, options = rerank_v1({"query": "q", "documents": ["a"], "mm_processor_kwargs": {"fps": 2}})
    assert options["video_fps"] == 2
    assert embeddings({"input": "x", "mm_processor_kwargs": {}})[1] == {}
    for body, message in [
        ({"mm_processor_kwargs": {"max_pixels": 1024}}, "['max_pixels'] are the server's"),
        ({"mm_processor_kwargs": {"fps": 1}, "video_fps": 2}, "not both"),
        ({"cache_salt": "s" * 43}, "prefix_cache_mb 0"),
        ({"chat_template": "{{ messages }}"}, "the checkpoint's own recipe"),
        ({"media_io_kwargs": {"video": {"num_frames": 8}}}, "the server's image and video"),
    ]:
        inputs = {embeddings: {"input": "x"}, rerank_v1: {"query": "q", "documents": ["a"]}}
        for parse, given in inputs.items():
            e = refusal(parse, given | body)
            assert e.param == next(iter(body)) and message in e.message, e.message
    # the switches of vLLM's chat template for `messages`: their defaults are what is served
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert embeddings(chat | {"add_generation_prompt": False, "chat_template_kwargs": {}})[0]
    for field, value in [
        ("add_generation_prompt", True),
        ("continue_final_message", True),
        ("chat_template_kwargs", {"enable_thinking": False}),
    ]:
        e = refusal(embeddings, chat | {field: value})
        assert e.param == field and "the checkpoint's own recipe" in e.message, e.message
    # Cohere v1's rank_fields: its default, the document's text, is what is served
    documents = [{"title": "A", "text": "b"}]
    request, _ = rerank_v1({"query": "q", "documents": documents, "rank_fields": ["text"]})
    assert request.inputs == ("q", ["b"])
    e = refusal(rerank_v1, {"query": "q", "documents": documents, "rank_fields": ["title"]})
    assert e.param == "rank_fields" and "ranked by its 'text'" in e.message, e.message


def test_a_video_s_frames_are_within_the_video_limit_together(monkeypatch):
    monkeypatch.setattr(media, "MAX_VIDEO_BYTES", 5)
    frames = {"type": "video", "video": ["data:image/png;base64,QUJD"] * 2}  # 3 bytes each
    inputs = embeddings({"input": [[frames]]})[0]
    e = refusal(lambda i: asyncio.run(media.texts_and_media(i, "input", None)), inputs)
    assert e.message == "'input[0] video 0' frames are more than the limit of 5 bytes together"


def test_score_body():
    asked = score.ScoreRequest.parse({"text_1": "q", "text_2": ["a", "b"]})
    assert (asked.text_1, asked.text_2) == (["q"], ["a", "b"])
    assert refusal(score.ScoreRequest.parse, {"text_1": "q", "text_2": []}).param == "text_2"


def test_a_servers_refusal_is_written_in_the_bodys_fields():
    """backend_error: Triton's input names as the body's fields at the body's index (an item
    field, or a path per index), the query as `query`, Triton's ensemble prefix dropped; the
    param a message names as a parameter wins over the item it mentions."""
    from qwen_embed_client.client import EmbeddingError
    from qwen_embed_client.gateway.errors import backend_error

    def refused(message, params=(), items=None):
        e = backend_error(EmbeddingError(message, "StatusCode.INVALID_ARGUMENT"), params, items)
        assert e.kind == INVALID
        return e.message, e.param

    assert refused("in ensemble 'embed', input 'TEXT[7]' is empty", items="input") == (
        "'input[7]' is empty",
        "input",
    )
    sentences = lambda i: f"inputs.sentences[{i - 1}]"  # noqa: E731
    assert refused("input 'TEXT[3]' is empty", items=sentences) == (
        "'inputs.sentences[2]' is empty",
        "inputs",
    )
    assert refused(
        "input 'DOCUMENT_VIDEOS[2]' with 'QUERY' takes 99 tokens", items="documents"
    ) == ("'documents[2]' with 'query' takes 99 tokens", "documents")
    assert refused("input 'IMAGES' holds images", items="input") == (
        "'input' holds images",
        "input",
    )
    message, param = refused(
        "parameter 'chunk_size' = 9 cuts input 'TEXT[0]'", ("chunk_size",), "input"
    )
    assert (message, param) == ("parameter 'chunk_size' = 9 cuts 'input[0]'", "chunks")
    # without `items`, Triton's names stay as they are
    assert refused("input 'TEXT[1]' is empty")[0] == "input 'TEXT[1]' is empty"


@pytest.mark.parametrize(
    "headers, seconds",
    [
        ([(b"x-stainless-read-timeout", b"600.0")], 600.0),  # the openai SDK's default
        ([(b"X-Envoy-Expected-Rq-Timeout-Ms", b"1500")], 1.5),
        ([(b"x-stainless-read-timeout", b"20"), (b"x-envoy-expected-rq-timeout-ms", b"5000")], 5.0),
        ([(b"x-stainless-read-timeout", b"soon")], None),
        ([(b"x-stainless-read-timeout", b"0")], None),
        ([(b"x-stainless-read-timeout", b"-3")], None),
        ([(b"x-stainless-read-timeout", b"inf")], None),
        ([(b"x-stainless-read-timeout", b"nan")], None),
        ([(b"x-request-id", b"7")], None),
    ],
)
def test_the_wait_a_caller_announces(headers, seconds):
    """Besides its body: how long a request's caller waits (the deadline of the Triton
    requests made for it; test_gateway.py), the shortest of the headers that say it, and
    none from a value that is not a positive finite number."""
    assert waits_s(headers) == seconds
