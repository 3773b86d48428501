#!/usr/bin/env bash
# Build llama.cpp's llama-server twice, plus a venv for its HF -> GGUF converter, under
# .cache/peers/llama (gitignored):
#
#   perf/peers/install_llama_cpp.sh
#
#   .cache/peers/llama/build-stock/bin/llama-server     llama.cpp as released
#   .cache/peers/llama/build-patched/bin/llama-server   + llama_cpp_skip_output_head.patch
#   .cache/peers/llama/venv                             convert_hf_to_gguf.py's packages
#   .cache/peers/llama/versions.txt                     written last: the install is complete
#
# The sources come from PyPI's llama-cpp-python sdist (it vendors llama.cpp; GitHub is not
# reachable here). The patch skips qwen3's n_vocab-wide output head in embedding mode, as
# upstream's llama-embed architecture does for llama; stock computes it for every token.
# Idempotent: each finished step is kept; delete .cache/peers/llama to redo everything.
# Needs cmake and a C++ compiler (apt-get install cmake build-essential); uses ccache if there,
# which makes the second build recompile only the patched file.
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-$(nproc)}
repo=$(cd "$(dirname "$0")/../.." && pwd)
dir=$repo/.cache/peers/llama
patch_file=$repo/perf/peers/llama_cpp_skip_output_head.patch
sdist=llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION

if [[ -f $dir/versions.txt ]]; then
    echo "llama.cpp already installed:"; cat "$dir/versions.txt"; exit 0
fi
for tool in cmake c++ make patch python3; do
    command -v "$tool" >/dev/null || {
        echo "missing $tool: apt-get install -y cmake build-essential patch" >&2; exit 1
    }
done
mkdir -p "$dir/src"

# 1. Sources.
if [[ ! -d $dir/src/$sdist/vendor/llama.cpp/src ]]; then
    PIP_DISABLE_PIP_VERSION_CHECK=1 python3 -m pip download --quiet --no-deps \
        --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$dir/src"
    tar -xzf "$dir/src/$sdist.tar.gz" -C "$dir/src"
fi
vendor=$dir/src/$sdist/vendor/llama.cpp
# The sdist has no git history; its changelog names the llama.cpp commit it vendors.
commit=$(awk -v v="## [$LLAMA_CPP_PYTHON_VERSION]" '
    $0 == v { on = 1; next }
    on && /^## \[/ { exit }
    on && match($0, /ggml-org\/llama\.cpp@[0-9a-f]+/) { print substr($0, RSTART + 19, RLENGTH - 19); exit }
' "$dir/src/$sdist/CHANGELOG.md")
commit=${commit:-unknown}

# 2. Two source trees at the same relative depth (stock/llama.cpp, patched/llama.cpp) so that
# ccache, with base_dir set to each variant's folder, sees identical relative paths.
for variant in stock patched; do
    tree=$dir/$variant/llama.cpp
    if [[ ! -f $tree/.copied ]]; then
        rm -rf "$tree"
        mkdir -p "$dir/$variant"
        cp -a "$vendor" "$tree"
        # A stale gitlink from the sdist; without it git would find the project's repo above.
        rm -f "$tree/.git"
        if [[ $variant == patched ]]; then
            patch -p1 -d "$tree" < "$patch_file"
        fi
        touch "$tree/.copied"
    fi
done

# 3. Build only llama-server and llama-quantize, statically linked, for this CPU.
launcher=()
if command -v ccache >/dev/null; then
    launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
for variant in stock patched; do
    build=$dir/$variant/build
    if [[ ! -x $build/bin/llama-server || ! -x $build/bin/llama-quantize ]]; then
        cmake -S "$dir/$variant/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release \
            -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
            -DLLAMA_BUILD_COMMIT="$commit" -DLLAMA_BUILD_NUMBER=0 "${launcher[@]}" >/dev/null
        echo "building $variant llama-server and llama-quantize (log: $build/build.log)"
        CCACHE_BASEDIR=$dir/$variant CCACHE_NOHASHDIR=1 \
            cmake --build "$build" --target llama-server llama-quantize -j "$JOBS" \
                > "$build/build.log" 2>&1 \
            || { tail -n 40 "$build/build.log" >&2; exit 1; }
    fi
    ln -sfn "$variant/build" "$dir/build-$variant"
    "$build/bin/llama-server" --version
done

# 4. Converter venv: the vendored gguf-py and the converter's packages, with PyPI's CPU torch
# (its requirements pin a torch from PyTorch's own index, which is not reachable here).
venv=$dir/venv
pip=(env PIP_DISABLE_PIP_VERSION_CHECK=1 "$venv/bin/pip" install --quiet)
if [[ ! -f $venv/.installed ]]; then
    python3 -m venv "$venv"
    "${pip[@]}" --upgrade pip
    "${pip[@]}" torch==2.13.0
    "${pip[@]}" torch==2.13.0 'transformers==4.57.6' 'sentencepiece>=0.1.98,<0.3.0' \
        'numpy~=2.2.6' safetensors 'protobuf>=4.21.0,<5.0.0' "$vendor/gguf-py"
    "$venv/bin/python" -c "import gguf, torch, transformers"
    touch "$venv/.installed"
fi

{
    echo "llama.cpp commit $commit (vendored in llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION)"
    echo "patched build: $(basename "$patch_file")"
    "$venv/bin/python" - gguf torch transformers <<'EOF'
import sys
from importlib.metadata import version

print("converter: " + " ".join(f"{p}=={version(p)}" for p in sys.argv[1:]))
EOF
} > "$dir/versions.txt.tmp"
mv "$dir/versions.txt.tmp" "$dir/versions.txt"
echo "llama.cpp installed:"; cat "$dir/versions.txt"
