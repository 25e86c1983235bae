"""Utilities Accelerate users reach for: ``set_seed``, ``tqdm``, ``send_to_device``, ``find_executable_batch_size``,
``LocalSGD`` and the kwargs-handler dataclasses of ``Kernel(kwargs_handlers=[...])``.

Everything is imported on first use (``import accel.utils`` imports neither torch, numpy nor tqdm). Names a plugin
exports (listed under ``exports`` in ``known_plugins.json``) are found here too when that plugin is installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accel.data import send_to_device
    from accel.data_arguments import DataLoaderConfiguration, GradientAccumulationPlugin
    from accel.project import ProjectConfiguration
    from accel.utils.dataclasses import DistributedType
    from accel.utils.handlers import (
        AORecipeKwargs,
        AutocastKwargs,
        FP8RecipeKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        KwargsHandler,
        MSAMPRecipeKwargs,
        ProfileKwargs,
        TERecipeKwargs,
    )
    from accel.utils.local_sgd import LocalSGD
    from accel.utils.memory import find_executable_batch_size, release_memory, should_reduce_batch_size
    from accel.utils.operations import (
        DistributedOperationException,
        broadcast,
        copy_tensor_to_devices,
        gather,
        gather_object,
        pad_across_processes,
        reduce,
    )
    from accel.utils.progress import tqdm
    from accel.utils.random import set_seed, synchronize_rng_states

from accel.utils.operations import __all__ as _OPERATIONS  # names only: it imports no torch

_LAZY = {
    "set_seed": "accel.utils.random",
    "synchronize_rng_states": "accel.utils.random",
    "tqdm": "accel.utils.progress",
    "find_executable_batch_size": "accel.utils.memory",
    "should_reduce_batch_size": "accel.utils.memory",
    "release_memory": "accel.utils.memory",
    "LocalSGD": "accel.utils.local_sgd",
    "send_to_device": "accel.data",
    "DistributedType": "accel.utils.dataclasses",
    **{name: "accel.utils.operations" for name in _OPERATIONS if name != "send_to_device"},
    # Accelerate's configuration dataclasses are importable from accelerate.utils too
    "DataLoaderConfiguration": "accel.data_arguments",
    "GradientAccumulationPlugin": "accel.data_arguments",
    "ProjectConfiguration": "accel.project",
    **{
        name: "accel.utils.handlers"
        for name in (
            "KwargsHandler",
            "AutocastKwargs",
            "GradScalerKwargs",
            "InitProcessGroupKwargs",
            "ProfileKwargs",
            "FP8RecipeKwargs",
            "AORecipeKwargs",
            "TERecipeKwargs",
            "MSAMPRecipeKwargs",
        )
    },
}

__all__ = [
    "AORecipeKwargs",
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DistributedOperationException",
    "DistributedType",
    "FP8RecipeKwargs",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LocalSGD",
    "MSAMPRecipeKwargs",
    "ProfileKwargs",
    "ProjectConfiguration",
    "TERecipeKwargs",
    "broadcast",
    "copy_tensor_to_devices",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
    "release_memory",
    "send_to_device",
    "set_seed",
    "should_reduce_batch_size",
    "synchronize_rng_states",
    "tqdm",
]


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    from accel.options import known_plugins

    for plugin, info in known_plugins()["plugins"].items():
        if name in info.get("exports", ()):
            module = info["distribution"].replace("accel-plugin-", "accel_").replace("-", "_")
            try:
                return getattr(importlib.import_module(module), name)
            except ImportError:
                raise AttributeError(
                    f"accel.utils.{name} comes with plugin {plugin!r}: pip install {info['distribution']}"
                ) from None
    raise AttributeError(f"module 'accel.utils' has no attribute {name!r}")
