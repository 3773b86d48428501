"""OpenAI-compatible embeddings and Cohere/Jina-compatible rerank gateway in front of Triton.

    python -m qwen_embed_client.gateway --triton-url localhost:8001 [--triton-url ...]
        [--host 127.0.0.1] [--port 8080] [--model-name embed] [--rerank-model-name rerank]
        [--api-key KEY | $QWEN_EMBED_API_KEY] [--otlp-endpoint URL | $OTEL_EXPORTER_OTLP_ENDPOINT]

POST /v1/embeddings, POST /v1/rerank (also /rerank), GET /v1/models, GET /health. Needs the
`gateway` extra (fastapi, uvicorn, opentelemetry). An empty --rerank-model-name turns
/v1/rerank off. With an OTLP endpoint every request is traced (tracing.py).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hmac
import os
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .cli import checkpoint_prompts
from .client import EMBEDDING_OUTPUTS, AsyncEmbeddingClient, EmbeddingError, priority_level

MAX_INPUTS = 2048
MAX_DOCUMENTS = 1000  # per /v1/rerank request; the client splits them over Triton requests


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )


def _invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


EMBEDDING_TYPES = tuple(EMBEDDING_OUTPUTS)


def parse_request(body: object, served_model: str) -> tuple[list[str], dict, str, list[str], bool]:
    """Validate an OpenAI embeddings request body -> (texts, client options, encoding, the
    embedding types to return, whether the response keys them by name)."""
    if not isinstance(body, dict):
        raise _invalid("request body must be a JSON object")
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise _invalid(
            "'input' must be a string or a non-empty list of strings "
            "(token arrays are not supported)",
            "input",
        )
    if len(texts) > MAX_INPUTS:
        raise _invalid(
            f"'input' holds {len(texts)} items, more than the limit of {MAX_INPUTS}", "input"
        )
    _check_utf8([(f"input[{i}]", t) for i, t in enumerate(texts)])
    _check_model(body.get("model"), served_model)
    options = {}
    dims = body.get("dimensions")
    if dims is not None:
        if isinstance(dims, bool) or not isinstance(dims, int):
            raise _invalid("'dimensions' must be an integer", "dimensions")
        options["dimensions"] = dims
    options.update(_priority(body))
    encoding, kinds, keyed = _embedding_types(body)
    if "chunks" in body:
        if kinds != ["float"] or keyed:
            raise _invalid("'chunks' come as float vectors: send no embedding type", "chunks")
        options.update(_chunks(body["chunks"]))
    return texts, options, encoding, kinds, keyed


def _chunks(value: object) -> dict:
    """The late-chunking extension: {"size": tokens} or {"spans": [[start, end], ...]} over
    each text's own tokens (the server checks the ranges)."""
    if isinstance(value, dict) and set(value) == {"size"}:
        size = value["size"]
        if not isinstance(size, bool) and isinstance(size, int):
            return {"chunk_size": size}
    if isinstance(value, dict) and set(value) == {"spans"}:
        spans = value["spans"]
        if isinstance(spans, list) and all(
            isinstance(s, list)
            and len(s) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in s)
            for s in spans
        ):
            return {"spans": spans}
    raise _invalid(
        '\'chunks\' must be {"size": tokens} or {"spans": [[start, end], ...]}', "chunks"
    )


def _priority(body: dict) -> dict:
    """`priority`: "interactive" (default) or "bulk" (Triton's levels 1 and 2; vLLM's
    integer form is accepted as those levels)."""
    if "priority" not in body:
        return {}
    try:
        priority_level(body["priority"])
    except ValueError as e:
        raise _invalid(f"'priority' {e.args[0].removeprefix('priority ')}", "priority") from None
    return {"priority": body["priority"]}


def _embedding_types(body: dict) -> tuple[str, list[str], bool]:
    """(encoding, embedding types, keyed by name) from `encoding_format` (OpenAI: float or
    base64; a compact type's name as in vLLM and NIM), `embedding_type` (ours) or
    `embedding_types` (Cohere: a list, answered keyed by type)."""
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64", *EMBEDDING_TYPES):
        raise _invalid(
            f"'encoding_format' must be 'float', 'base64' or one of {list(EMBEDDING_TYPES)}",
            "encoding_format",
        )
    asked = [key for key in ("embedding_type", "embedding_types") if key in body]
    if encoding not in ("float", "base64"):
        asked.append("encoding_format")
    if len(asked) > 1:
        raise _invalid(f"send one of {asked}, not several", asked[1])
    if "embedding_types" in body:
        kinds = body["embedding_types"]
        if (
            not isinstance(kinds, list)
            or not kinds
            or not all(isinstance(k, str) and k in EMBEDDING_TYPES for k in kinds)
            or len(set(kinds)) != len(kinds)
        ):
            raise _invalid(
                f"'embedding_types' must be a list of distinct values from {list(EMBEDDING_TYPES)}",
                "embedding_types",
            )
        return encoding, kinds, True
    if encoding not in ("float", "base64"):
        return "float", [encoding], False
    kind = body.get("embedding_type", "float")
    if kind not in EMBEDDING_TYPES:
        raise _invalid(f"'embedding_type' must be one of {list(EMBEDDING_TYPES)}", "embedding_type")
    return encoding, [kind], False


