"""OpenAI-compatible embeddings gateway in front of Triton (gRPC).

    python -m qwen_embed_client.gateway --triton-url localhost:8001 [--triton-url ...]
        [--host 127.0.0.1] [--port 8080] [--model-name embed] [--api-key KEY | $QWEN_EMBED_API_KEY]

POST /v1/embeddings, GET /v1/models, GET /health. Needs the `gateway` extra (fastapi, uvicorn).
"""

from __future__ import annotations

import argparse
import base64
import hmac
import os
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .client import AsyncEmbeddingClient, EmbeddingError

MAX_INPUTS = 2048


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)  # fmt: skip


def _invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def parse_request(body: object, served_model: str) -> tuple[list[str], dict, str]:
    """Validate an OpenAI embeddings request body -> (texts, client options, encoding)."""
    if not isinstance(body, dict):
        raise _invalid("request body must be a JSON object")
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise _invalid("'input' must be a string or a non-empty list of strings "
                       "(token arrays are not supported)", "input")  # fmt: skip
    if len(texts) > MAX_INPUTS:
        raise _invalid(f"'input' holds {len(texts)} items, more than the limit of {MAX_INPUTS}",
                       "input")  # fmt: skip
    model = body.get("model")
    if model != served_model:
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                            f"'{served_model}'", "invalid_request_error", "model",
                       "model_not_found")  # fmt: skip
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise _invalid("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    options = {}
    dims = body.get("dimensions")
    if dims is not None:
        if isinstance(dims, bool) or not isinstance(dims, int):
            raise _invalid("'dimensions' must be an integer", "dimensions")
        options["dimensions"] = dims
    return texts, options, encoding


def _error_body(e: APIError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def create_app(triton_urls: list[str], *, model_name: str = "embed", api_key: str | None = None,
               triton_model: str = "embed"):  # fmt: skip
    client = AsyncEmbeddingClient(triton_urls, protocol="grpc", model=triton_model)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await client.close()

    app = FastAPI(title="qwen-embed OpenAI-compatible gateway", lifespan=lifespan)
    created = int(time.time())

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "Incorrect API key provided", "invalid_request_error",
                           code="invalid_api_key")  # fmt: skip

    @app.exception_handler(APIError)
    async def api_error(_request, e: APIError):
        return JSONResponse(_error_body(e), status_code=e.status)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {
            "object": "list",
            "data": [
                {"id": model_name, "object": "model", "created": created, "owned_by": "qwen-embed"}
            ],
        }

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        check_key(request)
        try:
            body = await request.json()
        except ValueError:
            raise _invalid("request body is not valid JSON") from None
        texts, options, encoding = parse_request(body, model_name)
        try:
            result = await client.embed_with_usage(texts, **options)
        except EmbeddingError as e:
            if e.retryable:
                raise APIError(503, f"embedding backend unavailable: {e}", "server_error") from e
            raise _invalid(str(e), "dimensions" if "dimensions" in str(e) else None) from e
        data = []
        for i, vector in enumerate(result.embeddings):
            value = (base64.b64encode(vector.astype("<f4").tobytes()).decode()
                     if encoding == "base64" else vector.tolist())  # fmt: skip
            data.append({"object": "embedding", "index": i, "embedding": value})
        usage = {"prompt_tokens": result.total_tokens, "total_tokens": result.total_tokens}
        return {"object": "list", "data": data, "model": model_name, "usage": usage}

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--triton-url", action="append", help="Triton gRPC address, repeatable")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--model-name", default="embed", help="model id clients send")
    p.add_argument("--api-key", default=os.environ.get("QWEN_EMBED_API_KEY"))
    args = p.parse_args()
    import uvicorn

    app = create_app(args.triton_url or ["localhost:8001"], model_name=args.model_name,
                     api_key=args.api_key or None)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
