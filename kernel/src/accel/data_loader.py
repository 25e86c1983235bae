"""Deprecated: ``accelerate.data_loader``'s path under accel. Import from ``accel`` (``from accel import
DataLoaderConfiguration, skip_first_batches``; ``kernel.prepare_data_loader``), or run the script unchanged on
accel-accelerate, whose ``accelerate.data_loader`` has Accelerate's classes. Each name works with a
``DeprecationWarning`` naming its replacement until its removal release (:data:`accel.deprecations.DEPRECATIONS`)."""

from __future__ import annotations

from typing import Any

from accel.deprecations import attribute


def __getattr__(name: str) -> Any:
    return attribute(__name__, name)
