"""``accelerate.test_utils.testing``: ``assert_exception`` (accel's :mod:`accel.testing.regression`)."""

from __future__ import annotations

from accel.testing.regression import assert_exception

__all__ = ["assert_exception"]
