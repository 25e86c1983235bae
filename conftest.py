"""Every test folder's (kernel/tests, plugins/*/tests, tests/): each test gets the process environment back as it
found it, so a variable a test (or a library it drives, e.g. ``mlflow.set_tracking_uri``) writes into ``os.environ``
cannot reach the subprocesses of the tests after it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
