"""Every test folder's (kernel/tests, plugins/*/tests, tests/): each test gets the process environment back as it
found it, so a variable a test (or a library it drives, e.g. ``mlflow.set_tracking_uri``) writes into ``os.environ``
cannot reach the subprocesses of the tests after it.

torch builds C++ extensions (DeepSpeed's CPU ops) in ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``:
every test and every process it starts uses the checkout's ``.cache/torch_extensions`` instead (ignored by git; where
the DeepSpeed tests already built their op once), unless the caller set one. A run that is killed in the middle of a
build leaves a lock there that accel then refuses to launch beside (tests/test_fault_files.py): in ``~/.cache`` that
lock broke the next suite's DeepSpeed dry runs (test_config_tree, the DeepSpeed conformance class)."""

from __future__ import annotations

import os
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
