# accel developer commands. `make demo` sets up a fresh machine and runs the demo on 2 CPU processes;
# `make test` runs the main test suite; `make test-all` (what CI runs) adds the XLA and IPEX venv suites and the torch
# matrix (the smoke tests on the declared torch floor and the newest torch).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
PLUGINS := $(sort $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml)))

.PHONY: setup demo lint test test-fast test-all setup-xla test-xla setup-ipex test-ipex setup-slurm clean docs

setup: $(VENV)/.installed

$(VENV)/.installed: kernel/pyproject.toml $(wildcard plugins/*/pyproject.toml) compat/accelerate/pyproject.toml \
		requirements-dev.txt Makefile tests/warm_workers/install.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)          # first: never let pip pick a (CUDA) torch
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q --no-build-isolation -e kernel $(foreach p,$(PLUGINS),-e $(p)) -e compat/accelerate
	$(BIN)/python compat/accelerate/install_startup_hook.py  # the wheel's .pth, which an editable install lacks
	$(BIN)/python -m pip install -q --no-deps --target $(VENV)/accelerate-real accelerate==1.15.0  # the reference
	$(BIN)/python -m pip install -q --no-deps trl==1.16.0 peft==0.21.2  # their accelerate: accel-accelerate's
	$(BIN)/python tests/warm_workers/install.py    # the tests' warm workers (CONTRIBUTING.md)
	touch $@

demo: setup
	$(BIN)/accel launch --num_processes 2 examples/train_digits.py

# The generated parts of docs/hooks.md and docs/plugin-api.md, from hookspecs.py, the records' code and the installed
# plugins (docs/generate.py; tests/test_generated_docs.py fails while they are out of date).
docs: setup
	$(BIN)/python docs/generate.py

# Every test folder (pyproject.toml testpaths): kernel/tests (the kernel's own), plugins/<name>/tests (each plugin's,
# runnable with only that plugin installed: `make test-plugin-alone`) and tests/ (cross-plugin and end-to-end suites).
# plugins/xla/tests and plugins/ipex/tests need their own torch and run in test-xla / test-ipex, but for the module
# of each that tests the plugin in this venv (test_xla_plugin.py, test_ipex_plugin.py), run here. With the 25 slowest
# tests (--durations=25); tests/suite_budget.py prints the total and the 10 slowest modules and fails the run when it
# took longer than its budget (ACCEL_SUITE_BUDGET seconds, 0: off). PYTEST_WORKERS=N runs it on N pytest-xdist
# workers (--dist loadfile: whole modules per worker, so a module's shared fixtures, a launch several tests read, a
# Slurm cluster, an MLflow server, are still built once). The default is 2: with the launches' processes forked
# warm, the suite left the 2 cores 37 % idle in one process (1,483 core-s over 2,044 s); on 2 workers it took
# 1,247 s, back to back on the same machine, every test passing (CONTRIBUTING.md, "Two pytest-xdist workers").
# PYTEST_WORKERS=0 runs it in one process (and its summary then names the tests that leave the CPUs idle).
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadfile
test: setup
	$(BIN)/python -m pytest $(XDIST) --durations=25

# What CI runs first (.ci/run): ruff (lint rules and formatting; configured in pyproject.toml) on all the Python code,
# mypy on the kernel, the plugins and tools/, then the import rules (lint-imports: plugins import only accel.spi, the
# kernel library never imports accel.commands, no import cycle among kernel modules; [tool.importlinter] in
# pyproject.toml). Every check runs even when an earlier one fails; the target fails if any did.
# `$(BIN)/ruff check --fix $(LINT_PATHS)` fixes import order and the other mechanical findings.
LINT_PATHS := kernel plugins compat tests bench examples docs tools
lint: setup
	@status=0; \
	echo "ruff check"; $(BIN)/ruff check $(LINT_PATHS) || status=1; \
	echo "ruff format --check"; $(BIN)/ruff format --check --output-format concise $(LINT_PATHS) || status=1; \
	echo "mypy"; $(BIN)/mypy kernel/src/accel $(filter-out %.egg-info,$(wildcard plugins/*/src/accel_*)) tools || status=1; \
	echo "mypy (accel-accelerate)"; (cd compat/accelerate/src && MYPYPATH=.:accel_accelerate/shadow ../../../$(BIN)/mypy -m accel_accelerate \
		-m accel_accelerate.startup -m accel_accelerate.__main__ -p accelerate --config-file ../../../pyproject.toml) \
		|| status=1; \
	echo "lint-imports"; $(BIN)/lint-imports --no-cache || status=1; \
	exit $$status

