"""The "naive padded server": transformers' Qwen model behind an OpenAI-style endpoint.

    python naive_server.py MODEL_DIR --port 8000 [--dtype float32]

What an engineer writes first: each request's texts become one padded batch, one forward at a
time (concurrent forwards would only fight over the same cores), last-token pooling, L2
normalisation. Runs in its own virtualenv (perf/peers/install.sh naive); nothing from this
project is imported.
"""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from transformers import AutoTokenizer, Qwen2Model, Qwen3Model


class EmbeddingRequest(BaseModel):
    input: str | list[str]
    model: str = "embed"


def last_token(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The hidden state of each row's last real token, for left or right padding."""
    if bool(mask[:, -1].all()):  # left padding (or none): the last column is real everywhere
        return hidden[:, -1]
    last = mask.sum(dim=1) - 1
    return hidden[torch.arange(hidden.shape[0]), last]


def build_app(model_dir: str, dtype: str) -> FastAPI:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    qwen3 = config.get("model_type") == "qwen3"
    model_cls = Qwen3Model if qwen3 else Qwen2Model
    model = model_cls.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lock = threading.Lock()
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/embeddings")
    def embeddings(request: EmbeddingRequest) -> dict:
        texts = [request.input] if isinstance(request.input, str) else request.input
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        with lock, torch.inference_mode():
            hidden = model(**batch).last_hidden_state
            vectors = torch.nn.functional.normalize(
                last_token(hidden, batch["attention_mask"]).float(), dim=-1
            )
        tokens = int(batch["attention_mask"].sum())
        return {
            "object": "list",
            "model": request.model,
            "data": [
                {"object": "embedding", "index": i, "embedding": v}
                for i, v in enumerate(vectors.tolist())
            ],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    uvicorn.run(
        build_app(args.model_dir, args.dtype), host=args.host, port=args.port, log_level="warning"
    )


if __name__ == "__main__":
    main()
