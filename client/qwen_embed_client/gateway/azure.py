"""Azure OpenAI's embeddings route, what `openai.AzureOpenAI` and LangChain's
`AzureOpenAIEmbeddings` call with the gateway as their endpoint:
POST /openai/deployments/{deployment}/embeddings?api-version=..., the key in an `api-key`
header (keys.KeyRing takes it), OpenAI's body and answer. The deployment is the
model: it picks one of the served models (served.ServedModels) whatever the body's `model`
says, as Azure's routing does; any `api-version` is taken.

Azure's v1 API (its clients' base URL `{endpoint}/openai/v1`, the plain `openai.OpenAI`'s
too): OpenAI's own routes answer under /openai as they do at the root (V1_ROUTERS, mounted by
app.py): /openai/v1/embeddings, /openai/v1/models, the Batch API's files and batches.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from . import batches, openai
from .state import routed

router = APIRouter(tags=["openai"])

V1_PREFIX = "/openai"
V1_ROUTERS = (openai.router, batches.router)


# `path`: a served name may be a Hugging Face id, which holds a "/"
@router.post("/openai/deployments/{deployment:path}/embeddings")
async def embeddings(request: Request, deployment: str):
    return await openai.embeddings_response(*await routed(request, model=deployment))
