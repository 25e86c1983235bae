"""accel.hardware: the torch-free GPU probe ddp and fsdp answer accel_detect_hardware with."""

from __future__ import annotations

import os
from typing import Any

from accel.hardware import nvidia_gpus


def test_no_driver_means_no_gpu() -> None:
    if not os.path.isdir("/proc/driver/nvidia/gpus"):
        assert nvidia_gpus({}) is None


def test_driver_listing_narrowed_by_cuda_visible_devices(monkeypatch: Any, tmp_path: Any) -> None:
    real_listdir = os.listdir
    gpus = tmp_path / "gpus"
    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"):
        (gpus / bus).mkdir(parents=True)
    monkeypatch.setattr(os, "listdir", lambda p: real_listdir(gpus if p == "/proc/driver/nvidia/gpus" else p))
    info = nvidia_gpus({})
    assert info is not None and (info.name, info.device_count) == ("cuda", 4)
    assert nvidia_gpus({"CUDA_VISIBLE_DEVICES": "1,3"}).device_count == 2  # type: ignore[union-attr]
    assert nvidia_gpus({"CUDA_VISIBLE_DEVICES": ""}).device_count == 0  # type: ignore[union-attr]
