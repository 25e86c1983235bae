"""accel-plugin-bigmodel: inference with models larger than memory (Accelerate's big-model API).

``init_empty_weights`` builds a model without allocating it; ``load_checkpoint_and_dispatch`` streams a safetensors
checkpoint into it over a device map (accelerators, CPU, disk) and attaches hooks that bring offloaded weights onto
the execution device just in time for each module's forward. The names are reachable as ``accel.utils.NAME``.

The plugin implements no hook; importing it imports neither torch nor safetensors (names load on first use).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accel_bigmodel.empty import init_empty_weights, init_on_device
    from accel_bigmodel.loading import (
        CheckpointMismatch,
        dispatch_model,
        load_checkpoint_and_dispatch,
        load_checkpoint_in_model,
    )
    from accel_bigmodel.modeling import (
        DeviceMapError,
        compute_module_sizes,
        get_balanced_memory,
        get_max_memory,
        infer_auto_device_map,
    )

_LAZY = {
    "init_empty_weights": "accel_bigmodel.empty",
    "init_on_device": "accel_bigmodel.empty",
    "compute_module_sizes": "accel_bigmodel.modeling",
    "get_max_memory": "accel_bigmodel.modeling",
    "get_balanced_memory": "accel_bigmodel.modeling",
    "infer_auto_device_map": "accel_bigmodel.modeling",
    "DeviceMapError": "accel_bigmodel.modeling",
    "load_checkpoint_in_model": "accel_bigmodel.loading",
    "load_checkpoint_and_dispatch": "accel_bigmodel.loading",
    "dispatch_model": "accel_bigmodel.loading",
    "CheckpointMismatch": "accel_bigmodel.loading",
}

__all__ = [
    "CheckpointMismatch",
    "DeviceMapError",
    "compute_module_sizes",
    "dispatch_model",
    "get_balanced_memory",
    "get_max_memory",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'accel_bigmodel' has no attribute {name!r}")
