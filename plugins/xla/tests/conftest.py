"""Tests of accel-plugin-xla against the real torch_xla, in the `.venv-xla` environment (`make test-xla`).

They run on PJRT's CPU device. Settings never leak in from the user: ACCEL_HOME points at a temporary directory.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
for _name in [k for k in os.environ if k.startswith(("ACCEL_", "ACCELERATE_"))]:
    del os.environ[_name]


@pytest.fixture(autouse=True)
def _accel_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path_factory.mktemp("accel_home")))
