"""The pinned GPU stack (make setup-gpu, the Docker image): one combination of prebuilt wheels,
refusals where it does not exist, flashinfer's version and kernel checks, and every pinned file
present on its index (skipped where that index cannot be reached from here)."""

import functools
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from qwen_embed.attention.flashinfer_limits import flashinfer_problem
from qwen_embed_deploy import gpu_stack
from qwen_embed_deploy.gpu_stack import PYTHONS, UnsupportedStack
from qwen_embed_deploy.host import gpu_count, gpu_present

DOCKER_PINS = Path(__file__).parents[1] / "docker" / "requirements-gpu.txt"


REPO = Path(__file__).parents[1]


def test_the_default_stack_is_the_cpu_sets_torch():
    """One torch for CPU and GPU: the default stack is requirements.txt's torch, taken from
    PyPI (whose Linux x86_64 wheel is the CUDA build), and nothing else."""
    pins = (REPO / "requirements.txt").read_text().splitlines()
    assert f"torch=={gpu_stack.TORCH}" in pins
    for python in gpu_stack.TORCH_PYTHONS:
        (torch,) = gpu_stack.gpu_stack("torch", python, "Linux", "x86_64")
        py = f"cp{python[0]}{python[1]}"
        assert (
            torch.requirement == f"torch==={gpu_stack.TORCH}" and f"-{py}-{py}-" in torch.pypi_file
        )


@pytest.mark.parametrize("python", PYTHONS)
def test_kernels_stack_one_combination_per_python(python):
    torch, flash_attn, flashinfer = gpu_stack.gpu_stack("kernels", python, "Linux", "x86_64")
    py = f"cp{python[0]}{python[1]}"
    assert torch.requirement == f"torch==={gpu_stack.KERNELS_TORCH}" and py in torch.pypi_file
    # flash-attn's wheel is built for this torch minor, CUDA 12 and this Python's ABI tag;
    # flashinfer's for the same torch and torch's CUDA (12.4), abi3 (any Python >= 3.8).
    torch_minor = ".".join(gpu_stack.KERNELS_TORCH.split(".")[:2])
    assert f"+cu12torch{torch_minor}cxx11abiFALSE-{py}-{py}-linux_x86_64.whl" in flash_attn.url
    cuda = gpu_stack.KERNELS_TORCH_CUDA.replace(".", "")
    assert f"-{gpu_stack.FLASHINFER}+cu{cuda}torch{torch_minor}-cp38-abi3" in flashinfer.url
    assert flashinfer_problem(gpu_stack.FLASHINFER, True) is None


@pytest.mark.parametrize(
    "stack, python, system, machine, message",
    [
        ("kernels", (3, 13), "Linux", "x86_64", "Python 3.13; supported: Python 3.10, 3.11, 3.12"),
        ("kernels", (3, 9), "Linux", "x86_64", "for Python 3.9"),
        ("torch", (3, 9), "Linux", "x86_64", "supported: Python 3.10, 3.11, 3.12, 3.13, 3.14"),
        ("torch", (3, 11), "Linux", "aarch64", "Linux x86_64 only, not Linux aarch64"),
        ("kernels", (3, 11), "Darwin", "arm64", "not Darwin arm64"),
        ("vllm", (3, 11), "Linux", "x86_64", "no GPU stack 'vllm'"),
    ],
)
def test_refuses_where_no_prebuilt_set_exists(stack, python, system, machine, message):
    with pytest.raises(UnsupportedStack, match=re.escape(message)):
        gpu_stack.gpu_stack(stack, python, system, machine)


def test_flashinfer_versions_and_kernels():
    assert "not installed" in flashinfer_problem(None, None)
    for old in ("0.2.0.post2", "0.2.3", "0.1.6"):  # no device guard before 0.2.4
        assert "current CUDA device" in flashinfer_problem(old, True)
    assert flashinfer_problem("0.2.4", True) is None
    assert flashinfer_problem("0.2.5+cu124torch2.6", True) is None
    assert "no prebuilt kernels" in flashinfer_problem("0.2.5", False)  # PyPI's JIT source build
    assert flashinfer_problem("0.6.1", None) is None  # newer: kernels from its cubin packages


