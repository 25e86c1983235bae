# accel developer commands. `make demo` sets up a fresh machine and runs the demo on 2 CPU processes;
# `make test` runs the whole test suite (what CI runs).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
PLUGINS := $(sort $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml)))

.PHONY: setup demo test test-fast clean setup-ipex test-ipex

setup: $(VENV)/.installed

$(VENV)/.installed: kernel/pyproject.toml $(wildcard plugins/*/pyproject.toml) requirements-dev.txt Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)          # first: never let pip pick a (CUDA) torch
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q --no-build-isolation -e kernel $(foreach p,$(PLUGINS),-e $(p))
	touch $@

demo: setup
	$(BIN)/accel launch --num_processes 2 examples/train_digits.py

test: setup
	$(BIN)/python -m pytest tests

test-fast: setup
	$(BIN)/python -m pytest tests -m "not slow"

clean:
	rm -rf $(VENV) build dist .pytest_cache

# accel-plugin-ipex is tested in its own venv: intel-extension-for-pytorch 2.8.0 (its last release) only loads with
# torch 2.8.*, and the only torch 2.8.0 on PyPI is the CUDA build (~7 GB, ~1.5 min). Both are installed in one pip
# command (IPEX's metadata does not pin torch). The stamp is rebuilt when the versions in the venv are not these.
IPEX_VENV ?= .venv-ipex
IPEX_BIN := $(IPEX_VENV)/bin
IPEX_TORCH ?= torch==2.8.0
IPEX_PKG ?= intel-extension-for-pytorch==2.8.0
IPEX_CHECK := import importlib.metadata as m, sys; sys.exit(not (m.version('torch').startswith('2.8.') and m.version('intel-extension-for-pytorch').startswith('2.8.')))

setup-ipex:
	@test -x $(IPEX_BIN)/python && $(IPEX_BIN)/python -c "$(IPEX_CHECK)" 2>/dev/null || rm -f $(IPEX_VENV)/.installed
	@$(MAKE) --no-print-directory $(IPEX_VENV)/.installed

$(IPEX_VENV)/.installed: kernel/pyproject.toml plugins/ipex/pyproject.toml plugins/amp/pyproject.toml plugins/ddp/pyproject.toml Makefile
	test -x $(IPEX_BIN)/python || $(PY) -m venv $(IPEX_VENV)
	$(IPEX_BIN)/python -m pip install -q --upgrade pip
	$(IPEX_BIN)/python -m pip install -q $(IPEX_TORCH) $(IPEX_PKG)   # together, torch pinned: never let pip pick it
	$(IPEX_BIN)/python -m pip install -q numpy pluggy PyYAML packaging rich safetensors questionary setuptools wheel \
		pytest pytest-timeout scikit-learn
	$(IPEX_BIN)/python -m pip install -q --no-build-isolation -e kernel -e plugins/ipex -e plugins/amp -e plugins/ddp
	$(IPEX_BIN)/python -c "$(IPEX_CHECK)"
	touch $@

test-ipex: setup-ipex
	$(IPEX_BIN)/python -m pytest plugins/ipex/tests

.PHONY: bench
bench: setup
	$(BIN)/python bench/run.py
