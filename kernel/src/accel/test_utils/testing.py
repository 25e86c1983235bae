"""``accelerate.test_utils.testing`` under its accel path: :func:`accel.testing.regression.assert_exception`."""

from __future__ import annotations

from accel.testing.regression import assert_exception

__all__ = ["assert_exception"]