test-fast: setup
	$(BIN)/python -m pytest $(XDIST) -m "not slow"

# What CI runs (.ci/run): Debian's Slurm for tests/test_slurm.py, the main suite, then, two at a time, the XLA and
# IPEX plugins in their own venvs, the torch matrix: the smoke tests on the declared floor (torch 2.7.0) and on the
# newest torch (2.14.1), each in its own slim venv (`make test-torch-matrix`), and each plugin's folder with only
# that plugin installed (its quick tests: `make test-plugin-alone`). The venvs of everything after the main suite
# (XLA, IPEX, plugins alone, the two torches: LATER_VENVS) are built in the background while the main suite runs
# (their pip steps wait mostly on the network and the disk, and they install with --no-compile), their output in
# venv-build.log, shown when a build fails; the suites that use them come after (CONTRIBUTING.md "The torch
# matrix in CI").
# The MLflow tests' server environment (full mlflow, ~850 MB: plugins/mlflow/tests/mlflow_server.py) is built there
# too: the first test that needs it waits for it (a file lock) instead of installing it on the suite's clock.
LATER_VENVS = setup-xla setup-ipex $(ALONE_VENV)/.installed $(TORCH_MATRIX:%=torch-venv-%)
# DeepSpeed's CPU communication op (deepspeed_shm_comm, 2-3 min of one core in a clean workspace) is compiled there as
# well, into the folder the DeepSpeed tests use (plugins/deepspeed/tests/dstools.py EXTENSIONS): the first DeepSpeed
# test otherwise compiles it on the suite's clock while the second core idles; torch's build lock makes a test that
# comes first wait for this build instead of starting another.
BACKGROUND_SETUP = $(LATER_VENVS) setup-mlflow-server setup-deepspeed-ops
# The later suites run two at a time (make -j2; each one's output shown whole when it ends): each is one pytest
# process in a venv of its own and keeps one core busy, so one after the other they left the second core idle.
# Two at a time, the plugins' folders run for real alone (their quick tests, `make test-plugin-alone`) in the time
# the folders' collection alone took in turn (2-core machine: 419 s against 428 s). XLA, the longest
# (146-166 s), starts first.
LATER_SUITES = test-xla $(TORCH_MATRIX:%=test-torch-%) test-ipex test-plugin-alone
test-all: setup setup-slurm
	@echo "== building the venvs of the later suites and the MLflow server's in the background (venv-build.log)"; \
	$(MAKE) --no-print-directory -j$(words $(BACKGROUND_SETUP)) --output-sync=target $(BACKGROUND_SETUP) \
		> venv-build.log 2>&1 & build=$$!; \
	status=0; \
	$(MAKE) --no-print-directory test || status=$$?; \
	if wait $$build; then echo "== venvs built"; \
	else echo "== building the venvs failed:"; cat venv-build.log; status=1; fi; \
	[ $$status = 0 ] || exit $$status; \
	$(MAKE) --no-print-directory -j2 --output-sync=target $(LATER_SUITES)

