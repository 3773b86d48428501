"""Real checkpoint layouts served through a real tritonserver against sentence-transformers.

Replicas (tests/replicas.py): Qwen3-Embedding-0.6B's layout, gte-Qwen2-1.5B-instruct's layout,
a Qwen3 layout with its own prompt set and a default_prompt_name, and a LoRA fine-tune of the
first as sentence-transformers saves one (adapter only); two more deployments name the first and
the fine-tune by Hugging Face model ids resolved from a pre-filled cache with HF_HUB_OFFLINE=1,
and two serve the first two as GGUF files (Q8_0, as llama.cpp's converter writes them), against
the same references on the models those files hold (tests/test_gguf.py has the details).
Encoders run fp32; vectors must reach cosine >= 0.9999 against
`SentenceTransformer(dir).encode(...)` for plain texts, every prompt name, `instruction` and a
raw `prompt`, and TOKEN_COUNT must equal the reference tokenizer's count.

gte-Qwen2 is the exception sentence-transformers cannot reproduce: its tokenizer_config.json says
`add_eos_token: true`, which only its remote-code tokenizer honours (transformers' Qwen2Tokenizer,
and so sentence-transformers, appends nothing). Its reference is therefore transformers'
Qwen2Model with the EOS appended as that code does, written out here; the same reference without
the EOS is checked against sentence-transformers, so only the EOS differs from it.
"""

import io
import json
import os
import shutil
import time

import numpy as np
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from sentence_transformers import SentenceTransformer
from tokenizers import Tokenizer
from transformers import Qwen2Model
from tritonclient.utils import InferenceServerException

from qwen_embed import Encoder
from qwen_embed.adapters import AdapterError
from qwen_embed.finetunes import ADAPTER_CONFIG
from qwen_embed.hub import CheckpointNotFoundError, resolve_checkpoint
from qwen_embed_client.contract import EmbedOptions, RequestError
from qwen_embed_deploy.repository import render
from qwen_embed_deploy.serving.tokenizer import PromptSet, TextTokenizer
from qwen_embed_deploy.triton import TritonServer, free_port

from reference import cosine
from replicas import (
    QWEN3_QUERY,
    as_gguf,
    gguf_weights,
    gte_qwen2,
    hub_snapshot,
    lora_finetune,
    qwen3_embedding,
)
from triton_helpers import gateway_metrics, infer, post_json, run_clients, wait_for

pytestmark = pytest.mark.server  # starts tritonserver or other processes

MIN_COSINE = 0.9999
SAME = 1e-6  # the same Triton request underneath
EOS = 151643
TEXTS = [
    "What is the capital of China?",
    "Beijing is the capital of China.",
    "naïve café — emoji 🎉 你好",
    "def f(x):\n    return x ** 2",
]
CUSTOM_PROMPTS = {
    "classification": "Classify the sentiment of the review: ",
    "clustering": "Identify the topic: ",
    "query": "Represent this question: ",
}
MODEL_ID = "acme/tiny-embed"
FINETUNE_ID = "acme/tiny-finetune"  # a LoRA fine-tune of MODEL_ID


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    cache = root / "hf-cache"
    qwen3 = qwen3_embedding(root / "Qwen3-Embedding-0.6B")
    hub_snapshot(cache, MODEL_ID, qwen3)
    finetune = lora_finetune(root / "my-finetune", qwen3)
    by_id = hub_snapshot(cache, FINETUNE_ID, finetune)
    adapter = json.loads((by_id / ADAPTER_CONFIG).read_text())
    (by_id / ADAPTER_CONFIG).write_text(json.dumps(adapter | {"base_model_name_or_path": MODEL_ID}))
    gte = gte_qwen2(root / "gte-Qwen2-1.5B-instruct")
    return {
        "qwen3": qwen3,
        "finetune": finetune,
        "gte": gte,
        "qwen3_gguf": as_gguf(root / "Qwen3-Embedding-0.6B-Q8_0.gguf", qwen3),
        "qwen3_held": gguf_weights(qwen3, root / "qwen3-as-q8_0"),
        "gte_gguf": as_gguf(root / "gte-Qwen2-Q8_0.gguf", gte, causal=False),
        "gte_held": gguf_weights(gte, root / "gte-as-q8_0"),
        "custom": qwen3_embedding(
            root / "custom-prompts",
            prompts=CUSTOM_PROMPTS,
            default_prompt_name="classification",
            seed=3,
        ),
        "cache": cache,
    }


@pytest.fixture(scope="module")
def gateway_port():
    return free_port()


