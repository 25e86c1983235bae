"""``accelerate.optimizer``: the prepared optimizer (``AcceleratedOptimizer`` is accel's ``PreparedOptimizer``)."""

from __future__ import annotations

from accel.kernel import PreparedOptimizer as AcceleratedOptimizer

__all__ = ["AcceleratedOptimizer"]
