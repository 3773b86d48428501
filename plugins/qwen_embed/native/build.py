"""Builds the native kernels (csrc/) into `_build/`: `python -m qwen_embed.native.build`.
`--sanitize`: with AddressSanitizer and UBSan, for a copy of the package whose tests run with
their runtimes preloaded (`make test-native-sanitized`); any finding ends the process.

Each instruction set's copy of the kernels is compiled with its own flags, never
`-march=native`, so one build runs on any x86-64 CPU and picks its kernels at run time
(cpu_features.cpp). Where there is no compiler the build says so and the engine keeps torch's ops.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import BUILD, CSRC, LIBRARY, STAMP, sources_digest

# GCC's AVX-512 intrinsics start some results from a deliberately uninitialised register.
QUIET_INTRINSICS = ["-Wno-uninitialized", "-Wno-maybe-uninitialized"]
AVX512 = [
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mavx2",
    "-mfma",
    *QUIET_INTRINSICS,
]
AMX_SOURCES = ("kernels_amx.cpp", "gemm/tiles_amx.cpp")
ISA_FLAGS = {
    "kernels_generic.cpp": [],
    "kernels_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    "kernels_avx512.cpp": AVX512,
    "kernels_avx512bf16.cpp": [*AVX512, "-mavx512bf16"],
    "gemm/rows.cpp": AVX512,
    "gemm/panels_avx512bf16.cpp": [*AVX512, "-mavx512bf16"],
    "gemm/panels_vnni.cpp": [*AVX512, "-mavx512vnni"],
    "gemm/pairs_avx2.cpp": ["-mavx2", "-mfma"],
    "gemm/floats_avx2.cpp": ["-mavx2", "-mfma"],
    "kernels_amx.cpp": [
        *AVX512,
        "-mavx512bf16",
        "-mamx-tile",
        "-mamx-bf16",
    ],
    "gemm/tiles_amx.cpp": [*AVX512, "-mamx-tile", "-mamx-int8", "-mamx-bf16"],  # rows.cpp's + tiles
}
# The operators over the kernels, compiled with torch's headers and OpenMP.
OPERATOR_SOURCES = (
    "cpu_features.cpp",
    "row_ops.cpp",
    "delta_rule_ops.cpp",
    "attention_ops.cpp",
    "gemm/ops.cpp",
    "bindings.cpp",
)
COMMON = [
    "-fPIC",
    "-std=c++20",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-Wall",
    "-Wno-psabi",
]
SANITIZERS = "-fsanitize=address,undefined"
# With --sanitize, in place of -O3: every finding fatal, frames kept for the reports.
SANITIZE = ["-O1", "-g", "-fno-omit-frame-pointer", SANITIZERS, "-fno-sanitize-recover=all"]


def _torch_flags() -> tuple[list[str], list[str]]:
    import torch
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # at::parallel_for is OpenMP code compiled into the operators; torch ships the libgomp it uses.
    compile_flags = [
        "-fopenmp",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in include_paths()),
    ]
    libs = library_paths()
    link_flags = [*(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs)]
    return compile_flags, [*link_flags, "-fopenmp", "-lc10", "-ltorch_cpu", "-ltorch"]


def build(compiler: str | None = None, sanitize: bool = False) -> Path:
    compiler = compiler or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler on PATH (install g++)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    if "clang" in version.lower():  # the kernels' vector shuffles are GCC builtins
        raise RuntimeError(
            f"{compiler} is clang; the kernels use GCC's vector extensions: install g++"
        )
    torch_compile, torch_link = _torch_flags()
    common = [*(SANITIZE if sanitize else ["-O3"]), *COMMON]
    shared = ["-shared", SANITIZERS] if sanitize else ["-shared"]
    BUILD.mkdir(exist_ok=True)

    def compile_one(name: str, flags: list[str]) -> Path | None:
        obj = BUILD / (name.removesuffix(".cpp").replace("/", "_") + ".o")
        cmd = [compiler, *common, *flags, "-c", str(CSRC / name), "-o", str(obj)]
        return obj if subprocess.run(cmd).returncode == 0 else None

    with ThreadPoolExecutor() as pool:
        built = dict(
            zip(ISA_FLAGS, pool.map(compile_one, ISA_FLAGS, ISA_FLAGS.values()), strict=True)
        )
    amx = [source for source in AMX_SOURCES if source in built]  # an older tree may lack one
    if None in (built[source] for source in amx):  # a compiler without AMX: the rest still runs
        print("AMX kernels not built (this compiler lacks -mamx-tile)", file=sys.stderr)
        for source in amx:
            del built[source]
        torch_compile = [*torch_compile, "-DQE_NO_AMX"]
    with ThreadPoolExecutor() as pool:
        operators = list(
            pool.map(compile_one, OPERATOR_SOURCES, [torch_compile] * len(OPERATOR_SOURCES))
        )
    objects = [*operators, *built.values()]
    if None in objects:
        raise RuntimeError("the kernels did not compile (see the compiler's messages above)")
    subprocess.run(
        [compiler, *shared, *map(str, objects), "-o", str(LIBRARY), *torch_link], check=True
    )
    STAMP.write_text(sources_digest())
    return LIBRARY


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sanitize", action="store_true", help="with AddressSanitizer and UBSan")
    sanitize = p.parse_args().sanitize
    try:
        print(f"built {build(sanitize=sanitize)}")
    except (RuntimeError, subprocess.CalledProcessError) as e:
        if sanitize:  # nothing to test without them
            raise
        print(f"native kernels not built ({e}); the engine uses torch's ops", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
