"""``accelerate.state`` under its accel path: :class:`PartialState` and :class:`GradientState`.

accel keeps no process-wide singleton (each Kernel holds its own settings). ``PartialState`` is a read-only view of
a Kernel's distributed facts (process index and count, device, ``distributed_type``, ...) with Accelerate's names:
``kernel.state`` is the view of that Kernel, and ``PartialState()`` the view of the process's Kernel (the most
recent one, :func:`accel.kernel.active_kernel`), made with ``Kernel()`` when the script has none yet, so the free
functions of :mod:`accel.utils.operations` work after it as they do after Accelerate's. Only ``debug`` can be set
(it turns debug mode on or off for that Kernel's collectives); the rest is decided by the launch, the device and
the plugins, and assigning it is refused in one line. Both classes live beside the code they view
(:mod:`accel.kernel`, :mod:`accel.data`).
"""

from __future__ import annotations

from accel.data import GradientState
from accel.kernel import PartialState

__all__ = ["GradientState", "PartialState"]
