"""The Kernels of this process, for the code that acts on "the process's Kernel" without being handed one: the free
functions of :mod:`accel.utils` (``gather``, ``set_seed``, ``tqdm``), :func:`accel.logging.get_logger` and
``PartialState()``. A Kernel adds itself when it starts and removes itself when it ends; :func:`active_kernel` is the
most recent one that has not ended.

This module sits below everything that uses it and imports neither torch nor :mod:`accel.kernel`: ``accel.kernel``
adds and removes its Kernels here.
"""

from __future__ import annotations

from typing import Any, Protocol


class ProcessKernel(Protocol):
    """What the users of this module read of a Kernel (``accel.kernel.Kernel`` is one; a caller that needs more of
    it types it as ``Kernel``)."""

    @property
    def process_index(self) -> int: ...

    @property
    def local_process_index(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    def wait_for_everyone(self) -> None: ...

    def synchronize_rng_states(self, *args: Any, **kwargs: Any) -> Any: ...


#: the Kernels that have started and not ended, oldest first
ACTIVE: list[ProcessKernel] = []


def active_kernel() -> ProcessKernel | None:
    """The most recently created Kernel of this process that has not ended, if any."""
    return ACTIVE[-1] if ACTIVE else None
