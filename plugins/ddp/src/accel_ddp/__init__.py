"""accel-plugin-ddp: the entry-point module. Cheap to import: no torch here (see ``strategy.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accel.spi import HardwareInfo, Options, Settings, hookimpl, nvidia_gpus

if TYPE_CHECKING:
    from accel.spi import MemoryQuery, MemoryRow, ModelSummary
    from accel_ddp.handlers import DDPCommunicationHookType, DistributedDataParallelKwargs

NAME = "ddp"
accel_components = ["accel_ddp.strategy:DDPStrategy"]
__all__ = ["DDPCommunicationHookType", "DistributedDataParallelKwargs"]


def __getattr__(name: str) -> Any:
    if name in __all__:  # Accelerate's handler classes, imported on first use
        from accel_ddp import handlers

        return getattr(handlers, name)
    raise AttributeError(f"module 'accel_ddp' has no attribute {name!r}")


#: DDP communication hooks (torch.distributed.algorithms.ddp_comm_hooks) and the wrappers that compress any hook.
COMM_HOOKS = ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd")
COMM_WRAPPERS = ("no", "fp16", "bf16")
DDP_KWARGS = "DistributedDataParallelKwargs"


@hookimpl
def accel_add_options(options: Options) -> None:
    add = options.add
    add(
        "ddp_backend",
        default="auto",
        choices=("auto", "gloo", "nccl", "mpi", "xccl"),
        handler="InitProcessGroupKwargs.backend",
        help="Process-group backend; auto picks nccl on CUDA and gloo otherwise.",
    )
    add(
        "ddp_find_unused_parameters",
        type="bool",
        default=False,
        handler=f"{DDP_KWARGS}.find_unused_parameters",
        help="DistributedDataParallel(find_unused_parameters=...).",
    )
    add(
        "ddp_bucket_cap_mb",
        type="float",
        default=25.0,
        minimum=0,
        handler=f"{DDP_KWARGS}.bucket_cap_mb",
        help="DDP gradient bucket size in MB.",
    )
    add(
        "ddp_timeout",
        type="float",
        default=1800.0,
        minimum=1,
        handler="InitProcessGroupKwargs.timeout",
        help="Collective timeout in seconds.",
    )
    add("rdzv_id", default="accel", help="Job id for c10d/etcd rendezvous.")
    add(
        "ddp_broadcast_buffers",
        type="bool",
        default=True,
        cli=False,
        handler=f"{DDP_KWARGS}.broadcast_buffers",
        help="DistributedDataParallel(broadcast_buffers=...): copy rank 0's buffers to all ranks at each forward.",
    )
    add(
        "ddp_gradient_as_bucket_view",
        type="bool",
        default=True,
        cli=False,
        handler=f"{DDP_KWARGS}.gradient_as_bucket_view",
        help="DistributedDataParallel(gradient_as_bucket_view=...): gradients are views into the buckets (default "
        "on: no copy of the gradients into the buckets each step, one gradient-sized buffer less; torch's default "
        "is off).",
    )
    add(
        "ddp_static_graph",
        type="bool",
        default=False,
        cli=False,
        handler=f"{DDP_KWARGS}.static_graph",
        help="DistributedDataParallel(static_graph=...): the set of used parameters never changes.",
    )
    add(
        "ddp_comm_hook",
        default="no",
        choices=COMM_HOOKS,
        handler=f"{DDP_KWARGS}.comm_hook",
        help="DDP communication hook: no, fp16 or bf16 (compress gradients), power_sgd or batched_power_sgd.",
    )
    add(
        "ddp_comm_wrapper",
        default="no",
        choices=COMM_WRAPPERS,
        handler=f"{DDP_KWARGS}.comm_wrapper",
        help="Wrap the communication hook to compress what it sends: no, fp16 or bf16.",
    )
    add(
        "ddp_comm_state_option",
        type="mapping",
        default={},
        handler=f"{DDP_KWARGS}.comm_state_option",
        help="PowerSGD state options as a JSON object (matrix_approximation_rank, start_powerSGD_iter, ...).",
    )


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


@hookimpl
def accel_estimate_memory(model: ModelSummary, query: MemoryQuery) -> list[MemoryRow]:
    """Rows of ``accel estimate-memory`` for this strategy (arithmetic only, see ``accel_ddp.memory``)."""
    from accel_ddp.memory import rows

    return rows(model, query)
