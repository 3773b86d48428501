"""A model Ollama has pulled, named as Ollama names it (`ollama:qwen3-embedding:0.6b`): the GGUF
file its manifest names, read where Ollama keeps it.

Ollama's store (`OLLAMA_MODELS`, else ~/.ollama/models, else the Linux service's
/usr/share/ollama/.ollama/models) holds a manifest per model and tag,
`manifests/HOST/NAMESPACE/MODEL/TAG` (HOST registry.ollama.ai, NAMESPACE library and TAG latest
unless named), and every file as `blobs/sha256-DIGEST`; the manifest's layer of media type
`application/vnd.ollama.image.model` is the model's GGUF file, a layer of
`application/vnd.ollama.image.projector` its vision tower's (llama.cpp's mmproj file, as `ollama
create` takes one beside a model).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

PREFIX = "ollama:"
MODEL_LAYER = "application/vnd.ollama.image.model"
PROJECTOR_LAYER = "application/vnd.ollama.image.projector"
HOST, NAMESPACE, TAG = "registry.ollama.ai", "library", "latest"
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")  # a blob's name: never a path out of the store


class OllamaModelNotFoundError(FileNotFoundError):
    pass


def stores() -> list[Path]:
    """Where Ollama keeps its models, read from the environment at call time."""
    if os.environ.get("OLLAMA_MODELS"):
        return [Path(os.environ["OLLAMA_MODELS"]).expanduser()]
    return [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


def manifest_path(name: str) -> Path:
    """`[HOST/][NAMESPACE/]MODEL[:TAG]` -> its manifest's path below a store."""
    path, _, tag = name.partition(":")
    parts = path.split("/")
    if not path or len(parts) > 3 or not all(parts) or ":" in tag or "/" in tag:
        raise OllamaModelNotFoundError(
            f"{PREFIX}{name} is not an Ollama model name like {PREFIX}qwen3-embedding:0.6b"
        )
    host, namespace, model = [HOST, NAMESPACE][: 3 - len(parts)] + parts
    return Path("manifests", host, namespace, model, tag or TAG)


def client_names(name: str) -> list[str]:
    """What Ollama's clients send as `model` for the model `name`: the name as given and, with
    no tag, with Ollama's default one (`qwen3-embedding` is `qwen3-embedding:latest`)."""
    return [name] if ":" in name else [name, f"{name}:{TAG}"]


def model_files(name: str) -> tuple[Path, Path | None]:
    """The GGUF file of the pulled Ollama model `name` (without the `ollama:` prefix), and its
    vision tower's file where its manifest has one."""
    relative = manifest_path(name)
    searched = stores()
    for store in searched:
        manifest = _manifest(store, relative)
        if manifest is not None:
            break
    else:
        raise OllamaModelNotFoundError(
            f"Ollama model {name} is not in {' or '.join(map(str, searched))} (no {relative}): "
            f"pull it (ollama pull {name}) or set OLLAMA_MODELS to Ollama's store"
        )
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digests = {
            kind: [layer["digest"] for layer in layers if layer["mediaType"] == kind]
            for kind in (MODEL_LAYER, PROJECTOR_LAYER)
        }
    except (ValueError, KeyError, TypeError) as e:
        raise OllamaModelNotFoundError(f"{manifest} is not an Ollama manifest: {e!r}") from None
    for kind, most in ((MODEL_LAYER, (1,)), (PROJECTOR_LAYER, (0, 1))):
        if len(digests[kind]) not in most:
            kinds = sorted({str(lay.get("mediaType")) for lay in layers if isinstance(lay, dict)})
            raise OllamaModelNotFoundError(
                f"Ollama model {name} holds {len(digests[kind])} GGUF files ({kind} layers; "
                f"its layers: {', '.join(kinds)}): one is served"
            )
    model, *projector = (
        _blob(store, manifest, name, digest)
        for digest in digests[MODEL_LAYER] + digests[PROJECTOR_LAYER]
    )
    return model, projector[0] if projector else None


def _blob(store: Path, manifest: Path, name: str, digest: str) -> Path:
    if not _DIGEST.fullmatch(str(digest)):
        raise OllamaModelNotFoundError(f"{manifest} names its model file {digest!r}")
    blob = store / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise OllamaModelNotFoundError(f"Ollama model {name}'s file {blob} is missing")
    return blob


def _manifest(store: Path, relative: Path) -> Path | None:
    """The manifest `relative` names in `store`, its parts matched as Ollama matches names:
    whatever their case (`ollama pull dengcao/Qwen3-Reranker-0.6B:Q8_0` keeps the case it was
    given; a client may send the name in lower case)."""
    if (store / relative).is_file():
        return store / relative
    found = store
    for part in relative.parts:
        same = (
            [p for p in found.iterdir() if p.name.lower() == part.lower()] if found.is_dir() else []
        )
        if len(same) != 1:
            return None
        found = same[0]
    return found if found.is_file() else None
