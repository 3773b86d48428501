#!/usr/bin/env bash
# perf_analyzer 2.51 without root and without Docker, into .cache/perf_analyzer (idempotent):
#   - bin/perf_analyzer out of the tritonclient==2.51.0 wheel (newer perf-analyzer wheels need
#     glibc 2.38; the project's own tritonclient stays the latest one, see DESIGN.md),
#   - libb64.so.0d from Debian's libb64-0d, unpacked rather than installed (no root needed),
#   - libcudart.so.12 from PyPI's nvidia-cuda-runtime-cu12 (perf_analyzer links it even on CPU),
#   - a wrapper script that puts both on LD_LIBRARY_PATH.
# Usage: perf/perf_analyzer/install.sh [PYTHON]   (PYTHON defaults to .venv/bin/python, else python3)
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
dest="$repo/.cache/perf_analyzer"
wrapper="$dest/perf_analyzer"
python=${1:-$repo/.venv/bin/python}
[ -x "$python" ] || python=python3

if [ -x "$wrapper" ] && "$wrapper" --version >/dev/null 2>&1; then
    echo "perf_analyzer ready: $wrapper"
    exit 0
fi

mkdir -p "$dest/bin" "$dest/lib"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The binary alone: --no-deps, and only bin/perf_analyzer is extracted from the wheel.
if [ ! -x "$dest/bin/perf_analyzer" ]; then
    "$python" -m pip download --quiet --no-deps tritonclient==2.51.0 \
        --only-binary=:all: --platform manylinux1_x86_64 -d "$tmp/tc"
    "$python" - "$tmp/tc" "$dest/bin" <<'PY'
import sys, zipfile, pathlib
src, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(wheel,) = src.glob("tritonclient-2.51.0-*.whl")
with zipfile.ZipFile(wheel) as zf:
    (name,) = [n for n in zf.namelist() if n.endswith("/bin/perf_analyzer")]
    (out / "perf_analyzer").write_bytes(zf.read(name))
(out / "perf_analyzer").chmod(0o755)
PY
fi

# libb64: `apt-get download` needs no root; dpkg-deb -x unpacks without installing.
if ! ls "$dest"/lib/libb64.so.0d* >/dev/null 2>&1; then
    if ! (cd "$tmp" && apt-get download libb64-0d >/dev/null 2>&1); then
        # The package lists may never have been fetched on a fresh machine (needs root).
        apt-get update -qq && (cd "$tmp" && apt-get download libb64-0d)
    fi
    dpkg-deb -x "$tmp"/libb64-0d_*.deb "$tmp/b64"
    cp -a "$tmp"/b64/usr/lib/*/libb64.so.0d* "$dest/lib/"
fi

# libcudart.so.12 from the PyPI wheel, extracted (not installed into any environment).
if [ ! -e "$dest/lib/libcudart.so.12" ]; then
    "$python" -m pip download --quiet --no-deps "nvidia-cuda-runtime-cu12>=12,<13" \
        --only-binary=:all: --platform manylinux2014_x86_64 -d "$tmp/cuda"
    "$python" - "$tmp/cuda" "$dest/lib" <<'PY'
import sys, zipfile, pathlib
src, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(wheel,) = src.glob("nvidia_cuda_runtime_cu12-*.whl")
with zipfile.ZipFile(wheel) as zf:
    (name,) = [n for n in zf.namelist() if n.endswith("/lib/libcudart.so.12")]
    (out / "libcudart.so.12").write_bytes(zf.read(name))
PY
fi

# The wrapper finds its files relative to itself, so the cache can move (e.g. to another host).
cat >"$wrapper.tmp" <<'SH'
#!/bin/sh
# Written by perf/perf_analyzer/install.sh: perf_analyzer 2.51 with its libraries.
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/bin/perf_analyzer" "$@"
SH
chmod +x "$wrapper.tmp"
mv "$wrapper.tmp" "$wrapper"
"$wrapper" --version >/dev/null 2>&1 || { "$wrapper" --help | head -5; exit 1; }
echo "perf_analyzer ready: $wrapper"
