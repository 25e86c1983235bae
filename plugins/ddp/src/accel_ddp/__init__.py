"""accel-plugin-ddp: the entry-point module. Cheap to import: no torch here (see ``strategy.py``)."""

from __future__ import annotations

from typing import Mapping

from accel import HardwareInfo, Options, Settings, hookimpl
from accel.hardware import nvidia_gpus

NAME = "ddp"
accel_components = ["accel_ddp.strategy:DDPStrategy"]


@hookimpl
def accel_add_options(options: Options) -> None:
    options.add("ddp_backend", default="auto", choices=("auto", "gloo", "nccl", "mpi", "xccl"),
                help="Process-group backend; auto picks nccl on CUDA and gloo otherwise.")
    options.add("ddp_find_unused_parameters", type="bool", default=False,
                help="DistributedDataParallel(find_unused_parameters=...).")
    options.add("ddp_bucket_cap_mb", type="float", default=25.0, minimum=0, help="DDP gradient bucket size in MB.")
    options.add("ddp_timeout", type="float", default=1800.0, minimum=1, help="Collective timeout in seconds.")
    options.add("rdzv_id", default="accel", help="Job id for c10d/etcd rendezvous.")


@hookimpl
def accel_detect_hardware(env: Mapping[str, str]) -> HardwareInfo | None:
    return nvidia_gpus(env)


def slurm_world(env: Mapping[str, str]) -> int:
    """Number of tasks of a SLURM job step this process belongs to (0 when not under SLURM)."""
    if "SLURM_PROCID" in env and "WORLD_SIZE" not in env:
        return int(env.get("SLURM_NTASKS", "1"))
    return 0


@hookimpl
def accel_activate(settings: Settings) -> object | None:
    world = max(settings.world_size, slurm_world(settings.env))
    if settings.is_selected(NAME) or world > 1:
        from accel_ddp.strategy import DDPStrategy

        return DDPStrategy(settings)
    return None
