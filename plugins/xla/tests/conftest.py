"""Tests of accel-plugin-xla against the real torch_xla, in the `.venv-xla` environment (`make test-xla`), but
``MAIN_VENV``: the plugin in the main venv (torch 2.13, where torch_xla cannot load), which `make test` runs
(pyproject.toml's testpaths name it) and which is left out where torch_xla loads.

In `.venv-xla` they run on PJRT's CPU device. Settings never leak in from the user: ACCEL_HOME points at a temporary
directory.
"""

from __future__ import annotations

import os

import pytest

from accel_xla.availability import unavailable_reason

#: Modules for the main venv (`make test`), not for `.venv-xla`.
MAIN_VENV = ["test_xla_plugin.py"]
#: Where torch_xla loads (`.venv-xla`); elsewhere this conftest changes nothing outside its folder's tests (the main
#: suite runs MAIN_VENV in the same process as every other test folder).
OWN_VENV = unavailable_reason() is None
collect_ignore = MAIN_VENV if OWN_VENV else []

if OWN_VENV:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    for _name in [k for k in os.environ if k.startswith(("ACCEL_", "ACCELERATE_"))]:
        del os.environ[_name]


@pytest.fixture(autouse=True)
def _accel_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path_factory.mktemp("accel_home")))
