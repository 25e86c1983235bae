"""Debug mode (``debug: true``, ``--debug``, ``ACCELERATE_DEBUG_MODE=1``, ``Kernel(debug=True)``): every collective
of the kernel first checks that all processes make the same call.

With debug on, the Kernel wraps the plugin's :class:`accel.contract.Collectives` in :class:`CheckedCollectives`.
Before each operation every process sends a short description of its call (the Kernel method the script called,
the collective, its tensor's shape and dtype, the source process) to all the others; when they differ, every
process raises the same :class:`DistributedOperationError` naming each process's call, instead of hanging or failing
inside the backend. This is Accelerate's ``verify_operation`` (``DistributedOperationException``), made for every
collective, not just ``gather``/``reduce``/``broadcast``/``pad_across_processes``. With debug off the plugin's object
is used as it is: no cost.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from accel.errors import DistributedOperationError

if TYPE_CHECKING:
    from types import FrameType

    import torch

    from accel.contract import Collectives

_ROOT = os.path.dirname(os.path.abspath(__file__)) + os.sep  # accel/, not accel_ddp/ beside it


def _call_site() -> tuple[str, str]:
    """The Kernel method the script called (the outermost frame inside accel) and the script's line that called
    it, as ``("gather", "train.py:12")``."""
    entry = sys._getframe(2)
    frame: FrameType | None = entry
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_ROOT):
        entry, frame = frame, frame.f_back
    site = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame is not None else "?"
    return entry.f_code.co_name, site


def _describe(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


class CheckedCollectives:
    """The plugin's collectives, each call checked against every other process's first (debug mode)."""

    def __init__(self, inner: Collectives, process_index: int) -> None:
        self.inner = inner
        self.process_index = process_index

    def _check(self, op: str, detail: str = "") -> None:
        method, site = _call_site()
        call = (method, op, detail)
        calls = self.inner.all_gather_object((*call, site))
        if all(tuple(c[:3]) == call for c in calls):
            return
        groups: dict[tuple[str, ...], list[int]] = {}
        for rank, c in enumerate(calls):
            groups.setdefault(tuple(c), []).append(rank)
        said = "; ".join(
            f"process{'es' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {m}() at {s} -> "
            f"{o}{' ' + d if d else ''}"
            for (m, o, d, s), ranks in groups.items()
        )
        raise DistributedOperationError(
            f"debug mode (process {self.process_index}): the processes made different collective calls: "
            f"{said}; every process must call the same operation with tensors of the same shape and dtype"
        )

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._check("all_gather", _describe(tensor))
        return self.inner.all_gather(tensor)

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        self._check(f"all_reduce({op})", _describe(tensor))
        return self.inner.all_reduce(tensor, op)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._check(f"broadcast(from process {src})", _describe(tensor))
        return self.inner.broadcast(tensor, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        self._check("all_gather_object")
        return self.inner.all_gather_object(obj)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        self._check(f"broadcast_object(from process {src})")
        return self.inner.broadcast_object(obj, src)

    def barrier(self) -> None:
        self._check("barrier")
        self.inner.barrier()

    def __getattr__(self, name: str) -> Any:  # anything else a plugin's collectives object offers, unchecked
        return getattr(self.inner, name)
