"""The packages' module-level imports form no cycle, the engine never imports the client or
the adapter and tooling beside it (qwen_embed_deploy) or anything that installs software, and
the processes beside the encoder never import torch."""

import ast
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from qwen_embed_deploy.serving.config import REPO

PACKAGES = {
    "qwen_embed": REPO / "plugins" / "qwen_embed",
    "qwen_embed_deploy": REPO / "plugins" / "qwen_embed_deploy",
    "qwen_embed_client": REPO / "client" / "qwen_embed_client",
}


def module_name(path: Path, package: str, root: Path) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_imports() -> dict[str, set[str]]:
    """project module -> every module it imports at module level (not inside functions)."""
    graph = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            name = module_name(path, package, root)
            is_package = path.name == "__init__.py"
            found = set()
            body = ast.parse(path.read_text()).body
            # `if TYPE_CHECKING:` imports count: a cycle for the type checker is one to a reader
            body += [n for node in body if isinstance(node, ast.If) for n in node.body]
            for node in body:
                if isinstance(node, ast.Import):
                    found |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom):
                    base = name if is_package else name.rpartition(".")[0]
                    for _ in range(max(node.level - 1, 0)):
                        base = base.rpartition(".")[0]
                    if node.module is None:  # `from . import x`: the submodules only
                        found |= {f"{base}.{a.name}" for a in node.names}
                        continue
                    target = f"{base}.{node.module}" if node.level else node.module
                    found.add(target)
                    found |= {f"{target}.{a.name}" for a in node.names}
            graph[name] = found
    return graph


def module_imports() -> dict[str, set[str]]:
    """module -> the project modules it imports at module level."""
    graph = all_imports()
    return {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}


def test_no_import_cycle():
    graph = module_imports()
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            assert state.get(target) != 1, " -> ".join([*path, module, target])
            if target not in state:
                visit(target, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_the_engine_imports_neither_the_client_nor_the_tooling():
    """Anywhere in a module (inside functions too): the engine is a library of its own."""
    engine = list(PACKAGES["qwen_embed"].rglob("*.py"))
    assert len(engine) > 20
    for path in engine:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            outside = [
                n for n in names if n.split(".")[0] in ("qwen_embed_client", "qwen_embed_deploy")
            ]
            assert not outside, f"{path.relative_to(REPO)} imports {outside}"


def tokenizer_model_imports() -> set[str]:
    """The modules the tokenizer models' model.py files import."""
    modules = set()
    for name in ("tokenizer", "rerank_tokenizer"):
        tree = ast.parse((REPO / "model_repository" / name / "1" / "model.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.Import):
                modules |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules.add(node.module)
    modules.discard("triton_python_backend_utils")  # the stub's own, not importable here
    assert {"qwen_embed_deploy.serving.tokenizer", "qwen_embed_deploy.serving.config"} <= modules
    return modules


@pytest.mark.parametrize(
    "process", ["tokenizer models", "qwen_embed_deploy.launcher", "qwen_embed_client.gateway"]
)
def test_the_processes_beside_the_encoder_import_no_torch(process):
    """The tokenizer models (several instances per server), the launcher and the gateway load
    the light modules only: torch would double each one's memory and its start-up time."""
    modules = sorted(tokenizer_model_imports()) if process == "tokenizer models" else [process]
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('torch' in sys.modules)"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "False"


# What FastAPI itself depends on, so the image has it with FastAPI's pin.
FASTAPI_S = {"pydantic", "pydantic_core", "starlette"}


def test_the_image_has_what_the_gateway_imports():
    """Every package the gateway's modules import (python -m qwen_embed_client.gateway, their
    imports within the project followed) is pinned in docker/requirements-gpu.txt, or is
    FastAPI's own: the image installs the client with --no-deps."""
    graph = all_imports()
    seen, third_party, todo = set(), set(), ["qwen_embed_client.gateway.__main__"]
    while todo:
        module = todo.pop()
        if module in graph and module not in seen:
            seen.add(module)
            todo += graph[module]
        elif module not in graph and module.split(".")[0] not in PACKAGES:
            third_party.add(module.split(".")[0])
    imported = third_party - set(sys.stdlib_module_names) - {"__future__"} - FASTAPI_S
    assert {"fastapi", "numpy", "orjson", "tritonclient"} <= imported, imported
    pins = (REPO / "docker" / "requirements-gpu.txt").read_text().splitlines()
    pinned = {_dist(re.split(r"[\[=<>]", line)[0]) for line in pins if line and line[0] != "#"}
    owners = metadata.packages_distributions()
    missing = sorted(m for m in imported if not {_dist(d) for d in owners.get(m, [m])} & pinned)
    assert not missing, f"imported by the gateway, absent from the image: {missing}"


def _dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
