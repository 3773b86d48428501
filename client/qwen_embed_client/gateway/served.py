"""The models one gateway serves, and which of them answers a request.

Each Triton ensemble is served under the names clients send as `model`. The first embedder
and the first reranker answer requests that name none; a request naming another model, or one
of its LoRA adapters, is answered by a Gateway of its own (state.Gateway: that model's client
and names), so every handler serves one model as it always has.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace

from .common import model_adapters, unknown_model
from .state import Gateway


@dataclass(frozen=True)
class Served:
    """A Triton ensemble and the names clients send for it (the first is the one answers
    give)."""

    triton_model: str
    names: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Served:
        """'ENSEMBLE' (served under its own name) or 'ENSEMBLE=NAME[,ALIAS...]'."""
        triton_model, _, names = text.partition("=")
        served = tuple(n.strip() for n in names.split(",") if n.strip()) or (triton_model,)
        if not triton_model:
            raise ValueError(f"{text!r}: no Triton model named (ENSEMBLE[=NAME,...])")
        return cls(triton_model, served)


class ServedModels:
    """One Gateway per model: `default`, the first embedder's with the first reranker's, and
    one for each other embedder (beside the first reranker) and each other reranker (beside
    the first embedder). `make_client(embed ensemble, rerank ensemble)` makes each one's
    Triton client."""

    def __init__(
        self,
        default: Gateway,
        make_client: Callable,
        embedders: tuple[Served, ...] = (),
        rerankers: tuple[Served, ...] = (),
    ):
        embed_model, rerank_model = default.client.model, default.triton_rerank_model
        self.default = default
        self.embedders = [default] + [
            replace(default, client=make_client(e.triton_model, rerank_model), model_names=e.names)
            for e in embedders
        ]
        self.rerankers = [default] + [
            replace(
                default,
                client=make_client(embed_model, r.triton_model),
                rerank_model_names=r.names,
                triton_rerank_model=r.triton_model,
            )
            for r in rerankers
        ]
        self._one_each = not (embedders or rerankers)  # the default serves everything
        self._by_name: dict[str, Gateway] = {}
        for gw, names in [
            *((gw, gw.model_names) for gw in self.embedders),
            *((gw, gw.rerank_model_names) for gw in self.rerankers),
        ]:
            for name in names:  # the default's embedder and reranker may share a name
                if self._by_name.setdefault(name, gw) is not gw:
                    raise ValueError(f"the served name {name!r} is given to two models")

    def ensembles(self) -> dict[str, tuple[str, ...]]:
        """Each served name's Triton ensembles (the first embedder's and reranker's may share
        a name: two)."""
        out: dict[str, tuple[str, ...]] = {}
        for gw in self.embedders:
            for name in gw.model_names:
                out[name] = (*out.get(name, ()), gw.client.model)
        for gw in self.rerankers:
            for name in gw.rerank_model_names:
                out[name] = (*out.get(name, ()), gw.triton_rerank_model)
        return {name: tuple(dict.fromkeys(ensembles)) for name, ensembles in out.items()}

    async def pick(self, body: object) -> Gateway:
        """The Gateway of the model a request body's `model` names: a served name's, else the
        model's among whose LoRA adapters it is; a body naming none, the default's. A name
        nobody serves is refused here, naming every model (a gateway of one model leaves that
        to its handlers)."""
        model = body.get("model") if isinstance(body, dict) else None
        if self._one_each or not isinstance(model, str):
            return self.default  # its handlers check the name
        if model in self._by_name:
            return self._by_name[model]
        models = [(gw, gw.model_names, None) for gw in self.embedders]
        models += [(gw, gw.rerank_model_names, gw.triton_rerank_model) for gw in self.rerankers]
        adapters = await asyncio.gather(
            *(model_adapters(gw, model, names, triton) for gw, names, triton in models)
        )
        for (gw, _, _), held in zip(models, adapters, strict=True):
            if model in held:
                return gw
        raise unknown_model(model, tuple(self._by_name))

    async def close(self) -> None:
        """Every model's Triton client (the default's too)."""
        clients = {id(gw.client): gw.client for gw in (*self.embedders, *self.rerankers)}
        for client in clients.values():
            await client.close()
