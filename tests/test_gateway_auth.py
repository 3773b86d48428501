"""With API keys set, every route of the gateway app refuses a request without a key (or with
a wrong one) before its handler runs: authentication is a dependency of every API router
(gateway/app.py), so a new route cannot forget it; a browser's preflight, which carries no
key, is answered for the origins allowed. No Triton is needed: nothing gets past it."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from qwen_embed_client.gateway.app import create_app

# liveness and readiness probes carry no key (and /metrics, outside the schema)
OPEN = {"/health", "/v1/health/live", "/v1/health/ready"}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    return create_app(
        ["127.0.0.1:1"], api_keys=("right-key",), batch_dir=tmp_path_factory.mktemp("batches")
    )


def _routes(app) -> list[tuple[str, str]]:
    """(method, path) of every API route, from the app's OpenAPI schema (which lists the
    routers' routes however they are nested), path parameters filled in."""
    out = []
    for path, operations in app.openapi()["paths"].items():
        if path not in OPEN:
            filled = path.replace("{file_id}", "file-x").replace("{batch_id}", "batch-x")
            out += [(method.upper(), filled) for method in sorted(operations)]
    return out


def test_every_route_refuses_a_request_without_the_key(app):
    routes = _routes(app)
    paths = {p for _, p in routes}
    # the four APIs' routes are all there: a check over no routes would pass vacuously
    assert {"/v1/embeddings", "/v1/batches", "/v2/embed", "/embed", "/info"} <= paths
    assert {"/v1/score", "/embed_all", "/v1/ranking"} <= paths
    assert "/openai/deployments/{deployment}/embeddings" in paths  # Azure OpenAI's
    assert "/v1beta/models/{model}:batchEmbedContents" in paths  # Gemini's
    client = TestClient(app)  # no lifespan: nothing starts, nothing reaches Triton
    wrong = [{"Authorization": "Bearer wrong-key"}, {"Authorization": "right-key"}]
    # Azure's api-key and Google's x-goog-api-key headers take the key too, but not beside a
    # wrong Authorization
    for header in ("api-key", "x-goog-api-key"):
        wrong += [{header: "wrong-key"}, {header: "right-key", "Authorization": "Bearer x"}]
    for headers in ({}, *wrong):
        for method, path in routes:
            response = client.request(method, path, headers=headers, json={})
            assert response.status_code == 401, (method, path, headers, response.text)


def test_the_probe_needs_no_key_and_a_refusal_speaks_its_api(app):
    client = TestClient(app)
    assert client.get("/health").status_code == 200
    assert client.get("/v1/health/live").json()["live"] is True  # NIM's probes
    not_ready = client.get("/v1/health/ready")  # no Triton behind this gateway
    assert not_ready.status_code == 503 and not_ready.json()["ready"] is False
    assert client.get("/metrics").status_code == 200  # scrapes carry no key either
    openai = client.post("/v1/embeddings", json={}).json()
    assert openai["error"]["code"] == "invalid_api_key"
    tei = client.post("/embed", json={})
    assert tei.status_code == 401 and tei.content == b""  # TEI answers a bare 401
    gemini = client.post("/v1beta/models/embed:batchEmbedContents", json={})
    assert gemini.json()["error"] == {
        "code": 401,
        "message": "Incorrect API key provided",
        "status": "UNAUTHENTICATED",
    }


def test_a_route_added_to_a_router_later_needs_the_key_too(tmp_path):
    """A handler that never asks for the key is still behind it."""
    from qwen_embed_client.gateway import openai

    @openai.router.get("/v1/forgetful")
    async def forgetful():
        return {"ok": True}

    try:
        app = create_app(["127.0.0.1:1"], api_keys=("right-key",), batch_dir=tmp_path)
        client = TestClient(app)
        assert client.get("/v1/forgetful").status_code == 401
        ok = client.get("/v1/forgetful", headers={"Authorization": "Bearer right-key"})
        assert ok.status_code == 200 and ok.json() == {"ok": True}
        for header in ("api-key", "x-goog-api-key"):  # Azure's and Google's headers
            ok = client.get("/v1/forgetful", headers={header: "right-key"})
            assert ok.status_code == 200, header
    finally:
        openai.router.routes[:] = [r for r in openai.router.routes if r.path != "/v1/forgetful"]


def test_cross_origin_calls_from_the_origins_allowed_only():
    """With origins allowed, a browser's preflight from one (which carries no key) is answered
    before any route, naming what the page may send; its real request still needs the key,
    and its answers (refusals too) say the page may read them. Another origin's preflight is
    refused; without origins, no answer says any page may read it."""
    origin = "https://app.example"
    client = TestClient(
        create_app(["127.0.0.1:1"], api_keys=("right-key",), cors_origins=(origin,))
    )
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
    }
    answer = client.options("/v1/embeddings", headers={"Origin": origin, **preflight})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == origin
    allowed = answer.headers["access-control-allow-headers"].lower()
    assert {"authorization", "content-type", "x-stainless-os"} <= set(allowed.split(", "))
    assert "POST" in answer.headers["access-control-allow-methods"]
    other = client.options(
        "/v1/embeddings", headers={"Origin": "https://evil.example", **preflight}
    )
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    refused = client.post("/v1/embeddings", headers={"Origin": origin}, json={})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == origin
    assert "x-model-fingerprint" in refused.headers["access-control-expose-headers"]

    closed = TestClient(create_app(["127.0.0.1:1"], api_keys=("right-key",)))
    answer = closed.options("/v1/embeddings", headers={"Origin": origin, **preflight})
    assert answer.status_code == 405 and "access-control-allow-origin" not in answer.headers
    refused = closed.post("/v1/embeddings", headers={"Origin": origin}, json={})
    assert refused.status_code == 401 and "access-control-allow-origin" not in refused.headers
