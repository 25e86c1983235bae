"""Deprecated: ``accelerate.test_utils``'s path under accel. Import the generic test helpers from
``accel.testing.regression`` (``RegressionDataset``, ``RegressionModel``, ``assert_exception``), or run the script
unchanged on accel-accelerate. Each name works with a ``DeprecationWarning`` naming its replacement until its removal
release (:data:`accel.deprecations.DEPRECATIONS`)."""

from __future__ import annotations

from typing import Any

from accel.deprecations import attribute


def __getattr__(name: str) -> Any:
    return attribute(__name__, name)
