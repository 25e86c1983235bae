"""``accelerate.accelerator`` under its accel path (``from accelerate.accelerator import Accelerator`` becomes
``from accel.accelerator import Kernel``): the Kernel and the configuration classes Accelerate's module exports,
the same objects as ``accel.Kernel``, ``accel.DataLoaderConfiguration``, ..."""

from __future__ import annotations

from accel.data_arguments import DataLoaderConfiguration, GradientAccumulationPlugin
from accel.kernel import Kernel
from accel.project import ProjectConfiguration

__all__ = ["DataLoaderConfiguration", "GradientAccumulationPlugin", "Kernel", "ProjectConfiguration"]
