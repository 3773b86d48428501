"""OpenAI-compatible embeddings and Cohere/Jina-compatible rerank gateway in front of Triton.

    python -m qwen_embed_client.gateway --triton-url localhost:8001 [--triton-url ...]
        [--host 127.0.0.1] [--port 8080] [--model-name embed] [--rerank-model-name rerank]
        [--api-key KEY | $QWEN_EMBED_API_KEY] [--otlp-endpoint URL | $OTEL_EXPORTER_OTLP_ENDPOINT]

POST /v1/embeddings, POST /v1/rerank (also /rerank), GET /v1/models, GET /health. Needs the
`gateway` extra (fastapi, uvicorn, opentelemetry). An empty --rerank-model-name turns
/v1/rerank off. With an OTLP endpoint every request is traced (tracing.py). The handlers are
plain functions over one `Gateway` state object (app.state.gateway); request options are
checked by the request contract (contract.py), as the server checks them.
"""

from __future__ import annotations

import argparse
import base64
import hmac
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from .client import AsyncEmbeddingClient, EmbeddingError
from .contract import EMBEDDING_TYPES, EmbedOptions, RequestError, priority_level

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


def _contract(**options) -> dict:
    """Options checked by the request contract (what the server would refuse, refused here
    with the field named), passed on as given."""
    try:
        EmbedOptions(**{k: v for k, v in options.items() if k != "priority"})
    except RequestError as e:
        raise _invalid(str(e).replace("parameter ", "", 1), _field(e.field)) from None
    return options


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
    options = {} if body.get("dimensions") is None else {"dimensions": body["dimensions"]}
    options.update(_priority(body))
    encoding, kinds, keyed = _embedding_types(body)
    if "chunks" in body:
        if kinds != [EmbedOptions.embedding_type] or keyed:
            raise _invalid("'chunks' come as float vectors: send no embedding type", "chunks")
        options.update(_chunks(body["chunks"]))
    return texts, _contract(**options), encoding, kinds, keyed


def _chunks(value: object) -> dict:
    """The late-chunking extension: {"size": tokens} or {"spans": [[start, end], ...]} over
    each text's own tokens (the contract checks their form, the server their ranges)."""
    if isinstance(value, dict) and set(value) in ({"size"}, {"spans"}):
        key, given = next(iter(value.items()))
        return {"chunk_size" if key == "size" else "chunk_spans": given}
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
    kind = body.get("embedding_type", EmbedOptions.embedding_type)
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
    return _invalid(message, _field(param))


def _field(option: str | None) -> str | None:
    """The request body's field of a contract option: the late-chunking ones are `chunks`."""
    return "chunks" if option in ("chunk_size", "chunk_spans") else option


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


@dataclass
class Gateway:
    """What the handlers share: the Triton client and the names served."""

    client: AsyncEmbeddingClient
    model_name: str
    api_key: str | None
    tokenizer: str  # the embed ensemble's tokenizer step, whose config holds the model's facts
    rerank_model_name: str | None
    triton_rerank_model: str
    tracing: object | None  # tracing.Tracing
    created: int = field(default_factory=lambda: int(time.time()))

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(
                401, "Incorrect API key provided", "invalid_request_error", code="invalid_api_key"
            )

    def outgoing(self) -> dict | None:
        """Headers for the Triton requests: the current span's trace context."""
        return self.tracing.outgoing_headers() if self.tracing is not None else None


router = APIRouter()


