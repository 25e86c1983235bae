"""``accelerate.utils.operations`` under its accel path: the free collective functions of Accelerate, each the
same-named method of the process's Kernel (:func:`accel.active.active_kernel`, the most recent one; a
:class:`accel.PartialState` makes one). No logic of its own: ``gather(t)`` is ``active_kernel().gather(t)``.

``DistributedOperationException`` is :class:`accel.DistributedOperationError` (debug mode, accel/debug.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, cast

from accel.errors import DistributedOperationError, UsageError

if TYPE_CHECKING:
    import torch

    from accel.contract import Collectives


class OpsKernel(Protocol):
    """What these functions call on the process's Kernel (:class:`accel.Kernel` is one)."""

    collectives: Collectives
    device: torch.device

    @property
    def num_processes(self) -> int: ...

    def gather(self, tensor: Any) -> Any: ...

    def gather_object(self, obj: Any) -> list[Any]: ...

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any: ...

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any: ...

    def broadcast(self, data: Any, from_process: int = 0) -> Any: ...


DistributedOperationException = DistributedOperationError

__all__ = [
    "DistributedOperationException",
    "broadcast",
    "copy_tensor_to_devices",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
    "send_to_device",
]


def _kernel(function: str) -> OpsKernel:
    from accel.active import active_kernel

    kernel = active_kernel()
    if kernel is None:
        raise UsageError(
            f"accel.utils.operations.{function}() runs on the process's Kernel and there is none: create "
            f"accel.Kernel() (or accel.PartialState()) first, or call kernel.{function}(...)"
        )
    return cast(OpsKernel, kernel)


def gather(tensor: Any) -> Any:
    """``kernel.gather(tensor)`` on the process's Kernel."""
    return _kernel("gather").gather(tensor)


def gather_object(obj: Any) -> list[Any]:
    """``kernel.gather_object(obj)`` on the process's Kernel."""
    return _kernel("gather_object").gather_object(obj)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """``kernel.broadcast(tensor, from_process)`` on the process's Kernel."""
    return _kernel("broadcast").broadcast(tensor, from_process=from_process)


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """``kernel.reduce(tensor, reduction, scale)`` on the process's Kernel; the default reduction is ``"mean"``, as
    Accelerate's free function has it (its ``Accelerator.reduce``, like ``kernel.reduce``, defaults to ``"sum"``)."""
    return _kernel("reduce").reduce(tensor, reduction, scale)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """``kernel.pad_across_processes(...)`` on the process's Kernel."""
    return _kernel("pad_across_processes").pad_across_processes(tensor, dim, pad_index, pad_first)


def copy_tensor_to_devices(tensor: Any = None) -> Any:
    """Process 0's tensor on every process: ``kernel.broadcast`` of it, the others' shape and dtype taken from
    process 0 first (they pass ``None``, as in Accelerate)."""
    kernel = _kernel("copy_tensor_to_devices")
    import torch

    if kernel.num_processes == 1:
        return tensor
    meta = (tuple(tensor.shape), tensor.dtype) if tensor is not None else None
    shape, dtype = kernel.collectives.broadcast_object(meta, 0)
    if tensor is None:
        tensor = torch.zeros(shape, dtype=dtype, device=kernel.device)
    return kernel.broadcast(tensor.to(kernel.device), from_process=0)


def send_to_device(tensor: Any, device: Any, non_blocking: bool = False) -> Any:
    """:func:`accel.utils.send_to_device` (no Kernel needed)."""
    from accel.data import send_to_device as send

    return send(tensor, device, non_blocking)
