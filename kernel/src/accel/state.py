"""``accelerate.state`` under its accel path: :class:`PartialState` and :class:`GradientState`.

accel keeps no process-wide singleton (each Kernel holds its own settings). ``PartialState`` is a read-only view of
a Kernel's distributed facts (process index and count, device, ``distributed_type``, ...) with Accelerate's names:
``kernel.state`` is the view of that Kernel, and ``PartialState()`` the view of the process's Kernel (the most
recent one, :func:`accel.kernel.active_kernel`), made with ``Kernel()`` when the script has none yet, so the free
functions of :mod:`accel.utils.operations` work after it as they do after Accelerate's. Only ``debug`` can be set
(it turns debug mode on or off for that Kernel's collectives); the rest is decided by the launch, the device and
the plugins, and assigning it is refused in one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accel.data import GradientState
from accel.errors import UsageError
from accel.options import known_plugins

if TYPE_CHECKING:
    from accel.kernel import Kernel

__all__ = ["GradientState", "PartialState"]

#: what the view answers, each the same-named member of its Kernel
_FROM_KERNEL = frozenset(
    {
        "device",
        "num_processes",
        "process_index",
        "local_process_index",
        "is_main_process",
        "is_local_main_process",
        "is_last_process",
        "use_distributed",
        "mixed_precision",
        "print",
        "wait_for_everyone",
        "main_process_first",
        "local_main_process_first",
        "on_main_process",
        "on_local_main_process",
        "on_last_process",
        "on_process",
        "on_local_process",
        "split_between_processes",
    }
)

def distributed_type(kernel: Kernel) -> Any:
    """Accelerate's ``DistributedType`` of a Kernel: ``NO`` on one process, else the value of Accelerate's config
    file that selects the Kernel's strategy plugin (``known_plugins.json``), ``MULTI_<device>`` for the plugin
    that several values select (``MULTI_GPU`` on ``cuda``)."""
    from accel.utils.dataclasses import DistributedType

    device = kernel.device.type
    multi = "MULTI_" + ("GPU" if device == "cuda" else device.upper())
    plugins = {component.name for component in kernel.components}
    found = [name for name, plugin in known_plugins()["distributed_type"].items() if plugin in plugins]
    single = [name for name in found if not name.startswith("MULTI_")]
    if single and multi not in found:
        return DistributedType[single[0]]
    if kernel.num_processes == 1 or multi not in DistributedType.__members__:
        return DistributedType.NO
    return DistributedType[multi]

class PartialState:
    """Accelerate's ``PartialState``/``AcceleratorState`` facts of one Kernel, read-only (see the module)."""

    __slots__ = ("__dict__", "_kernel")  # the Kernel stays out of __dict__: two views compare by their (empty) dicts

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        from accel.kernel import Kernel, active_kernel

        kernel = active_kernel()
        if kernel is None or cpu or kwargs:
            kernel = Kernel(cpu=cpu, **kwargs)
        object.__setattr__(self, "_kernel", kernel)

    @classmethod
    def of(cls, kernel: Kernel) -> PartialState:
        """The view of ``kernel`` (``kernel.state``)."""
        view = cls.__new__(cls)
        object.__setattr__(view, "_kernel", kernel)
        return view

    def __getattr__(self, name: str) -> Any:
        if name in _FROM_KERNEL:
            return getattr(self._kernel, name)
        raise AttributeError(f"'PartialState' object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "debug":
            self._kernel.debug = value
            return
        raise UsageError(
            f"kernel.state.{name} is read-only: accel's state is a view of the Kernel's facts, decided by the "
            "launch, the device and the plugins (only state.debug can be set); choose them with accel launch "
            "options or Kernel(...) arguments"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PartialState) and other._kernel is self._kernel

    def __hash__(self) -> int:
        return id(self._kernel)

    @property
    def distributed_type(self) -> Any:
        """Accelerate's ``DistributedType`` of the Kernel (:func:`distributed_type`)."""
        return distributed_type(self._kernel)

    @property
    def debug(self) -> bool:
        """Whether debug mode checks the Kernel's collectives (settable, as Accelerate's ``state.debug``)."""
        return bool(self._kernel.debug)

    @property
    def initialized(self) -> bool:
        return True

    def destroy_process_group(self, group: Any = None) -> None:
        """End the Kernel's run (``kernel.end_training()``): its trackers and its processes' resources."""
        self._kernel.end_training()

    def __repr__(self) -> str:
        k = self._kernel
        return (
            f"Distributed environment: {self.distributed_type.value}\nNum processes: {k.num_processes}\n"
            f"Process index: {k.process_index}\nLocal process index: {k.local_process_index}\nDevice: {k.device}\n"
            f"Mixed precision type: {k.mixed_precision}\n"
        )
