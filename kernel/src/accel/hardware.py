"""Torch-free hardware probes for plugins' ``accel_detect_hardware`` (it runs for ``accel env``/``accel launch`` and
must not import torch)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from accel.contract import HardwareInfo


def nvidia_gpus(env: Mapping[str, str], priority: int = 10) -> HardwareInfo | None:
    """The NVIDIA GPUs the driver lists (``/proc/driver/nvidia/gpus``), narrowed by ``CUDA_VISIBLE_DEVICES``;
    None without a driver or GPU."""
    try:
        count = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return None
    if count == 0:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = len([d for d in visible.split(",") if d.strip()])
    return HardwareInfo(name="cuda", device_count=count, priority=priority, details={"source": "/proc/driver/nvidia"})
