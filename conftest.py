"""Every test folder's (kernel/tests, plugins/*/tests, tests/): each test gets the process environment back as it
found it, so a variable a test (or a library it drives, e.g. ``mlflow.set_tracking_uri``) writes into ``os.environ``
cannot reach the subprocesses of the tests after it.

torch builds C++ extensions (DeepSpeed's CPU ops) in ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``:
every test and every process it starts uses the checkout's ``.cache/torch_extensions`` instead (ignored by git; where
the DeepSpeed tests already built their op once), unless the caller set one. A run that is killed in the middle of a
build leaves a lock there that accel then refuses to launch beside (tests/test_fault_files.py): in ``~/.cache`` that
lock broke the next suite's DeepSpeed dry runs (test_config_tree, the DeepSpeed conformance class).

Warm workers (``tests/warm_workers``, CONTRIBUTING.md "Warm workers in the test suite"): the worker processes torchrun
starts for the session's tests are forked from a server that imported torch once, instead of importing it each
(2-4 CPU s per worker), where the venv has the hook ``make setup`` installs. ``WARM_WORKERS=0`` in the session's
environment turns this off for the session; in a launch's environment, for that launch's workers."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache", "torch_extensions")
)


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True, scope="session")
def _warm_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if os.environ.get("WARM_WORKERS", "1") == "0":
        yield
        return
    from accel.testing import patched_environ

    folder = tmp_path_factory.mktemp("warm")
    try:
        with patched_environ({"WARM_WORKERS_DIR": str(folder), "WARM_WORKERS_OWNER": str(os.getpid())}):
            yield
    finally:
        for pid_file in folder.glob("*.pid"):  # the servers: each kills what it still runs when its owner is gone
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
