"""Deprecated: ``accelerate.test_utils.testing``'s path under accel: ``assert_exception`` is
``accel.testing.regression.assert_exception`` (works with a ``DeprecationWarning`` until its removal release)."""

from __future__ import annotations

from typing import Any

from accel.deprecations import attribute


def __getattr__(name: str) -> Any:
    return attribute(__name__, name)
