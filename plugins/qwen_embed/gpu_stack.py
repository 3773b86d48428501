"""The GPU stack `make setup-gpu` installs: one pinned combination that works without compiling.

flash-attn on PyPI is a source package that builds CUDA for an hour, and PyPI's
`flashinfer-python` JIT-compiles its kernels on first use (nvcc needed). Their projects publish
prebuilt wheels per (torch, CUDA, Python); this module holds one combination in which all three
exist, and refuses, naming what is supported, where they do not (another Python, another
platform). `python -m qwen_embed.gpu_stack install` installs it into the running interpreter's
environment and then checks what was installed; `print` shows the requirement lines.

    python -m qwen_embed.gpu_stack {print,install,check}
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass

from .attention.flashinfer_limits import flashinfer_problem, version_tuple

TORCH = "2.6.0"  # PyPI's Linux x86_64 wheel of 2.6.0 is the CUDA 12.4 build
TORCH_CUDA = "12.4"
FLASH_ATTN = "2.7.4.post1"
FLASHINFER = "0.2.5"  # >= FLASHINFER_MIN: its kernels run on the tensors' device
PYTHONS = ((3, 10), (3, 11), (3, 12))  # the Pythons all three projects publish wheels for

_FLASH_ATTN_WHEEL = (
    "https://github.com/Dao-AILab/flash-attention/releases/download/v{v}/"
    "flash_attn-{v}+cu12torch2.6cxx11abiFALSE-cp{py}-cp{py}-linux_x86_64.whl"
)
_FLASHINFER_WHEEL = (
    "https://github.com/flashinfer-ai/flashinfer/releases/download/v{v}/"
    "flashinfer_python-{v}+cu124torch2.6-cp38-abi3-linux_x86_64.whl"
)


class UnsupportedStack(RuntimeError):
    """No pinned combination of prebuilt wheels exists for this interpreter or platform."""


@dataclass(frozen=True)
class Artefact:
    name: str
    requirement: str  # what pip installs: a pinned name or a wheel's URL
    pypi_file: str | None = None  # for PyPI-hosted pins: the exact file pip will pick

    @property
    def url(self) -> str | None:
        return self.requirement if "://" in self.requirement else None


def gpu_stack(
    python: tuple[int, int] | None = None, system: str | None = None, machine: str | None = None
) -> list[Artefact]:
    """The pinned artefacts for this Python and platform (defaults: the running ones)."""
    python = python or sys.version_info[:2]
    system, machine = system or platform.system(), machine or platform.machine()
    if (system, machine) != ("Linux", "x86_64"):
        raise UnsupportedStack(
            f"the GPU stack has prebuilt flash-attn/flashinfer wheels for Linux x86_64 only, "
            f"not {system} {machine}"
        )
    if python not in PYTHONS:
        supported = ", ".join(f"{a}.{b}" for a, b in PYTHONS)
        raise UnsupportedStack(
            f"no prebuilt torch {TORCH} + flash-attn {FLASH_ATTN} + flashinfer {FLASHINFER} set "
            f"for Python {python[0]}.{python[1]}; supported: Python {supported} "
            f"(rm -rf .venv; make setup-gpu PYTHON_BOOT=python3.11)"
        )
    py = f"{python[0]}{python[1]}"
    return [
        Artefact("torch", f"torch=={TORCH}", f"torch-{TORCH}-cp{py}-cp{py}-manylinux1_x86_64.whl"),
        Artefact("flash-attn", _FLASH_ATTN_WHEEL.format(v=FLASH_ATTN, py=py)),
        Artefact("flashinfer-python", _FLASHINFER_WHEEL.format(v=FLASHINFER)),
    ]


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ships_extension(distribution: str, stem: str) -> bool:
    """Whether an installed distribution carries a compiled module `stem*.so` (its prebuilt
    CUDA kernels), read from its file list: no import, so no GPU or driver needed."""
    files = importlib.metadata.files(distribution) or []
    return any(f.name.startswith(stem) and f.name.endswith(".so") for f in files)


def check() -> list[str]:
    """Problems with the installed stack (empty: as pinned). Needs no GPU: the kernels are
    looked for in the packages' file lists, so an image build can run it."""
    problems = []
    torch_version = installed_version("torch")
    if torch_version is None or version_tuple(torch_version) != version_tuple(TORCH):
        problems.append(f"torch is {torch_version}, the stack pins {TORCH}")
    else:
        cuda = importlib.import_module("torch").version.cuda
        if cuda != TORCH_CUDA:
            problems.append(f"torch {torch_version} is built for CUDA {cuda}, not {TORCH_CUDA}")
    if installed_version("flash-attn") is None:
        problems.append("flash-attn is not installed")
    elif not _ships_extension("flash-attn", "flash_attn_2_cuda"):
        problems.append("flash-attn has no compiled kernels (flash_attn_2_cuda)")
    version = installed_version("flashinfer-python")
    prebuilt = _ships_extension("flashinfer-python", "flashinfer_kernels") if version else None
    problem = flashinfer_problem(version, prebuilt)
    if problem:
        problems.append(problem)
    return problems


def install() -> None:
    artefacts = gpu_stack()
    if shutil.which("nvidia-smi") is None:
        print("note: no NVIDIA driver here (nvidia-smi not found); installing anyway", flush=True)
    # One pip call: torch pinned beside the two wheels, so no dependency can swap its build.
    subprocess.run(
        [sys.executable, "-m", "pip", "install", *(a.requirement for a in artefacts)], check=True
    )
    # A fresh interpreter: this one imported the torch that pip has just replaced.
    if subprocess.run([sys.executable, "-m", "qwen_embed.gpu_stack", "check"]).returncode:
        raise SystemExit("GPU stack installed but not usable (above)")
    print(
        f"GPU stack ready: torch {TORCH} (CUDA {TORCH_CUDA}), flash-attn {FLASH_ATTN}, "
        f"flashinfer {FLASHINFER} with prebuilt kernels"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["print", "install", "check"])
    args = p.parse_args()
    try:
        if args.action == "print":
            print("\n".join(a.requirement for a in gpu_stack()))
        elif args.action == "install":
            install()
        else:
            problems = check()
            print("\n".join(problems) or "GPU stack as pinned")
            raise SystemExit(1 if problems else 0)
    except UnsupportedStack as e:
        raise SystemExit(f"make setup-gpu: {e}") from None


if __name__ == "__main__":
    main()
