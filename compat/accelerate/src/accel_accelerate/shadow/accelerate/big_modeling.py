"""``accelerate.big_modeling``: empty-weight models, device maps and offloading (accel-plugin-bigmodel)."""

from __future__ import annotations

from typing import Any

from accel.errors import UsageError
from accel_bigmodel.empty import init_empty_weights, init_on_device
from accel_bigmodel.loading import dispatch_model, load_checkpoint_and_dispatch


def _offload(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise UsageError(
            f"accelerate.{name} is not provided by accel-accelerate: give dispatch_model a device_map with 'cpu' or "
            "'disk' entries (accel-plugin-bigmodel offloads them and loads each just before its forward)"
        )

    refuse.__name__ = name
    return refuse


cpu_offload = _offload("cpu_offload")
cpu_offload_with_hook = _offload("cpu_offload_with_hook")
disk_offload = _offload("disk_offload")

__all__ = [
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
]
