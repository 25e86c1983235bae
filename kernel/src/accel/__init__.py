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
    from accel.data import skip_first_batches
    from accel.data_arguments import DataLoaderConfiguration, GradientAccumulationPlugin
    from accel.gradient_state import GradientState
    from accel.kernel import Kernel, PartialState, PreparedOptimizer, PreparedScheduler
    from accel.launchers import debug_launcher, notebook_launcher
    from accel.project import ProjectConfiguration
    from accel.utils import (
        AutocastKwargs,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ProfileKwargs,
        find_executable_batch_size,
    )
    from accel.utils.random import synchronize_rng_states

_LAZY = {
    "DataLoaderConfiguration": "accel.data_arguments",
    "GradientAccumulationPlugin": "accel.data_arguments",
    "Kernel": "accel.kernel",
    "PreparedOptimizer": "accel.kernel",
    "PreparedScheduler": "accel.kernel",
    "GradientState": "accel.gradient_state",
    "PartialState": "accel.kernel",
    "ProjectConfiguration": "accel.project",
    "debug_launcher": "accel.launchers",
    "load_model": "accel.checkpoint",
    "notebook_launcher": "accel.launchers",
    "skip_first_batches": "accel.data",
    "synchronize_rng_states": "accel.utils.random",
}
#: names Accelerate also exports from its top-level package (``from accelerate import InitProcessGroupKwargs``):
#: the same objects as in ``accel.utils``, so ``from accelerate import X`` becomes ``from accel import X``
_FROM_UTILS = (
    "AutocastKwargs",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "ProfileKwargs",
    "find_executable_batch_size",
)

__all__ = [
    "AccelError",
    "AutocastKwargs",
    "CheckpointError",
    "Component",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedOperationError",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "GradientState",
    "HardwareInfo",
    "InitProcessGroupKwargs",
    "ItemRecord",
    "Kernel",
    "LaunchPlan",
    "Options",
    "PartialState",
    "PluginError",
    "PreparedOptimizer",
    "PreparedScheduler",
    "ProfileKwargs",
    "ProjectConfiguration",
    "Question",
    "Settings",
    "Topology",
    "Tracker",
    "UsageError",
    "debug_launcher",
    "find_executable_batch_size",
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
    if name in _FROM_UTILS:
        import accel.utils

        return getattr(accel.utils, name)
    from accel.deprecations import attribute

    return attribute(__name__, name)  # a deprecated name (with a warning naming its replacement), or AttributeError