@pytest.fixture(scope="module")
def server(dirs, tmp_path_factory, gateway_port):
    """Every deployment in one repository, and the launcher's gateway in front of them."""
    where = tmp_path_factory.mktemp("checkpoints-triton")
    deployments = {
        "qwen3": dirs["qwen3"],
        "gte": dirs["gte"],
        "custom": dirs["custom"],
        "byid": MODEL_ID,
        "finetune": dirs["finetune"],
        "finetune_byid": FINETUNE_ID,
        "qwen3_gguf": dirs["qwen3_gguf"],
        "gte_gguf": dirs["gte_gguf"],
    }
    overrides = {"encoder": {"dtype": "float32"}, "tokenizer": {"max_input_tokens": "8192"}}
    repo = render(where / "repo", deployments, overrides)
    env = {"HF_HUB_CACHE": str(dirs["cache"]), "HF_HUB_OFFLINE": "1"}
    env["QWEN_EMBED_BATCH_DIR"] = str(where / "batches")
    gateway = ["--gateway-port", str(gateway_port)]
    with TritonServer(repo, env=env, log_path=where / "server.log", launcher_args=gateway) as s:
        yield s


@pytest.fixture(scope="module")
def st(dirs):
    """sentence-transformers on each directory, fp32."""
    return {
        name: SentenceTransformer(
            str(dirs[name]), device="cpu", model_kwargs={"dtype": torch.float32}
        )
        for name in ("qwen3", "gte", "custom", "finetune", "qwen3_held")
    }


def gte_reference(model_dir, texts, prefix, eos=True):
    """transformers' Qwen2Model on (prefix + text) ids, + <|endoftext|> as gte-Qwen2's own
    tokenizer appends it; last token, L2-normalised. Returns (vectors, token counts)."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = Qwen2Model.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows, counts = [], []
    with torch.no_grad():
        for text in texts:
            ids = tok.encode(prefix + text).ids + ([EOS] if eos else [])
            rows.append(model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1])
            counts.append(len(ids))
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1).numpy(), counts


def st_counts(model, texts, prefix):
    return [len(model.tokenizer(prefix + t)["input_ids"]) for t in texts]


def check(server, deployment, reference, counts, **params):
    for protocol in ("http", "grpc"):
        vectors, got_counts = infer(server, TEXTS, protocol, model=deployment, **params)
        worst = cosine(vectors, reference).min()
        print(f"{deployment} {protocol} {params}: min cosine {worst:.7f}")
        assert worst >= MIN_COSINE, (deployment, params)
        assert got_counts.reshape(-1).tolist() == counts, (deployment, params)


def test_gte_reference_matches_sentence_transformers_apart_from_the_eos(dirs, st):
    without_eos, _ = gte_reference(dirs["gte"], TEXTS, QWEN3_QUERY + " ", eos=False)
    assert cosine(without_eos, st["gte"].encode(TEXTS, prompt_name="query")).min() >= 0.99999
    with_eos, _ = gte_reference(dirs["gte"], TEXTS, QWEN3_QUERY + " ")
    assert cosine(with_eos, without_eos).min() < 0.999  # the EOS matters: the test can fail


@pytest.mark.parametrize("name", ["qwen3", "byid"])
def test_qwen3_embedding_layout(server, st, name):
    model = st["qwen3"]
    check(server, name, model.encode(TEXTS), st_counts(model, TEXTS, ""))
    for prompt_name in ("query", "document"):
        prefix = model.prompts[prompt_name]
        check(
            server,
            name,
            model.encode(TEXTS, prompt_name=prompt_name),
            st_counts(model, TEXTS, prefix),
            prompt_name=prompt_name,
        )
    task = "Instruct: Find the city\nQuery:"
    check(
        server,
        name,
        model.encode(TEXTS, prompt=task),
        st_counts(model, TEXTS, task),
        instruction="Find the city",
    )
    check(
        server,
        name,
        model.encode(TEXTS, prompt="title: "),
        st_counts(model, TEXTS, "title: "),
        prompt="title: ",
    )


@pytest.mark.parametrize("name", ["finetune", "finetune_byid"])
def test_a_lora_finetune_is_served_over_its_base(server, st, name):
    """A fine-tune as sentence-transformers saves it (the adapter, its base named by path or
    by model id) against sentence-transformers loading the same directory: peft's forward."""
    model = st["finetune"]
    check(server, name, model.encode(TEXTS), st_counts(model, TEXTS, ""))
    check(
        server,
        name,
        model.encode(TEXTS, prompt_name="query"),
        st_counts(model, TEXTS, model.prompts["query"]),
        prompt_name="query",
    )
    base, _ = infer(server, TEXTS, model="qwen3")
    assert cosine(base, model.encode(TEXTS)).max() < 0.99  # the adapter matters: this can fail


