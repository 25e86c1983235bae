"""``accelerate.scheduler``: the prepared scheduler (``AcceleratedScheduler`` is accel's ``PreparedScheduler``)."""

from __future__ import annotations

from accel.kernel import PreparedScheduler as AcceleratedScheduler

__all__ = ["AcceleratedScheduler"]