def _check_utf8(named_texts: list[tuple[str, str]]) -> None:
    """JSON may escape a lone surrogate (\\ud800), which no UTF-8 text can hold."""
    for name, text in named_texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise _invalid(
                f"'{name}' is not valid UTF-8 (a lone surrogate)", name.split("[")[0]
            ) from None


def _check_model(model: object, served_model: str | None) -> None:
    if not served_model or model != served_model:
        serves = f"this endpoint serves '{served_model}'" if served_model else "it is off here"
        raise APIError(
            404,
            f"The model '{model}' does not exist; {serves}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def parse_rerank_request(body: object, served_model: str | None) -> tuple[str, list[str], dict]:
    """Validate a Cohere/Jina-style rerank body -> (query, documents, options)."""
    if not isinstance(body, dict):
        raise _invalid("request body must be a JSON object")
    _check_model(body.get("model"), served_model)
    query = body.get("query")
    if not isinstance(query, str) or not query.strip():
        raise _invalid("'query' must be a non-empty string", "query")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise _invalid(
            "'documents' must be a non-empty list of strings or {\"text\": ...} objects",
            "documents",
        )
    if len(documents) > MAX_DOCUMENTS:
        raise _invalid(
            f"'documents' holds {len(documents)} items, more than the limit of {MAX_DOCUMENTS}",
            "documents",
        )
    texts = []
    for i, doc in enumerate(documents):
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str):
            raise _invalid(
                f"'documents[{i}]' must be a string or an object with a string 'text'", "documents"
            )
        texts.append(text)
    _check_utf8([("query", query)] + [(f"documents[{i}]", t) for i, t in enumerate(texts)])
    options = {}
    top_n = body.get("top_n")
    if top_n is not None:
        if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
            raise _invalid("'top_n' must be an integer >= 1", "top_n")
        options["top_n"] = top_n
    instruction = body.get("instruction")
    if instruction is not None:
        if not isinstance(instruction, str) or not instruction.strip():
            raise _invalid("'instruction' must be a non-empty string", "instruction")
        options["instruction"] = instruction
    return_documents = body.get("return_documents", True)
    if not isinstance(return_documents, bool):
        raise _invalid("'return_documents' must be a boolean", "return_documents")
    options["return_documents"] = return_documents
    options.update(_priority(body))
    return query, texts, options


def _backend_error(e: EmbeddingError, params: tuple[str, ...]) -> APIError:
    if e.retryable:
        return APIError(503, f"backend unavailable: {e}", "server_error")
    message = str(e)
    if "unknown model" in message:  # Triton does not serve it (e.g. started with --no-rerank)
        return APIError(
            404,
            f"the backend does not serve this model: {message}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )
    param = next((p for p in params if p.upper() in message.upper()), None)
    return _invalid(message, param)


async def _json_body(request: Request) -> object:
    try:
        return await request.json()
    except ValueError:
        raise _invalid("request body is not valid JSON") from None


def _value(vector, encoding: str):
    if encoding == "base64":  # the vector's bytes: little-endian float32, or the codes
        return base64.b64encode(vector.astype(vector.dtype.newbyteorder("<")).tobytes()).decode()
    return vector.tolist()


def _embeddings_body(data: list, model_name: str, tokens: int) -> dict:
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model_name, "usage": usage}