# Each plugin's tests with only that plugin and the kernel installed (`pytest plugins/<name>` works in such a
# venv), and kernel/tests with no plugin at all. One venv, .venv-alone: torch 2.13.0 first, then the kernel, the test
# requirements and the plugins' third-party dependencies (DeepSpeed, MLflow, W&B, TensorBoard: no accel plugin);
# each plugin is installed with --no-deps, tested, and uninstalled again. ALONE_PYTEST picks the tests (default: the
# quick ones; ALONE_PYTEST="-q" runs all). xla and ipex are tested alone by test-xla / test-ipex (their own torch).
ALONE_VENV ?= .venv-alone
ALONE_BIN := $(ALONE_VENV)/bin
ALONE_PLUGINS ?= $(filter-out xla ipex,$(notdir $(PLUGINS)))
ALONE_PYTEST ?= -q -m "not slow and not multiprocess"
ALONE_DEPS := "deepspeed>=0.19,<0.20" "mlflow-skinny>=2.12,<4" "wandb>=0.17,<1" "tensorboard>=2.14"

$(ALONE_VENV)/.installed: kernel/pyproject.toml $(wildcard plugins/*/pyproject.toml) requirements-dev.txt Makefile
	test -x $(ALONE_BIN)/python || $(PY) -m venv $(ALONE_VENV)
	$(ALONE_BIN)/python -m pip install -q --upgrade pip
	$(ALONE_BIN)/python -m pip install -q --no-compile $(TORCH)          # first: never let pip pick a (CUDA) torch
	$(ALONE_BIN)/python -m pip install -q --no-compile $(TORCH) -r requirements-dev.txt $(ALONE_DEPS)
	$(ALONE_BIN)/python -m pip install -q --no-build-isolation -e kernel
	touch $@

# The MLflow server the MLflow tests start (its own venv, .venv-mlflow-server; the tests install it on first use when
# this has not run).
.PHONY: setup-mlflow-server
setup-mlflow-server:
	$(BIN)/python plugins/mlflow/tests/mlflow_server.py

.PHONY: setup-deepspeed-ops
setup-deepspeed-ops:
	$(BIN)/python plugins/deepspeed/tests/dstools.py

.PHONY: test-plugin-alone test-plugin-alone-smoke
test-plugin-alone-smoke:
	$(MAKE) --no-print-directory test-plugin-alone ALONE_PYTEST="-q --collect-only"

test-plugin-alone: $(ALONE_VENV)/.installed
	@$(ALONE_BIN)/python -m pip uninstall -q -y $(foreach p,$(PLUGINS),accel-plugin-$(notdir $(p))) 2>/dev/null; \
	status=0; \
	echo "== kernel/tests, no plugin installed"; \
	$(ALONE_BIN)/python -m pytest $(ALONE_PYTEST) kernel/tests || status=1; \
	for p in $(ALONE_PLUGINS); do \
		echo "== plugins/$$p, only accel-plugin-$$p installed"; \
		$(ALONE_BIN)/python -m pip install -q --no-deps --no-build-isolation -e plugins/$$p && \
		$(ALONE_BIN)/python -m pytest $(ALONE_PYTEST) plugins/$$p || { status=1; echo "FAILED alone: $$p"; }; \
		$(ALONE_BIN)/python -m pip uninstall -q -y accel-plugin-$$p; \
	done; exit $$status

# Debian's Slurm and munge, for tests/test_slurm.py (which starts a one-node cluster of its own on 127.0.0.1).
# Needs root (CI and the dev VMs are); elsewhere it says so and the Slurm tests are skipped (under CI=true they fail).
SLURM_PACKAGES := slurmctld slurmd slurm-client munge
setup-slurm:
	@if test -x /usr/sbin/slurmctld && test -x /usr/sbin/slurmd && command -v sbatch >/dev/null && test -x /usr/sbin/munged; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SLURM_PACKAGES) >/dev/null; \
	else echo "setup-slurm: not root, so Slurm is not installed (apt-get install $(SLURM_PACKAGES)); tests/test_slurm.py will skip"; fi

clean:
	rm -rf $(VENV) $(XLA_VENV) $(IPEX_VENV) $(ALONE_VENV) $(TORCH_MATRIX:%=.venv-torch-%) build dist .pytest_cache

# accel-plugin-xla, tested for real in its own venv: torch-xla 2.9.0 only loads with torch 2.9.0 (PyPI has only its
# CUDA build, ~7 GB with the nvidia libraries; about 1.5 min to install). `make test-xla` reuses the venv when it
# holds the right versions and rebuilds it otherwise; the tests run on PJRT's CPU device.
XLA_VENV ?= .venv-xla
XLA_TORCH_VERSION ?= 2.9.0
XLA_VERSION ?= 2.9.0
XLA_CHECK := import importlib.metadata as m, sys; \
	sys.exit(m.version("torch").split("+")[0] != "$(XLA_TORCH_VERSION)" or m.version("torch-xla") != "$(XLA_VERSION)")

$(XLA_VENV)/.installed: kernel/pyproject.toml plugins/xla/pyproject.toml Makefile
	test -x $(XLA_VENV)/bin/python || $(PY) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/python -m pip install -q --upgrade pip
	$(XLA_VENV)/bin/python -m pip install -q --no-compile torch==$(XLA_TORCH_VERSION) torch-xla==$(XLA_VERSION)  # torch named first, same command
	$(XLA_VENV)/bin/python -m pip install -q "setuptools>=77" wheel pytest pytest-timeout scikit-learn
	$(XLA_VENV)/bin/python -m pip install -q --no-build-isolation -e kernel -e plugins/xla
	$(XLA_VENV)/bin/python -c '$(XLA_CHECK)'
	touch $@

setup-xla:
	@$(XLA_VENV)/bin/python -c '$(XLA_CHECK)' 2>/dev/null || rm -f $(XLA_VENV)/.installed
	@$(MAKE) --no-print-directory $(XLA_VENV)/.installed

test-xla: setup-xla
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest plugins/xla/tests

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
	$(IPEX_BIN)/python -m pip install -q --no-compile $(IPEX_TORCH) $(IPEX_PKG)   # together, torch pinned: never let pip pick it
	$(IPEX_BIN)/python -m pip install -q numpy pluggy PyYAML packaging safetensors questionary "setuptools>=77" wheel \
		pytest pytest-timeout scikit-learn
	$(IPEX_BIN)/python -m pip install -q --no-build-isolation -e kernel -e plugins/ipex -e plugins/amp -e plugins/ddp
	$(IPEX_BIN)/python -c "$(IPEX_CHECK)"
	touch $@

test-ipex: setup-ipex
	$(IPEX_BIN)/python -m pytest plugins/ipex/tests

.PHONY: bench
bench: setup
	$(BIN)/python bench/run.py

# Accelerate's examples ported to accel (tests/compat) run under accel and under Accelerate 1.15 on 2 CPU processes;
# the learning-rate curves must be identical (losses and metrics are compared and reported). Accelerate gets its own
# venv: torch 2.13.0 first (never let pip pick torch), then Accelerate 1.15 and what the examples import. The pytest
# test tests/compat/test_examples.py::test_same_as_accelerate uses that venv when it exists.
COMPAT_ACC_VENV ?= .venv-compat-accelerate
COMPAT_ACC_PKGS ?= "accelerate==1.15.*" "transformers>=4.40" "datasets>=2.18" "deepspeed>=0.16" schedulefree \
	scikit-learn pillow tensorboard

.PHONY: compat-vs-accelerate
$(COMPAT_ACC_VENV)/.installed: Makefile
	test -x $(COMPAT_ACC_VENV)/bin/python || $(PY) -m venv $(COMPAT_ACC_VENV)
	$(COMPAT_ACC_VENV)/bin/python -m pip install -q --upgrade pip
	$(COMPAT_ACC_VENV)/bin/python -m pip install -q $(TORCH)   # first: never let pip pick a (CUDA) torch
	$(COMPAT_ACC_VENV)/bin/python -m pip install -q $(TORCH) $(COMPAT_ACC_PKGS)
	$(COMPAT_ACC_VENV)/bin/python -c 'import accelerate, torch; assert accelerate.__version__.startswith("1.15") and torch.__version__.startswith("2.13.0"), (accelerate.__version__, torch.__version__)'
	touch $@

compat-vs-accelerate: setup $(COMPAT_ACC_VENV)/.installed
	$(BIN)/python tests/compat/compare_accelerate.py --accelerate-python $(COMPAT_ACC_VENV)/bin/python $(EXAMPLES)

# The torch versions the distributions declare (`torch>=2.7,<3` in every pyproject), tested: the tests marked `smoke`
# (pytest -m smoke: the loop, amp, DDP and FSDP2 on 2 processes, checkpoints, dynamo, the launcher, trackers, big-model
# loading) run in .venv-torch-floor on the declared floor and in .venv-torch-newest on the newest torch installable
# here. Each venv gets torch alone in its first pip command (never let pip pick torch), then requirements-smoke.txt
# (only what the smoke tests need) with the same torch pinned, then the kernel and every plugin but those whose
# third-party packages the smoke tests do not use (MATRIX_LEFT_OUT: DeepSpeed's build, MLflow, W&B); the other test
# modules are still collected and skip what is absent. `--no-compile`: no .pyc written for torch's and transformers'
# thousands of modules at install (Python compiles what a test imports). A venv is reused while it holds its torch and
# rebuilt otherwise. Both are CUDA builds (PyPI has no CPU build of these versions; ~5.5 GB each with the nvidia
# libraries) run on the CPU. The XLA and IPEX plugins' own tests are left out: they run on the torch they need in their
# own venvs above.
TORCH_MATRIX := floor newest
TORCH_floor ?= 2.7.0
TORCH_newest ?= 2.14.1
MATRIX_LEFT_OUT := plugins/deepspeed plugins/mlflow plugins/wandb
MATRIX_PLUGINS := $(filter-out $(MATRIX_LEFT_OUT),$(PLUGINS))
SMOKE_PATHS := $(filter-out plugins/xla/% plugins/ipex/%,$(wildcard tests kernel/tests plugins/*/tests))
TORCH_IS = import importlib.metadata as m, sys; sys.exit(m.version("torch").split("+")[0] != "$(1)")

