"""How a gateway is told the models it serves, checked without Triton: the gateway's
--triton-model / --triton-rerank-model forms and the names they give, every mistake in them
stopping the gateway with one line; and the ensembles the launcher hands its gateway from a
repository of several checkpoints. (Requests routed by `model` through a real tritonserver:
test_checkpoints.py, test_rerank_serving.py.)"""

from __future__ import annotations

import sys

import pytest

from qwen_embed_client.gateway import app as gateway_app
from qwen_embed_client.gateway.app import create_app
from qwen_embed_client.gateway.served import Served
from qwen_embed_deploy.launcher import gateway_model_flags, gateway_models
from qwen_embed_deploy.repository import render


def test_a_served_model_is_an_ensemble_and_its_names():
    assert Served.parse("large") == Served("large", ("large",))
    assert Served.parse("large=big,Qwen/Qwen3-Embedding-8B") == Served(
        "large", ("big", "Qwen/Qwen3-Embedding-8B")
    )
    with pytest.raises(ValueError, match="no Triton model"):
        Served.parse("=big")


def test_models_named_alike_are_refused():
    app = create_app(["127.0.0.1:1"], more_models=(Served("large", ("large",)),))
    served = app.state.models
    assert [gw.model_names for gw in served.embedders] == [("embed",), ("large",)]
    assert [gw.client.model for gw in served.embedders] == ["embed", "large"]
    assert [gw.triton_rerank_model for gw in served.rerankers] == ["rerank"]
    with pytest.raises(ValueError, match="'rerank' is given to two models"):
        create_app(["127.0.0.1:1"], more_models=(Served("large", ("rerank",)),))
    # one model's embedder and reranker may share a name (an embedder that reranks)
    create_app(["127.0.0.1:1"], rerank_model_names=("embed",), triton_rerank_model="embed")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--triton-model", "a=x", "b=x"], "'x' is given to two models"),
        (["--triton-model", "a=x", "--served-model-name", "y"], "names the first model"),
        (["--triton-rerank-model", "=r"], "--triton-rerank-model '=r': no Triton model"),
        (["--triton-model", "embed", "large=rerank"], "'rerank' is given to two models"),
    ],
)
def test_a_mistaken_model_list_stops_the_gateway_in_one_line(monkeypatch, capsys, args, message):
    monkeypatch.setattr(sys, "argv", ["gateway", *args])
    monkeypatch.setattr("uvicorn.run", lambda *a, **k: pytest.fail("the gateway started"))
    with pytest.raises(SystemExit) as stopped:
        gateway_app.main()
    assert stopped.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in said and said.startswith("gateway: error: ")


def test_the_launcher_hands_its_gateway_every_ensemble(tmp_path):
    """`embed` and `rerank` first (they answer requests that name no model), then the others
    by name; no reranker where the rerank models are not loaded."""
    repo = render(
        tmp_path / "repo",
        {"small": tmp_path, "embed": tmp_path, "large": tmp_path},
        rerankers={"zr": tmp_path, "rerank": tmp_path},
    )
    assert gateway_models(repo, rerank=True) == (["embed", "large", "small"], ["rerank", "zr"])
    assert gateway_models(repo, rerank=False) == (["embed", "large", "small"], [])
    alone = render(tmp_path / "alone", {"b": tmp_path, "a": tmp_path})
    assert gateway_models(alone, rerank=True) == (["a", "b"], [])


def test_the_launcher_names_each_model_for_its_gateway(monkeypatch):
    """--served-model-name's plain names are the first embedder's, ENSEMBLE=NAME,... another
    model's; a model Ollama pulled keeps Ollama's names where none are given; the flags are
    ones the gateway takes, serving each model under those names."""
    models = (["embed", "large"], ["rerank", "mxbai"])
    flags = gateway_model_flags(models, ["embed", "qwen3", "mxbai=mxbai,acme/mxbai-v2"])
    assert flags == [
        "--triton-model",
        "embed=embed,qwen3",
        "large=large",
        "--triton-rerank-model",
        "rerank=rerank",
        "mxbai=mxbai,acme/mxbai-v2",
    ]
    served = _gateway_models(monkeypatch, flags)
    assert [gw.model_names for gw in served.embedders] == [("embed", "qwen3"), ("large",)]
    assert [gw.rerank_model_names for gw in served.rerankers] == [
        ("rerank",),
        ("mxbai", "acme/mxbai-v2"),
    ]
    pulled = gateway_model_flags(models, ["large=big"], ["embed", "tiny"], ["rerank", "rr"])
    assert pulled[:3] == ["--triton-model", "embed=embed,tiny", "large=big"]
    assert pulled[4] == "rerank=rerank,rr"
    alone = gateway_model_flags((["embed"], []), None)
    assert alone == ["--triton-model", "embed=embed", "--rerank-model-name", ""]
    assert _gateway_models(monkeypatch, alone).default.rerank_model_names == ()
    recipe = gateway_model_flags((["embed"], []), None, embed_reranks=True)
    assert recipe[2:] == ["--triton-rerank-model", "embed"]
    assert _gateway_models(monkeypatch, recipe).default.rerank_model_names == ("rerank",)
    with pytest.raises(ValueError, match="serves no model 'small' \\(it serves embed, large"):
        gateway_model_flags(models, ["small=s"])
    with pytest.raises(ValueError, match="names embed twice"):
        gateway_model_flags(models, ["e5", "embed=e6"])
    # a name given to two models: refused before the server starts, as the gateway refuses it
    with pytest.raises(ValueError, match=r"'big' is given to two models \(embed, large\)"):
        gateway_model_flags(models, ["big", "large=big"])
    with pytest.raises(ValueError, match=r"'mxbai' is given to two models \(large, mxbai\)"):
        gateway_model_flags(models, ["large=mxbai"])
    # the first embedder and the first reranker answer together: they may share one
    shared = gateway_model_flags(models, ["same"], first_rerank_names=["same"])
    served = _gateway_models(monkeypatch, shared)
    assert served.default.model_names == served.default.rerank_model_names == ("same",)


def _gateway_models(monkeypatch, flags: list[str]):
    """The served.ServedModels of a gateway started with `flags` (uvicorn not run)."""
    apps = []
    monkeypatch.setattr(sys, "argv", ["gateway", *flags])
    monkeypatch.setattr("uvicorn.run", lambda app, **_: apps.append(app))
    gateway_app.main()
    return apps[0].state.models
