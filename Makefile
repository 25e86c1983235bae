# accel developer commands. `make demo` sets up a fresh machine and runs the demo on 2 CPU processes;
# `make test` runs the whole test suite (what CI runs).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
PLUGINS := $(sort $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml)))

.PHONY: setup demo test test-fast clean

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

.PHONY: bench
bench: setup
	$(BIN)/python bench/run.py
