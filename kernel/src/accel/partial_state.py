"""Accelerate's ``PartialState``/``AcceleratorState`` for accel: a read-only view of one Kernel's distributed facts
under Accelerate's names (``kernel.state``; ``PartialState()`` views the process's Kernel, making one when there is
none), and Accelerate's ``DistributedType`` of a Kernel."""

from __future__ import annotations

from typing import Any

from accel import active
from accel.errors import UsageError
from accel.options import known_plugins
from accel.utils.dataclasses import DistributedType

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


def distributed_type(kernel: Any) -> Any:
    """Accelerate's ``DistributedType`` of a Kernel: ``NO`` on one process, else the value of Accelerate's config
    file that selects the Kernel's strategy plugin (``known_plugins.json``), ``MULTI_<device>`` for the plugin
    that several values select (``MULTI_GPU`` on ``cuda``). Worked out once per Kernel (its plugins and device are
    fixed): scripts and libraries read it at every step (transformers' ``Trainer`` three times)."""
    cached = kernel.__dict__.get("_distributed_type")
    if cached is None:
        cached = kernel.__dict__["_distributed_type"] = _distributed_type(kernel)
    return cached


def _distributed_type(kernel: Any) -> Any:
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

    # the Kernel stays out of __dict__ (empty: Accelerate's test scripts compare state.__dict__ across a pickle);
    # two views are equal when they view the same Kernel (__eq__)
    __slots__ = ("__dict__", "_kernel")

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        kernel = active.active_kernel()
        if kernel is None or cpu or kwargs:
            kernel = active.new_kernel(cpu=cpu, **kwargs)
        object.__setattr__(self, "_kernel", kernel)

    @classmethod
    def of(cls, kernel: Any) -> PartialState:
        """Accelerate's ``accelerator.state``: a read-only view of this Kernel's distributed facts with Accelerate's
        names. The settings are ``kernel.settings``, the plugins ``kernel.components``."""
        view = cls.__new__(cls)
        object.__setattr__(view, "_kernel", kernel)
        return view

    @staticmethod
    def assign(kernel: Any, value: Any) -> None:
        """``kernel.state = value``: Accelerate's is a plain attribute, so assigning a Kernel's own view is fine;
        anything else is one line."""
        if value != PartialState.of(kernel):
            raise UsageError(
                f"kernel.state is this Kernel's read-only view, got {value!r}: create another Kernel for other "
                "settings (only kernel.state.debug can be set)"
            )

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
