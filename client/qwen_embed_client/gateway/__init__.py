"""The HTTP gateway in front of Triton: the APIs retrieval stacks already speak, over one
request contract (contract.py) and one Triton request per API request.

- OpenAI (openai.py): POST /v1/embeddings (texts or token ids), GET /v1/models, and the
  Jina/Cohere v1 rerank shape on POST /v1/rerank and /rerank.
- Hugging Face TEI (tei.py): POST / and /embed, /rerank with `texts`, /tokenize, /decode,
  GET /info, with TEI's error body.
- Cohere v2 (cohere.py): POST /v2/embed, /v2/rerank.

Each API renders errors in its own shape from one APIError (errors.py). GET /metrics: the
gateway's own request counts, durations and tokens per model and key (metrics.py);
--access-log, a JSON line per request (access_log.py); --api-key and --api-keys-file, who may
call it, and each named key's models, limits and priority (keys.py). Embedding responses
carry the model fingerprint (header x-model-fingerprint) and, per text, the tokens used and
whether the text was cut (docs/api.md). Needs the `gateway` extra (fastapi, uvicorn,
opentelemetry, prometheus-client). Run: python -m qwen_embed_client.gateway (app.py lists
the options).
"""

from .app import Gateway, create_app, main

__all__ = ["Gateway", "create_app", "main"]
