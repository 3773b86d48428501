"""The pinned GPU stack (make setup-gpu, the Docker image): one combination of prebuilt wheels,
refusals where it does not exist, flashinfer's version and kernel checks, and every pinned file
present on its index (skipped where that index cannot be reached from here)."""

import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from qwen_embed import gpu_stack
from qwen_embed.attention.flashinfer_limits import flashinfer_problem
from qwen_embed.gpu_stack import PYTHONS, UnsupportedStack

DOCKER_PINS = Path(__file__).parents[1] / "docker" / "requirements-gpu.txt"


@pytest.mark.parametrize("python", PYTHONS)
def test_one_combination_per_python(python):
    torch, flash_attn, flashinfer = gpu_stack.gpu_stack(python, "Linux", "x86_64")
    py = f"cp{python[0]}{python[1]}"
    assert torch.requirement == f"torch=={gpu_stack.TORCH}" and py in torch.pypi_file
    # flash-attn's wheel is built for this torch minor, CUDA 12 and this Python's ABI tag;
    # flashinfer's for the same torch and torch's CUDA (12.4), abi3 (any Python >= 3.8).
    torch_minor = ".".join(gpu_stack.TORCH.split(".")[:2])
    assert f"+cu12torch{torch_minor}cxx11abiFALSE-{py}-{py}-linux_x86_64.whl" in flash_attn.url
    cuda = gpu_stack.TORCH_CUDA.replace(".", "")
    assert f"-{gpu_stack.FLASHINFER}+cu{cuda}torch{torch_minor}-cp38-abi3" in flashinfer.url
    assert flashinfer_problem(gpu_stack.FLASHINFER, True) is None


@pytest.mark.parametrize(
    "python, system, machine, message",
    [
        ((3, 13), "Linux", "x86_64", "for Python 3.13; supported: Python 3.10, 3.11, 3.12"),
        ((3, 9), "Linux", "x86_64", "for Python 3.9"),
        ((3, 11), "Linux", "aarch64", "Linux x86_64 only, not Linux aarch64"),
        ((3, 11), "Darwin", "arm64", "not Darwin arm64"),
    ],
)
def test_refuses_where_no_prebuilt_set_exists(python, system, machine, message):
    with pytest.raises(UnsupportedStack, match=re.escape(message)):
        gpu_stack.gpu_stack(python, system, machine)


def test_flashinfer_versions_and_kernels():
    assert "not installed" in flashinfer_problem(None, None)
    for old in ("0.2.0.post2", "0.2.3", "0.1.6"):  # no device guard before 0.2.4
        assert "current CUDA device" in flashinfer_problem(old, True)
    assert flashinfer_problem("0.2.4", True) is None
    assert flashinfer_problem("0.2.5+cu124torch2.6", True) is None
    assert "no prebuilt kernels" in flashinfer_problem("0.2.5", False)  # PyPI's JIT source build
    assert flashinfer_problem("0.6.1", None) is None  # newer: kernels from its cubin packages


def test_check_reports_this_cpu_environment():
    # This venv has the CPU torch and neither kernel package: check() must say so, not pass.
    problems = "\n".join(gpu_stack.check())
    assert f"the stack pins {gpu_stack.TORCH}" in problems
    assert "flash-attn is not installed" in problems and "flashinfer is not installed" in problems


def test_docker_image_pins_the_same_stack():
    # The image is NVIDIA's Triton image with Python 3.10: its lines are this stack's for 3.10.
    lines = {line.strip() for line in DOCKER_PINS.read_text().splitlines()}
    for artefact in gpu_stack.gpu_stack((3, 10), "Linux", "x86_64"):
        assert artefact.requirement in lines, artefact.name


def _exists(url: str) -> bool:
    request = urllib.request.Request(url, method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status == 200
    except urllib.error.HTTPError as e:
        if e.code in (403, 404, 410):
            return False
        pytest.skip(f"{url}: HTTP {e.code}")
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        pytest.skip(f"index unreachable from here: {url} ({e})")


@pytest.mark.parametrize("python", PYTHONS)
@pytest.mark.parametrize("name", ["torch", "flash-attn", "flashinfer-python"])
def test_pinned_file_exists(python, name):
    """The exact file pip will fetch, looked up on its index (PyPI's simple page, or the
    wheel's own URL); only GitHub-hosted wheels are unreachable from the CI machines."""
    artefact = {a.name: a for a in gpu_stack.gpu_stack(python, "Linux", "x86_64")}[name]
    if artefact.url:
        assert _exists(artefact.url), artefact.url
        return
    page = f"https://pypi.org/simple/{name}/"
    try:
        with urllib.request.urlopen(page, timeout=20) as response:
            listing = response.read().decode()
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        pytest.skip(f"index unreachable from here: {page} ({e})")
    assert artefact.pypi_file in listing, artefact.pypi_file