def _error_body(e: APIError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def create_app(
    triton_urls: list[str],
    *,
    model_name: str = "embed",
    api_key: str | None = None,
    triton_model: str = "embed",
    rerank_model_name: str | None = "rerank",
    triton_rerank_model: str = "rerank",
    metrics_url: str | None = None,
    otlp_endpoint: str | None = None,
):
    client = AsyncEmbeddingClient(
        triton_urls, protocol="grpc", model=triton_model, rerank_model=triton_rerank_model
    )
    tracing = None
    if otlp_endpoint:
        from .tracing import Tracing

        tracing = Tracing(otlp_endpoint)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await client.close()
        if tracing is not None:
            tracing.shutdown()

    app = FastAPI(title="qwen-embed OpenAI-compatible gateway", lifespan=lifespan)

    if tracing is not None:

        @app.middleware("http")
        async def trace(request: Request, call_next):
            path = request.url.path
            if path == "/health":  # probes, not traffic
                return await call_next(request)
            with tracing.request_span(request.method, path, request.headers) as span:
                response = await call_next(request)
                span.set_attribute("http.response.status_code", response.status_code)
                return response

    def outgoing() -> dict | None:
        """Headers for the Triton requests: the current span's trace context."""
        return tracing.outgoing_headers() if tracing is not None else None

    # the renderer's naming (serving/repository.py): embed -> tokenizer, NAME -> NAME_tokenizer
    tokenizer = "tokenizer" if triton_model == "embed" else f"{triton_model}_tokenizer"
    created = int(time.time())

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(
                401, "Incorrect API key provided", "invalid_request_error", code="invalid_api_key"
            )

    @app.exception_handler(APIError)
    async def api_error(_request, e: APIError):
        return JSONResponse(_error_body(e), status_code=e.status)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        served = [{"id": model_name}]
        if metrics_url:  # the checkpoint's prompt names, published by the tokenizer model
            prompts = await asyncio.to_thread(checkpoint_prompts, metrics_url, [tokenizer])
            if isinstance(prompts, dict):
                served[0].update(
                    prompt_names=prompts["names"], default_prompt_name=prompts["default"]
                )
        if rerank_model_name and await client.model_ready(triton_rerank_model):
            served.append({"id": rerank_model_name})
        return {
            "object": "list",
            "data": [
                {**entry, "object": "model", "created": created, "owned_by": "qwen-embed"}
                for entry in served
            ],
        }

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        check_key(request)
        texts, options, encoding, kinds, keyed = parse_request(
            await _json_body(request), model_name
        )
        if tracing is not None:
            tracing.set_attributes(**{"qwen_embed.inputs": len(texts)})
        if "chunk_size" in options or "spans" in options:
            return await chunk_embeddings(texts, options, encoding)
        try:  # one request per type, computed on the server
            results = await asyncio.gather(
                *(
                    client.embed_with_usage(texts, **options, embedding_type=k, headers=outgoing())
                    for k in kinds
                )
            )
        except EmbeddingError as e:
            raise _backend_error(e, ("dimensions",)) from e

        data = []
        for i in range(len(texts)):
            entry = {"object": "embedding", "index": i}
            if keyed:
                entry["embeddings"] = {
                    k: _value(r.embeddings[i], encoding)
                    for k, r in zip(kinds, results, strict=True)
                }
            else:
                entry["embedding"] = _value(results[0].embeddings[i], encoding)
            data.append(entry)
        return _embeddings_body(data, model_name, results[0].total_tokens)

    async def chunk_embeddings(texts, options, encoding):
        """Late chunking: each data item lists its chunks (characters and vector)."""
        try:
            results = await client.embed_chunks(texts, **options, headers=outgoing())
        except EmbeddingError as e:
            raise _backend_error(e, ("dimensions", "chunk_size", "chunk_spans")) from e
        data = [
            {
                "object": "embedding",
                "index": i,
                "chunks": [
                    {"start": int(a), "end": int(b), "embedding": _value(v, encoding)}
                    for (a, b), v in zip(r.spans, r.embeddings, strict=True)
                ],
            }
            for i, r in enumerate(results)
        ]
        return _embeddings_body(data, model_name, sum(r.token_count for r in results))

    @app.post("/v1/rerank")
    @app.post("/rerank")
    async def rerank(request: Request):
        check_key(request)
        query, documents, options = parse_rerank_request(
            await _json_body(request), rerank_model_name
        )
        return_documents = options.pop("return_documents")
        try:
            result = await client.rerank(query, documents, **options, headers=outgoing())
        except EmbeddingError as e:
            raise _backend_error(e, ("query", "documents", "instruction")) from e
        results = []
        for index, score in result.ranking:
            item = {"index": index, "relevance_score": score}
            if return_documents:
                item["document"] = {"text": documents[index]}
            results.append(item)
        return {
            "model": rerank_model_name,
            "results": results,
            "usage": {"total_tokens": result.total_tokens},
        }

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--triton-url", action="append", help="Triton gRPC address, repeatable")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--model-name", default="embed", help="model id clients send")
    p.add_argument(
        "--rerank-model-name",
        default="rerank",
        help="model id /v1/rerank clients send ('' turns /v1/rerank off)",
    )
    p.add_argument("--api-key", default=os.environ.get("QWEN_EMBED_API_KEY"))
    p.add_argument(
        "--metrics-url",
        help="Triton's metrics page: /v1/models then lists the checkpoint's prompt names",
    )
    p.add_argument(
        "--otlp-endpoint",
        default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        help="OTLP/HTTP collector base URL (/v1/traces is appended): trace every request",
    )
    args = p.parse_args()
    import uvicorn

    app = create_app(
        args.triton_url or ["localhost:8001"],
        model_name=args.model_name,
        api_key=args.api_key or None,
        rerank_model_name=args.rerank_model_name or None,
        metrics_url=args.metrics_url,
        otlp_endpoint=args.otlp_endpoint or None,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