def _gateway(request: Request) -> Gateway:
    gateway = request.app.state.gateway
    gateway.check_key(request)
    return gateway


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/v1/models")
async def models(request: Request):
    gw = _gateway(request)
    served = [{"id": gw.model_name}]
    facts = await gw.client.model_facts(gw.tokenizer)  # published by the tokenizer model
    if "prompt_names" in facts:
        served[0].update(
            prompt_names=facts["prompt_names"], default_prompt_name=facts["default_prompt_name"]
        )
    if gw.rerank_model_name and await gw.client.model_ready(gw.triton_rerank_model):
        served.append({"id": gw.rerank_model_name})
    return {
        "object": "list",
        "data": [
            {**entry, "object": "model", "created": gw.created, "owned_by": "qwen-embed"}
            for entry in served
        ],
    }


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    gw = _gateway(request)
    texts, options, encoding, kinds, keyed = parse_request(await _json_body(request), gw.model_name)
    if gw.tracing is not None:
        gw.tracing.set_attributes(**{"qwen_embed.inputs": len(texts)})
    if "chunk_size" in options or "chunk_spans" in options:
        return await _chunk_embeddings(gw, texts, options, encoding)
    try:  # every type from one computation of the vectors, on the server
        result = await gw.client.embed_with_usage(
            texts, **options, embedding_type=",".join(kinds), headers=gw.outgoing()
        )
    except EmbeddingError as e:
        raise _backend_error(e, ("dimensions",)) from e
    data = []
    for i in range(len(texts)):
        entry = {"object": "embedding", "index": i}
        if keyed:
            entry["embeddings"] = {k: _value(result.by_type[k][i], encoding) for k in kinds}
        else:
            entry["embedding"] = _value(result.embeddings[i], encoding)
        data.append(entry)
    return _embeddings_body(data, gw.model_name, result.total_tokens)


async def _chunk_embeddings(gw: Gateway, texts, options, encoding):
    """Late chunking: each data item lists its chunks (characters and vector)."""
    size, spans = options.pop("chunk_size", None), options.pop("chunk_spans", None)
    try:
        results = await gw.client.embed_chunks(
            texts, chunk_size=size, spans=spans, **options, headers=gw.outgoing()
        )
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
    return _embeddings_body(data, gw.model_name, sum(r.token_count for r in results))


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(request: Request):
    gw = _gateway(request)
    query, documents, options = parse_rerank_request(
        await _json_body(request), gw.rerank_model_name
    )
    return_documents = options.pop("return_documents")
    try:
        result = await gw.client.rerank(query, documents, **options, headers=gw.outgoing())
    except EmbeddingError as e:
        raise _backend_error(e, ("query", "documents", "instruction")) from e
    results = []
    for index, score in result.ranking:
        item = {"index": index, "relevance_score": score}
        if return_documents:
            item["document"] = {"text": documents[index]}
        results.append(item)
    return {
        "model": gw.rerank_model_name,
        "results": results,
        "usage": {"total_tokens": result.total_tokens},
    }


async def _api_error(_request, e: APIError):
    return JSONResponse(_error_body(e), status_code=e.status)


def create_app(
    triton_urls: list[str],
    *,
    model_name: str = "embed",
    api_key: str | None = None,
    triton_model: str = "embed",
    rerank_model_name: str | None = "rerank",
    triton_rerank_model: str = "rerank",
    otlp_endpoint: str | None = None,
) -> FastAPI:
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
    app.state.gateway = Gateway(
        client=client,
        model_name=model_name,
        api_key=api_key,
        # the renderer's naming (repository.render): embed -> tokenizer, NAME -> NAME_tokenizer
        tokenizer="tokenizer" if triton_model == "embed" else f"{triton_model}_tokenizer",
        rerank_model_name=rerank_model_name,
        triton_rerank_model=triton_rerank_model,
        tracing=tracing,
    )
    app.add_exception_handler(APIError, _api_error)
    if tracing is not None:
        app.middleware("http")(_traced(tracing))
    app.include_router(router)
    return app


def _traced(tracing):
    async def trace(request: Request, call_next):
        path = request.url.path
        if path == "/health":  # probes, not traffic
            return await call_next(request)
        with tracing.request_span(request.method, path, request.headers) as span:
            response = await call_next(request)
            span.set_attribute("http.response.status_code", response.status_code)
            return response

    return trace


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
        otlp_endpoint=args.otlp_endpoint or None,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
