"""Deprecated path of :mod:`accel.data_arguments` (the dataloader and accumulation arguments of ``Kernel``).

``accel.compat.DataLoaderConfiguration`` and ``accel.compat.GradientAccumulationPlugin`` work with a
``DeprecationWarning`` naming ``accel.DataLoaderConfiguration`` / ``accel.GradientAccumulationPlugin`` until their
removal release (:data:`accel.deprecations.DEPRECATIONS`). The tables of Accelerate's names that this module held are
in accel-accelerate (``accel_accelerate.names``; ``python -m accel_accelerate.names`` prints the guide's tables).
"""

from __future__ import annotations

from typing import Any

from accel.deprecations import attribute


def __getattr__(name: str) -> Any:
    return attribute(__name__, name)
