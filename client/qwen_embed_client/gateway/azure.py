"""Azure OpenAI's embeddings route, what `openai.AzureOpenAI` and LangChain's
`AzureOpenAIEmbeddings` call with the gateway as their endpoint:
POST /openai/deployments/{deployment}/embeddings?api-version=..., the key in an `api-key`
header (state.Gateway.check_key takes it), OpenAI's body and answer. The deployment is the
model: it picks one of the served models (served.ServedModels) whatever the body's `model`
says, as Azure's routing does; any `api-version` is taken.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from .openai import embeddings_response
from .state import routed

router = APIRouter(tags=["openai"])


# `path`: a served name may be a Hugging Face id, which holds a "/"
@router.post("/openai/deployments/{deployment:path}/embeddings")
async def embeddings(request: Request, deployment: str):
    return await embeddings_response(*await routed(request, model=deployment))
