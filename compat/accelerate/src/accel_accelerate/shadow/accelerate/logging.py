"""``accelerate.logging``: ``get_logger`` (messages on the main process unless asked otherwise)."""

from __future__ import annotations

from accel.logging import get_logger

__all__ = ["get_logger"]
