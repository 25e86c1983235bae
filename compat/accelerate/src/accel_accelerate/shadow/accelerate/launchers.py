"""``accelerate.launchers``: ``notebook_launcher`` and ``debug_launcher`` (accel's)."""

from __future__ import annotations

from accel.launchers import debug_launcher, notebook_launcher

__all__ = ["debug_launcher", "notebook_launcher"]
