"""The GPU stacks `make setup-gpu` installs: prebuilt wheels only, nothing compiles.

- "torch" (the default): PyPI's torch at the version the CPU set pins (requirements.txt), one
  torch for CPU and GPU. Its Linux x86_64 wheel is the CUDA 13.0 build (NVIDIA driver 580+,
  compute capability 7.5+, Blackwell included); its varlen FlashAttention is the torch backend's
  GPU path, so no attention wheel is needed.
- "kernels": flash-attn and flashinfer beside the torch their prebuilt wheels are made for.
  flash-attn on PyPI is a source package that builds CUDA for an hour, its release wheels stop
  at older torch minors, and flashinfer's torch-specific prebuilt wheels stop at 0.2.5 (torch
  2.6, CUDA 12.4; PyPI's flashinfer-python JIT-compiles with nvcc): so this stack is torch 2.6.0
  with both, and the venv's torch is that one while it is installed.

Each stack refuses, naming what is supported, where its wheels do not exist (another Python,
another platform). `python -m qwen_embed_deploy.gpu_stack install [--stack kernels]` installs
one into the running interpreter's environment and checks it; `check` checks without a GPU (the
Docker build runs it); `doctor` fails where an NVIDIA GPU is present but CUDA does not start.

    python -m qwen_embed_deploy.gpu_stack {print,install,check,doctor} [--stack torch|kernels]
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

from qwen_embed.attention.flashinfer_limits import flashinfer_problem, version_tuple
from qwen_embed_deploy.host import gpu_present

STACKS = ("torch", "kernels")
TORCH = "2.13.0"  # = requirements.txt; PyPI's Linux x86_64 wheel of it is the CUDA 13.0 build
TORCH_PYTHONS = ((3, 10), (3, 11), (3, 12), (3, 13), (3, 14))

KERNELS_TORCH = "2.6.0"  # PyPI's Linux x86_64 wheel of 2.6.0 is the CUDA 12.4 build
KERNELS_TORCH_CUDA = "12.4"
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
    stack: str = "torch",
    python: tuple[int, int] | None = None,
    system: str | None = None,
    machine: str | None = None,
) -> list[Artefact]:
    """The pinned artefacts of `stack` for this Python and platform (defaults: the running
    ones)."""
    python = python or sys.version_info[:2]
    system, machine = system or platform.system(), machine or platform.machine()
    if stack not in STACKS:
        raise UnsupportedStack(f"no GPU stack {stack!r}; stacks: {', '.join(STACKS)}")
    if (system, machine) != ("Linux", "x86_64"):
        raise UnsupportedStack(
            f"the GPU stacks are prebuilt CUDA wheels for Linux x86_64 only, not {system} {machine}"
        )
    py = f"{python[0]}{python[1]}"
    supported = TORCH_PYTHONS if stack == "torch" else PYTHONS
    if python not in supported:
        names = ", ".join(f"{a}.{b}" for a, b in supported)
        raise UnsupportedStack(
            f"no prebuilt {stack!r} GPU stack for Python {python[0]}.{python[1]}; supported: "
            f"Python {names} (rm -rf .venv; make setup-gpu PYTHON_BOOT=python3.11)"
        )
    # `===`: exactly this version, never a local build of it such as 2.13.0+cpu, which `==`
    # accepts (PEP 440 ignores local labels): an installed CPU build would satisfy it and stay.
    if stack == "torch":
        return [Artefact("torch", f"torch==={TORCH}", f"torch-{TORCH}-cp{py}-cp{py}-{_LINUX}")]
    return [
        Artefact(
            "torch",
            f"torch==={KERNELS_TORCH}",
            f"torch-{KERNELS_TORCH}-cp{py}-cp{py}-manylinux1_x86_64.whl",
        ),
        Artefact("flash-attn", _FLASH_ATTN_WHEEL.format(v=FLASH_ATTN, py=py)),
        Artefact("flashinfer-python", _FLASHINFER_WHEEL.format(v=FLASHINFER)),
    ]


_LINUX = "manylinux_2_28_x86_64.whl"


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


def check(stack: str = "torch") -> list[str]:
    """Problems with the installed stack (empty: as pinned). Needs no GPU: torch's CUDA build
    is read from its version module and the kernels from the packages' file lists, so an image
    build can run it. The torch stack takes any CUDA build of its version (PyPI's is CUDA
    13.0; another index, such as PyTorch's CUDA 12.8 builds for older drivers, gives
    another); the kernels' wheels are CUDA 12 builds and need a CUDA 12 torch."""
    torch_pin = TORCH if stack == "torch" else KERNELS_TORCH
    problems = []
    torch_version = installed_version("torch")
    if torch_version is None or version_tuple(torch_version) != version_tuple(torch_pin):
        problems.append(f"torch is {torch_version}, the {stack!r} stack pins {torch_pin}")
    else:
        problem = torch_build_problem(
            torch_version, importlib.import_module("torch").version.cuda, stack
        )
        if problem:
            problems.append(problem)
    if stack == "torch":
        return problems
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


