"""These tests need torch 2.8.* with intel-extension-for-pytorch 2.8.* (``make test-ipex`` builds ``.venv-ipex``).
In any other environment they stop at once with that reason instead of failing one by one."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from accel_ipex import accel_unavailable_reason

    reason = accel_unavailable_reason()
    if reason:
        raise pytest.UsageError(f"plugins/ipex/tests need a torch that matches IPEX (run `make test-ipex`): {reason}")