# Both venvs are built at once (their pip steps wait on the network and the disk more than on the 2 CPUs: cold, ≈4.5
# min for both instead of ≈7 one after the other), then each runs its smoke tests, one torch after the other.
.PHONY: test-torch-matrix $(TORCH_MATRIX:%=test-torch-%) $(TORCH_MATRIX:%=torch-venv-%)
test-torch-matrix:
	$(MAKE) --no-print-directory -j$(words $(TORCH_MATRIX)) --output-sync=target $(TORCH_MATRIX:%=torch-venv-%)
	$(MAKE) --no-print-directory $(TORCH_MATRIX:%=test-torch-%)

.venv-torch-%/.installed: kernel/pyproject.toml $(wildcard plugins/*/pyproject.toml) requirements-smoke.txt Makefile
	test -x .venv-torch-$*/bin/python || $(PY) -m venv .venv-torch-$*
	.venv-torch-$*/bin/python -m pip install -q --upgrade pip
	.venv-torch-$*/bin/python -m pip install -q --no-compile torch==$(TORCH_$*)   # first: never let pip pick torch
	.venv-torch-$*/bin/python -m pip install -q --no-compile torch==$(TORCH_$*) -r requirements-smoke.txt
	.venv-torch-$*/bin/python -m pip install -q --no-build-isolation torch==$(TORCH_$*) -e kernel $(MATRIX_PLUGINS:%=-e %)
	.venv-torch-$*/bin/python -c '$(call TORCH_IS,$(TORCH_$*))'
	touch $@

$(TORCH_MATRIX:%=torch-venv-%): torch-venv-%:
	@.venv-torch-$*/bin/python -c '$(call TORCH_IS,$(TORCH_$*))' 2>/dev/null || rm -f .venv-torch-$*/.installed
	$(MAKE) --no-print-directory .venv-torch-$*/.installed

$(TORCH_MATRIX:%=test-torch-%): test-torch-%: torch-venv-%
	.venv-torch-$*/bin/python -m pytest -m smoke -p no:cacheprovider $(SMOKE_PATHS)