def test_check_reports_this_environment():
    # make setup's venv has the CPU torch, make setup-gpu's the CUDA build (whether or not a GPU
    # is here); neither has the kernel packages: check() must say so, not pass.
    import torch

    problems = "\n".join(gpu_stack.check("torch"))
    if torch.version.cuda is None:
        assert f"torch {gpu_stack.TORCH}" in problems and "is a CPU build" in problems
    else:
        assert problems == ""
    problems = "\n".join(gpu_stack.check("kernels"))
    assert f"the 'kernels' stack pins {gpu_stack.KERNELS_TORCH}" in problems
    assert "flash-attn is not installed" in problems and "flashinfer is not installed" in problems


def test_any_cuda_build_of_the_pinned_torch_passes_the_torch_stack():
    """PyTorch's CUDA 12.8 build (TORCH_INDEX_URL, for 570 drivers) is as good as PyPI's 13.0;
    the kernels' wheels are CUDA 12 builds."""
    problem = gpu_stack.torch_build_problem
    assert problem("2.13.0+cu128", "12.8", "torch") is None
    assert problem("2.13.0", "13.0", "torch") is None
    assert "CPU build" in problem("2.13.0+cpu", None, "torch")
    assert problem("2.6.0", "12.4", "kernels") is None
    assert "need CUDA 12" in problem("2.6.0+cu130", "13.0", "kernels")


def test_install_replaces_a_cpu_build_of_the_same_version():
    """torch==2.13.0 is satisfied by an installed 2.13.0+cpu (PEP 440 ignores local labels),
    so the install would keep it: from pip's own index the pin is ===, from another index the
    CPU build is uninstalled first. No index is written here: pip's configuration decides."""
    (only,) = gpu_stack.install_commands("torch", None, "2.13.0+cpu")
    assert only[-2:] == ["install", f"torch==={gpu_stack.TORCH}"]
    assert not any(a.startswith("--index") for a in only)
    index = "file:///somewhere/cu128"  # PyTorch's CUDA 12.8 index, say
    uninstall, install = gpu_stack.install_commands("torch", index, "2.13.0+cpu")
    assert uninstall[-3:] == ["uninstall", "--yes", "torch"]
    assert install[-3:] == ["--index-url", index, f"torch=={gpu_stack.TORCH}"]
    (install,) = gpu_stack.install_commands("torch", index, "2.13.0+cu128")  # already a CUDA one
    assert "uninstall" not in install
    kernels = gpu_stack.install_commands("kernels", None, None)[0]
    assert f"torch==={gpu_stack.KERNELS_TORCH}" in kernels and len(kernels) == 7


