"""``accelerate.utils.dataclasses`` under its accel path: ``DistributedType`` and the configuration dataclasses
(``from accelerate.utils.dataclasses import DistributedType`` becomes ``from accel.utils.dataclasses import ...``).

``DistributedType`` has Accelerate's members (``NO`` and the ``distributed_type`` values of Accelerate's config file
that accel reads, ``known_plugins.json``), each equal to its name as a string, as Accelerate's ``str`` enum is. A
Kernel's is ``kernel.state.distributed_type`` (:class:`accel.PartialState`), worked out from the processes,
the device and the strategy plugin.
"""

from __future__ import annotations

import enum
from typing import Any

from accel.data_arguments import DataLoaderConfiguration, GradientAccumulationPlugin
from accel.options import known_plugins
from accel.project import ProjectConfiguration


def _distributed_type() -> Any:
    """An enum of Accelerate's members, from data: the kernel names no backend. A config-file value that is only
    another spelling (``TPU`` after ``XLA``, for the same plugin) is not a member, as in Accelerate."""
    names, seen = ["NO"], set()
    for name, plugin in known_plugins()["distributed_type"].items():
        if name.startswith("MULTI_") or plugin not in seen:
            names.append(name)
            seen.add(plugin)
    members = {name: name for name in names}
    kind = enum.Enum("DistributedType", members, type=str)  # type: ignore[misc]
    kind.__module__ = __name__
    return kind


#: Accelerate's ``DistributedType``: ``DistributedType.MULTI_CPU == "MULTI_CPU"``
DistributedType = _distributed_type()

__all__ = ["DataLoaderConfiguration", "DistributedType", "GradientAccumulationPlugin", "ProjectConfiguration"]
