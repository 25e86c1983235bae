"""accel: a PyTorch training-acceleration kernel; everything backend-specific is a plugin.

``import accel`` does not import torch; ``accel.Kernel`` does (on first access).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accel.contract import Component, HardwareInfo, ItemRecord, LaunchPlan, Question, Topology
from accel.errors import AccelError, CheckpointError, DistributedOperationError, PluginError, UsageError
from accel.hookspecs import hookimpl, hookspec
from accel.options import Options, Settings
from accel.tracking import Tracker

if TYPE_CHECKING:
    from accel.checkpoint import load_model
    from accel.compat import DataLoaderConfiguration, GradientAccumulationPlugin
    from accel.data import skip_first_batches
    from accel.kernel import Kernel, PreparedOptimizer, PreparedScheduler
    from accel.launchers import debug_launcher, notebook_launcher
    from accel.project import ProjectConfiguration
    from accel.utils.random import synchronize_rng_states

_LAZY = {
    "DataLoaderConfiguration": "accel.compat",
    "GradientAccumulationPlugin": "accel.compat",
    "Kernel": "accel.kernel",
    "PreparedOptimizer": "accel.kernel",
    "PreparedScheduler": "accel.kernel",
    "ProjectConfiguration": "accel.project",
    "debug_launcher": "accel.launchers",
    "load_model": "accel.checkpoint",
    "notebook_launcher": "accel.launchers",
    "skip_first_batches": "accel.data",
    "synchronize_rng_states": "accel.utils.random",
}

__all__ = [
    "AccelError",
    "CheckpointError",
    "Component",
    "DataLoaderConfiguration",
    "DistributedOperationError",
    "GradientAccumulationPlugin",
    "HardwareInfo",
    "ItemRecord",
    "Kernel",
    "LaunchPlan",
    "Options",
    "PluginError",
    "PreparedOptimizer",
    "PreparedScheduler",
    "ProjectConfiguration",
    "Question",
    "Settings",
    "Topology",
    "Tracker",
    "UsageError",
    "debug_launcher",
    "hookimpl",
    "hookspec",
    "load_model",
    "notebook_launcher",
    "skip_first_batches",
    "synchronize_rng_states",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from accel.version import kernel_version

        return kernel_version()
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    from accel.deprecations import attribute

    return attribute(__name__, name)  # a deprecated name (with a warning naming its replacement), or AttributeError
