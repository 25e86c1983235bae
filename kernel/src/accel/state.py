"""Deprecated: ``accelerate.state``'s path under accel. Import from ``accel`` (``from accel import PartialState,
GradientState``; ``kernel.state`` is a Kernel's view), or run the script unchanged on accel-accelerate. Each name
works with a ``DeprecationWarning`` naming its replacement until its removal release
(:data:`accel.deprecations.DEPRECATIONS`)."""

from __future__ import annotations

from typing import Any

from accel.deprecations import attribute


def __getattr__(name: str) -> Any:
    return attribute(__name__, name)