def test_a_finetune_is_read_as_one_checkpoint(dirs, st, tmp_path):
    """finetunes.py: the base's files, the fine-tune's over them and its adapter under
    adapters/, laid out once per version of their files; what cannot be served is named."""
    path = resolve_checkpoint(dirs["finetune"])
    assert resolve_checkpoint(dirs["finetune"]) == path
    assert (path / "config.json").is_file() and (path / "adapters" / "lora").is_dir()
    assert not (path / "adapter_model.safetensors").exists()  # not among the base's weights
    ids = [st["qwen3"].tokenizer(t)["input_ids"] for t in TEXTS]
    with Encoder.from_pretrained(dirs["finetune"], dtype="float32", adapter="none") as enc:
        assert enc.route.adapter is None  # the base model itself
        assert cosine(enc.embed(ids), st["qwen3"].encode(TEXTS)).min() >= MIN_COSINE
    copy = shutil.copytree(dirs["finetune"], tmp_path / "copy")
    first = resolve_checkpoint(copy)
    os.utime(copy / "adapter_model.safetensors", ns=(1, 1))  # another version of the adapter
    assert resolve_checkpoint(copy) != first != path
    shutil.copy(dirs["qwen3"] / "config.json", copy)  # as some trainers save the base's
    with Encoder.from_pretrained(copy, dtype="float32") as enc:
        assert enc.route.adapter == "lora"
    adapter = json.loads((copy / ADAPTER_CONFIG).read_text())
    for changes, error, message in [
        (
            {"base_model_name_or_path": str(tmp_path / "nowhere")},
            CheckpointNotFoundError,
            "is a fine-tune of .*nowhere",
        ),
        (
            {"base_model_name_or_path": str(dirs["finetune"])},
            AdapterError,
            "an adapter over adapters",
        ),
        ({"peft_type": "IA3"}, AdapterError, "peft_type 'IA3'; only LoRA adapters are served"),
    ]:
        (copy / ADAPTER_CONFIG).write_text(json.dumps(adapter | changes))
        with pytest.raises(error, match=message):
            Encoder.from_pretrained(copy, dtype="float32")
    (copy / ADAPTER_CONFIG).write_text(json.dumps(adapter))
    tensors = load_file(copy / "adapter_model.safetensors")  # a whole module (modules_to_save)
    tensors["base_model.model.embed_tokens.weight"] = torch.zeros(8, 4)
    save_file(tensors, copy / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="embed_tokens.weight' is no LoRA pair's"):
        Encoder.from_pretrained(copy, dtype="float32")
    (copy / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        resolve_checkpoint(copy)


def test_gte_qwen2_layout(server, dirs):
    for prefix, params in [
        ("", {}),
        (QWEN3_QUERY + " ", {"prompt_name": "query"}),
        ("Instruct: Find the city\nQuery: ", {"instruction": "Find the city"}),
        ("title: ", {"prompt": "title: "}),
    ]:
        reference, counts = gte_reference(dirs["gte"], TEXTS, prefix)
        check(server, "gte", reference, counts, **params)


def test_gguf_files(server, dirs, st):
    """A GGUF file served as the model it holds: Qwen3-Embedding's (last token, its prompts as
    a bare checkpoint gets them) against sentence-transformers, gte-Qwen2's (attending both
    ways, the EOS its metadata appends) against its reference."""
    model = st["qwen3_held"]
    check(server, "qwen3_gguf", model.encode(TEXTS), st_counts(model, TEXTS, ""))
    check(
        server,
        "qwen3_gguf",
        model.encode(TEXTS, prompt_name="query"),
        st_counts(model, TEXTS, QWEN3_QUERY),
        prompt_name="query",
    )
    reference, counts = gte_reference(dirs["gte_held"], TEXTS, "")
    check(server, "gte_gguf", reference, counts)


def test_custom_prompts_and_default_prompt_name(server, st):
    model = st["custom"]
    default = CUSTOM_PROMPTS["classification"]
    check(server, "custom", model.encode(TEXTS), st_counts(model, TEXTS, default))
    for prompt_name, prefix in CUSTOM_PROMPTS.items():
        check(
            server,
            "custom",
            model.encode(TEXTS, prompt_name=prompt_name),
            st_counts(model, TEXTS, prefix),
            prompt_name=prompt_name,
        )


BAD = [
    (
        "custom",
        {"prompt_name": "document"},
        r"'prompt_name' must be one of \['classification', "
        r"'clustering', 'query'\]",
    ),
    ("qwen3", {"prompt": ""}, r"parameter 'prompt' must not be empty"),
    ("qwen3", {"prompt": "a", "prompt_name": "query"}, r"'prompt' replaces 'prompt_name'"),
    (
        "qwen3",
        {"truncation_direction": "middle"},
        r"'truncation_direction' must be one of \['right', 'left'\], got 'middle'",
    ),
    ("custom", {"instruction": "Find"}, r"'instruction' needs a 'query' prompt of the form"),
]


def test_one_gateway_serves_every_checkpoint_by_its_name(server, gateway_port):
    """The launcher's gateway serves each ensemble of the repository under its name: a body's
    `model` picks the checkpoint on the OpenAI, Cohere and Ollama APIs and in Batch API lines,
    each answer Triton's own for that ensemble (clients at once, naming different ones, too);
    a body naming none is answered by the first ensemble by name; /v1/models lists each with
    its own fingerprint."""
    base = f"http://127.0.0.1:{gateway_port}"
    wait_for(f"{base}/health")
    api = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    listed = {m.id: m.model_extra for m in api.models.list().data}
    names = sorted(server.model_stats())
    assert sorted(listed) == [n for n in names if not n.endswith(("_tokenizer", "_encoder"))]
    assert listed["qwen3"]["fingerprint"] != listed["gte"]["fingerprint"]

    def direct(name, **params):
        return infer(server, TEXTS, "grpc", model=name, **params)[0]

    for name in ("qwen3", "gte", "finetune"):
        answer = api.embeddings.with_raw_response.create(model=name, input=TEXTS)
        got = answer.parse()
        assert got.model == name
        assert answer.headers["x-model-fingerprint"] == listed[name]["fingerprint"]
        assert np.abs(np.array([d.embedding for d in got.data]) - direct(name)).max() <= SAME
    # clients at once, each naming one of three checkpoints: every answer its own model's,
    # counted in the gateway's metrics under its ensemble with its tokens
    names = ["qwen3", "gte", "finetune"] * 4
    want = {name: direct(name) for name in set(names)}
    usage = []  # (model, tokens) of each answer: appends are atomic across the threads
    before = gateway_metrics(base)

    def one(i):
        body = {"model": names[i], "input": TEXTS[i % 2 :]}
        status, got, _ = post_json(f"{base}/v1/embeddings", body)
        vectors = np.array([d["embedding"] for d in got["data"]])
        assert status == 200 and got["model"] == names[i]
        assert np.abs(vectors - want[names[i]][i % 2 :]).max() <= SAME, names[i]
        usage.append((names[i], got["usage"]["total_tokens"]))

    run_clients(len(names), one)
    after = gateway_metrics(base)

    def added(sample, **labels):
        key = sample + json.dumps(labels, sort_keys=True)
        return after.get(key, 0) - before.get(key, 0)

    for name in set(names):
        ok = {"api": "openai", "route": "/v1/embeddings", "status": "200", "key": ""}
        assert added("qwen_embed_gateway_requests_total", model=name, **ok) == 4
        tokens = sum(n for model, n in usage if model == name)
        assert added("qwen_embed_gateway_tokens_total", model=name, api="openai", key="") == tokens
    status, got, _ = post_json(f"{base}/v1/embeddings", {"input": TEXTS})
    first = sorted(listed)[0]  # the launcher's first: `embed`, else the first by name
    assert status == 200 and got["model"] == first
    vectors = np.array([d["embedding"] for d in got["data"]])
    assert np.abs(vectors - direct(first)).max() <= SAME
    body = {"model": "gte", "texts": TEXTS, "input_type": "search_query"}
    status, got, _ = post_json(f"{base}/v2/embed", body | {"embedding_types": ["float"]})
    want = direct("gte", prompt_name="query")
    assert status == 200 and np.abs(np.array(got["embeddings"]["float"]) - want).max() <= SAME
    status, got, _ = post_json(f"{base}/api/embed", {"model": "finetune", "input": TEXTS})
    assert status == 200 and np.abs(np.array(got["embeddings"]) - direct("finetune")).max() <= SAME
    status, got, _ = post_json(f"{base}/v1/embeddings", {"model": "nope", "input": TEXTS})
    assert status == 404 and got["error"]["param"] == "model"
    assert all(f"'{name}'" in got["error"]["message"] for name in listed)  # every model named
    # Batch API lines, each answered by the checkpoint it names
    lines = [
        {"custom_id": name, "method": "POST", "url": "/v1/embeddings", "body": {"model": name}}
        for name in ("gte", "qwen3", "qwen3_gguf", "nope")
    ]
    text = "".join(
        json.dumps(line | {"body": line["body"] | {"input": TEXTS}}) + "\n" for line in lines
    )
    source = api.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch")
    batch = api.batches.create(
        input_file_id=source.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = api.batches.retrieve(batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 1)
    (refused,) = api.files.content(batch.error_file_id).text.splitlines()
    refused = json.loads(refused)
    assert refused["custom_id"] == "nope" and refused["response"]["status_code"] == 404
    for line in api.files.content(batch.output_file_id).text.splitlines():
        answer = json.loads(line)
        name, body = answer["custom_id"], answer["response"]["body"]
        assert body["model"] == name
        vectors = np.array([d["embedding"] for d in body["data"]])
        assert np.abs(vectors - direct(name)).max() <= SAME, name


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_values_are_invalid_arg(server, protocol):
    for deployment, params, message in BAD:
        with pytest.raises(InferenceServerException, match=message) as info:
            infer(server, TEXTS[:1], protocol, model=deployment, **params)
        assert str(info.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT")


@pytest.mark.parametrize("name", ["qwen3", "gte"])
def test_truncation_keeps_either_end_and_the_eos(dirs, name):
    tok = Tokenizer.from_file(str(dirs[name] / "tokenizer.json"))
    text = " ".join(f"w{i}" for i in range(60))
    body = tok.encode(text, add_special_tokens=False).ids
    assert len(body) > 40
    tokenizer = TextTokenizer(dirs[name], 16)
    right = tokenizer.encode([text], EmbedOptions())[0]
    left = tokenizer.encode([text], EmbedOptions(truncation_direction="left"))[0]
    # Both add <|endoftext|> (Qwen3's post-processor; gte's add_eos_token) and keep it.
    assert right == body[:15] + [EOS] and left == body[-15:] + [EOS]
    assert TextTokenizer(dirs[name], 16, "left").encode([text], EmbedOptions())[0] == left


def test_left_truncation_served(server, dirs):
    tok = Tokenizer.from_file(str(dirs["qwen3"] / "tokenizer.json"))
    text = "start " + "word " * 9000 + "the very end"
    vectors, counts = infer(server, [text], "grpc", model="qwen3", truncation_direction="left")
    assert counts.tolist() == [[8192]]
    ids = tok.encode(text, add_special_tokens=False).ids[-8191:] + [EOS]
    with Encoder.from_pretrained(dirs["qwen3"], dtype="float32") as enc:
        assert cosine(vectors, enc.embed([ids])).min() >= MIN_COSINE


def test_prompt_set_reading(dirs):
    assert PromptSet.from_dir(dirs["gte"]).prompts == {"query": QWEN3_QUERY + " "}
    custom = PromptSet.from_dir(dirs["custom"])
    assert custom.default_name == "classification" and custom.names == sorted(CUSTOM_PROMPTS)
    with pytest.raises(RequestError, match="'instruction' needs"):
        custom.instruction_prompt("x")
    bare = PromptSet.from_dir(dirs["cache"])  # no sentence-transformers file: Qwen3's prompts
    assert bare.prompts == {"query": QWEN3_QUERY, "document": ""}


def test_model_ids_resolve_from_the_cache_or_fail_clearly(dirs, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(dirs["cache"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = resolve_checkpoint(MODEL_ID)
    assert (path / "config.json").is_file() and path.parent.name == "snapshots"
    with Encoder.from_pretrained(MODEL_ID, dtype="float32") as enc:
        assert enc.embed([[1, 2, 3]]).shape == (1, 64)
    with pytest.raises(CheckpointNotFoundError, match=rf"acme/missing .*{dirs['cache']}"):
        resolve_checkpoint("acme/missing")
    with pytest.raises(CheckpointNotFoundError, match="neither a checkpoint directory"):
        resolve_checkpoint(dirs["cache"])


def test_uncached_model_id_stops_the_server_before_ready(dirs, tmp_path):
    repo = render(tmp_path / "repo", {"embed": "acme/missing"})
    env = {"HF_HUB_CACHE": str(dirs["cache"]), "HF_HUB_OFFLINE": "1"}
    server = TritonServer(repo, env=env, log_path=tmp_path / "server.log")
    with pytest.raises(RuntimeError, match="tritonserver exited"):
        server.start(timeout=120)
    server.stop()
    log = (tmp_path / "server.log").read_text()
    assert "acme/missing is not in the Hugging Face cache" in log and str(dirs["cache"]) in log
