"""``accelerate.utils.dataclasses`` under its accel path: ``DistributedType`` and the configuration dataclasses
(``from accelerate.utils.dataclasses import DistributedType`` becomes ``from accel.utils.dataclasses import ...``).

``DistributedType`` has Accelerate's members (``NO`` and the ``distributed_type`` values of Accelerate's config file
that accel reads, ``known_plugins.json``), each equal to its name as a string, as Accelerate's ``str`` enum is. A
Kernel's is ``kernel.state.distributed_type`` (:class:`accel.state.PartialState`), worked out from the processes,
the device and the strategy plugin.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from accel.options import known_plugins

if TYPE_CHECKING:
    from accel.compat import DataLoaderConfiguration, GradientAccumulationPlugin
    from accel.project import ProjectConfiguration

#: Accelerate's ``DistributedType``: ``DistributedType.MULTI_CPU == "MULTI_CPU"``
DistributedType: Any = enum.Enum(  # members from data: the kernel names no backend
    "DistributedType", {name: name for name in ("NO", *known_plugins()["distributed_type"])}, type=str
)
DistributedType.__module__ = __name__

__all__ = ["DataLoaderConfiguration", "DistributedType", "GradientAccumulationPlugin", "ProjectConfiguration"]


def __getattr__(name: str) -> Any:
    import accel.utils

    if name in __all__:
        return getattr(accel.utils, name)
    raise AttributeError(f"module 'accel.utils.dataclasses' has no attribute {name!r}")