def torch_build_problem(version: str, cuda: str | None, stack: str) -> str | None:
    """Why an installed torch of the pinned version is not the stack's build (None: it is)."""
    if cuda is None:
        return f"torch {version} is a CPU build; the {stack!r} stack needs a CUDA build"
    major = KERNELS_TORCH_CUDA.split(".")[0]
    if stack == "kernels" and cuda.split(".")[0] != major:
        return f"torch {version} is built for CUDA {cuda}; the kernels' wheels need CUDA {major}"
    return None


def cuda_problem(gpu_here: bool, torch_cuda: str | None, init_error: str | None) -> str | None:
    """Why CUDA does not run where an NVIDIA GPU is present (None: it runs, or no GPU here)."""
    if not gpu_here:
        return None
    if torch_cuda is None:
        return "an NVIDIA GPU is present but this torch is a CPU build: run `make setup-gpu`"
    if init_error:
        return (
            f"an NVIDIA GPU is present but CUDA does not start with this torch (a CUDA "
            f"{torch_cuda} build; CUDA 13 needs driver 580+, 12.8 needs 570+): {init_error}"
        )
    return None


def doctor() -> str | None:
    """`cuda_problem` for this machine: `make test-gpu` stops on it instead of skipping every
    GPU test."""
    import torch

    error = None
    if gpu_present():
        try:
            torch.cuda.init()
        except Exception as e:  # the driver's own words: too old, no device, not loaded
            error = f"{type(e).__name__}: {e}"
    return cuda_problem(gpu_present(), torch.version.cuda, error)


def install_commands(
    stack: str, index_url: str | None, installed_torch: str | None
) -> list[list[str]]:
    """The pip commands that put `stack` in place: one install with torch pinned beside the
    kernel wheels, so no dependency can swap its build; pip's own configuration picks the
    index unless `index_url` overrides it for torch. Another index names its builds with local
    labels (2.13.0+cu128), so there the pin is `==`, which an installed CPU build would
    satisfy: that one is uninstalled first."""
    pip = [sys.executable, "-m", "pip"]
    requirements = [a.requirement for a in gpu_stack(stack)]
    if index_url is None:
        return [[*pip, "install", *requirements]]
    requirements = [r.replace("===", "==", 1) if r.startswith("torch") else r for r in requirements]
    commands = []
    if installed_torch is not None and "+cpu" in installed_torch:
        commands.append([*pip, "uninstall", "--yes", "torch"])
    index = ["--index-url", index_url]
    return [*commands, [*pip, "install", *index, *requirements]]


def install(stack: str = "torch", index_url: str | None = None) -> None:
    artefacts = gpu_stack(stack)
    if shutil.which("nvidia-smi") is None:
        print("note: no NVIDIA driver here (nvidia-smi not found); installing anyway", flush=True)
    for command in install_commands(stack, index_url, installed_version("torch")):
        subprocess.run(command, check=True)
    # A fresh interpreter: this one imported the torch that pip has just replaced.
    command = [sys.executable, "-m", "qwen_embed_deploy.gpu_stack", "check", "--stack", stack]
    if subprocess.run(command).returncode:
        raise SystemExit("GPU stack installed but not usable (above)")
    print(f"GPU stack {stack!r} ready: " + ", ".join(a.requirement for a in artefacts))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["print", "install", "check", "doctor"])
    p.add_argument("--stack", choices=STACKS, default="torch")
    p.add_argument(
        "--index-url", default=None, help="where torch comes from (install; default: pip's own)"
    )
    args = p.parse_args()
    try:
        if args.action == "print":
            print("\n".join(a.requirement for a in gpu_stack(args.stack)))
        elif args.action == "install":
            install(args.stack, args.index_url)
        elif args.action == "check":
            problems = check(args.stack)
            print("\n".join(problems) or f"GPU stack {args.stack!r} as pinned")
            raise SystemExit(1 if problems else 0)
        else:
            problem = doctor()
            print(problem or ("CUDA runs" if gpu_present() else "no NVIDIA GPU here"))
            raise SystemExit(1 if problem else 0)
    except UnsupportedStack as e:
        raise SystemExit(f"make setup-gpu: {e}") from None


if __name__ == "__main__":
    main()