@pytest.mark.server  # the doctor in a child process: seconds
def test_doctor_fails_where_a_gpu_cannot_run_cuda():
    """make test-gpu stops here rather than skipping every GPU test."""
    assert gpu_stack.cuda_problem(False, None, None) is None  # no GPU: the tests skip
    assert gpu_stack.cuda_problem(True, "13.0", None) is None
    assert "CPU build" in gpu_stack.cuda_problem(True, None, None)
    too_old = "The NVIDIA driver on your system is too old (found version 12040)"
    problem = gpu_stack.cuda_problem(True, "13.0", too_old)
    assert "CUDA 13.0 build" in problem and "580+" in problem and too_old in problem
    if gpu_present():
        return  # the suite hides the GPUs it does not test (conftest.py): CUDA cannot start
    # A CPU machine: no NVIDIA device nodes, so nothing to stop on.
    assert gpu_stack.doctor() is None
    run = subprocess.run(
        [sys.executable, "-m", "qwen_embed_deploy.gpu_stack", "doctor"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0 and "no NVIDIA GPU here" in run.stdout


def test_gpu_count_from_device_nodes(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_count(tmp_path, None) == 0 and not gpu_present(tmp_path)
    for name in ("nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1", "nvidia2"):
        (tmp_path / name).touch()
    assert gpu_present(tmp_path)
    assert gpu_count(tmp_path, visible=None) == 3
    assert gpu_count(tmp_path, visible="1") == 1
    assert gpu_count(tmp_path, visible="0,2") == 2
    assert gpu_count(tmp_path, visible="") == 0 and gpu_count(tmp_path, visible="-1") == 0


def _make_rules() -> dict[str, str]:
    """Each Makefile target's prerequisites, from make's own database."""
    run = subprocess.run(
        ["make", "-p", "-n", "-q", "-f", "Makefile", "no-such-target-just-the-database"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    rules = {}
    for line in run.stdout.splitlines():
        target, sep, prerequisites = line.partition(":")
        if sep and not target.startswith(("#", "\t", " ")) and "=" not in target:
            rules.setdefault(target.strip(), prerequisites.strip())
    return rules


def test_gpu_targets_depend_on_the_gpu_install():
    rules = _make_rules()
    assert "setup-gpu" in rules["test-gpu"].split()
    assert "setup-gpu" in rules["perf-gpu"].split()
    assert "setup-gpu" in rules["gpu-report"].split()
    assert ".venv/.installed" in rules[".venv/.installed-gpu"].split()
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile[makefile.index("$(VENV)/.installed: requirements.txt") :]
    recipe = recipe[: recipe.index("\n\n")]
    # A re-run of the CPU install keeps a GPU stack's torch (and the triton it pins) and checks
    # that stack afterwards.
    assert "if [ -f $(VENV)/.installed-gpu ]" in recipe
    assert "grep -v -E '^(torch|triton)[=<> ]'" in recipe
    assert "gpu_stack check --stack $$(cat $(VENV)/.installed-gpu)" in recipe
    test_gpu = makefile[makefile.index("test-gpu: setup-gpu") :].split("\n\n")[0]
    assert test_gpu.index("gpu_stack doctor") < test_gpu.index("pytest -m gpu")


def test_docker_image_pins_the_default_stack():
    # The image is NVIDIA's Triton image with Python 3.10: its torch line is this stack's.
    lines = {line.strip() for line in DOCKER_PINS.read_text().splitlines()}
    for artefact in gpu_stack.gpu_stack("torch", (3, 10), "Linux", "x86_64"):
        assert artefact.requirement in lines, artefact.name


@functools.cache
def _pip_index() -> str:
    """The index pip is configured with (pip's own default where nothing is set)."""
    run = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
        capture_output=True,
        text=True,
    )
    if run.returncode == 0 and run.stdout.strip():
        return run.stdout.strip().rstrip("/")
    from pip._internal.models.index import PyPI

    return PyPI.simple_url.rstrip("/")


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


@pytest.mark.parametrize(
    "stack, python, name",
    [("torch", p, "torch") for p in gpu_stack.TORCH_PYTHONS]
    + [("kernels", p, n) for p in PYTHONS for n in ("torch", "flash-attn", "flashinfer-python")],
)
def test_pinned_file_exists(stack, python, name):
    """The exact file pip will fetch, looked up on its index (the simple page of the index pip
    is configured with, or the wheel's own URL); only GitHub-hosted wheels are unreachable
    from the CI machines."""
    artefact = {a.name: a for a in gpu_stack.gpu_stack(stack, python, "Linux", "x86_64")}[name]
    if artefact.url:
        assert _exists(artefact.url), artefact.url
        return
    page = f"{_pip_index()}/{name}/"
    listing = _listing(page)
    if listing is None:
        pytest.skip(f"index unreachable from here: {page}")
    assert artefact.pypi_file in listing, artefact.pypi_file


@functools.cache
def _listing(page: str) -> str | None:
    """A project's simple page, fetched once for every pinned file of that project."""
    try:
        with urllib.request.urlopen(page, timeout=20) as response:
            return response.read().decode()
    except (urllib.error.URLError, TimeoutError, OSError):
        return None
