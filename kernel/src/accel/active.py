"""The Kernels of this process, for the code that acts on "the process's Kernel" without being handed one: the free
functions of :mod:`accel.utils` (``gather``, ``set_seed``, ``tqdm``), :func:`accel.logging.get_logger` and
``PartialState()``. A Kernel adds itself when it starts and removes itself when it ends; :func:`active_kernel` is the
most recent one that has not ended.

This module sits below everything that uses it and imports neither torch nor :mod:`accel.kernel`: ``accel.kernel``
adds and removes its Kernels here, and registers the class ``PartialState()`` makes when a script has no Kernel.
A Kernel pickled into another process (a DataLoader worker, a ``datasets.map`` worker) comes back through
:func:`unpickle_kernel`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
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


#: what ``PartialState()`` calls to make a Kernel when the process has none (``accel.kernel`` sets it to ``Kernel``)
KERNEL_CLASS: list[Callable[..., ProcessKernel]] = []


def new_kernel(**kwargs: Any) -> ProcessKernel:
    """A new Kernel of this process, made with ``kwargs``."""
    return KERNEL_CLASS[0](**kwargs)


#: What a pickled Kernel carries to another process: the run's facts, nothing that runs collectives or hooks.
DETACHED_FACTS = (
    "topology",
    "device",
    "_data",
    "even_batches",
    "_accumulation_steps",
    "step_scheduler_with_optimizer",
    "project_configuration",
)


def pickled(kernel: Any, cls: type) -> tuple[Any, ...]:
    """``Kernel.__reduce__``: unpickled in the same process it is this Kernel again; in another process a detached
    ``cls`` (the Kernel class) that answers the run's facts and refuses collectives, hooks and checkpoints in one
    line."""
    facts = {name: kernel.__dict__[name] for name in DETACHED_FACTS if name in kernel.__dict__}
    return (unpickle_kernel, (cls, os.getpid(), id(kernel), facts))


def unpickle_kernel(cls: type, pid: int, ident: int, facts: dict[str, Any]) -> Any:
    """The Kernel a pickle names: the live one in the process that pickled it, else a detached copy of its facts."""
    if pid == os.getpid():
        for kernel in ACTIVE:
            if id(kernel) == ident:
                return kernel
    kernel = object.__new__(cls)
    kernel.__dict__.update(facts, _detached=pid)
    return kernel


def describe(kernel: Any) -> str:
    """``repr(kernel)``: where it runs, its device, precision and active plugins (also while ``Kernel()`` is still
    asking the plugins, whose hook tracing prints it, and for a detached copy)."""
    own = kernel.__dict__
    if "_detached" in own:
        return f"Kernel(detached copy, process {kernel.process_index}/{kernel.num_processes}, device={kernel.device})"
    comps = ", ".join(f"{c.name}:{c.role}" for c in kernel.plugins.components) or "none"
    where = (
        f"process {own['topology'].process_index}/{own['topology'].num_processes}" if "topology" in own else "starting"
    )
    return (
        f"Kernel({where}, device={own.get('device', '?')}, mixed_precision={kernel.mixed_precision}, plugins=[{comps}])"
    )
