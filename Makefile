# The verbs: setup, demo-model, test, lint, perf-engine, serve. See README.md.
PYTHON_BOOT ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
DEMO_DIR    ?= .cache/demo-model
DEMO_LAYERS ?= 3
DTYPE       ?= float32

.PHONY: setup demo-model test lint perf-engine serve clean

setup: $(VENV)/.installed $(DEMO_DIR)/config.json

# Re-run when the pins change; torch==2.13.0 resolves to the CPU wheel on these machines.
$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON_BOOT) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -r requirements.txt
	$(VENV)/bin/pip install --quiet --no-deps -e .
	touch $@

# config.json is written last, so its presence means the build finished.
$(DEMO_DIR)/config.json: $(VENV)/.installed plugins/qwen_embed/demo.py
	$(PY) -m qwen_embed.demo $(DEMO_DIR) --layers $(DEMO_LAYERS)

demo-model: $(DEMO_DIR)/config.json

lint: $(VENV)/.installed
	$(PY) -m ruff check plugins tests perf
	$(PY) -m ruff format --check plugins tests perf

test: setup lint
	$(PY) -m pytest

perf-engine: setup
	$(PY) perf/bench_engine.py --model-dir $(DEMO_DIR) --dtype $(DTYPE)

serve: setup
	@echo "make serve: the Triton model repository is not built yet (issue #3)." >&2
	@echo "Until then the engine is usable in-process: see README.md." >&2
	@exit 1

clean:
	rm -rf $(VENV) .cache .pytest_cache
