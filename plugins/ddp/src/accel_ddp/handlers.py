"""Accelerate's ``DistributedDataParallelKwargs`` and ``DDPCommunicationHookType`` (the ddp plugin's options)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from accel.spi import KwargsHandler


class DDPCommunicationHookType(str, enum.Enum):
    """A DDP communication hook (or wrapper): ``str(member)`` is its option value."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """``Kernel(kwargs_handlers=[DistributedDataParallelKwargs(...)])``: each field set becomes the ddp option of
    the same meaning (``find_unused_parameters`` -> ``ddp_find_unused_parameters``, ``comm_hook`` ->
    ``ddp_comm_hook``, ...). ``dim`` and ``check_reduction`` have no option: setting them is refused."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)
