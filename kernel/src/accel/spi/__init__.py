"""accel's plugin API: the only module a plugin imports from accel.

Everything a plugin needs from the kernel is importable from here: the hook markers, the records passed through the
hooks (:class:`Component`, :class:`Settings`, :class:`LaunchPlan`, ...), :class:`KernelView` (what a runtime hook may
use of the kernel it is handed) and the helpers the kernel shares with plugins (process groups and torchrun,
checkpoint files, memory rows, trackers). Names here follow semantic versioning (:data:`API_VERSION`, CHANGELOG.md):
a name is removed only after a minor release in which using it warns and names its replacement.

``import accel.spi`` does not import torch: names that need it are loaded on first use, so a plugin's entry-point
module may import anything from here at discovery time. Strategies that shard with FSDP2 import the
sharded-training toolkit, the submodule :mod:`accel.spi.sharded`, explicitly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from accel.contract import (
    EXCLUSIVE_ROLES,
    LAUNCH_UNSET,
    Collectives,
    Component,
    HardwareInfo,
    ItemRecord,
    KernelView,
    LaunchPlan,
    Question,
    Topology,
    unhonoured_launch_settings,
)
from accel.errors import AccelError, CheckpointError, PluginError, UsageError
from accel.hookspecs import hookimpl, hookspec
from accel.options import Options, Settings, did_you_mean

#: The plugin contract's version (major, minor): hooks, records, the names of this module and the conformance kit.
#: A minor step adds or deprecates (a plugin written for an earlier minor keeps working, with warnings); a major step
#: removes what was deprecated. 1.0 was accel-kernel 0.1.0's contract; 1.1 is 0.1.1's. docs/plugin-api.md, "Stability".
API_VERSION = (1, 1)

if TYPE_CHECKING:
    from accel.checkpoint import (
        agree,
        dcp_load,
        dcp_reader,
        error_line,
        load_weights_only,
        read_tree,
        weights_only_reason,
        write_tree,
    )
    from accel.data import shard_dataloader
    from accel.distributed import (
        ProcessGroupComponent,
        barrier_if_initialized,
        destroy_process_group,
        free_port,
        launch_with_torchrun,
        local_device,
        restart_store_args,
        torchrun_env,
        world_of_one,
    )
    from accel.hardware import nvidia_gpus
    from accel.memory import ELEMENT_BYTES, MemoryQuery, MemoryRow, ModelSummary, replicated, unsupported
    from accel.nested import map_tensors
    from accel.prepared import PreparedOptimizer
    from accel.processes import run_process
    from accel.tracking import Tracker
    from accel.tracking import _as_scalar as as_scalar
    from accel.tracking import _flatten as flatten
    from accel.tracking import _requested as requested
    from accel.utils.handlers import KwargsHandler

#: Names loaded on first use (their modules import torch, or are not needed at discovery): ``"module"``, or
#: ``"module:attribute"`` where the module defines the name under another one.
_LAZY = {
    "agree": "accel.checkpoint",
    "dcp_load": "accel.checkpoint",
    "dcp_reader": "accel.checkpoint",
    "error_line": "accel.checkpoint",
    "load_weights_only": "accel.checkpoint",
    "read_tree": "accel.checkpoint",
    "weights_only_reason": "accel.checkpoint",
    "write_tree": "accel.checkpoint",
    "shard_dataloader": "accel.data",
    "ProcessGroupComponent": "accel.distributed",
    "barrier_if_initialized": "accel.distributed",
    "destroy_process_group": "accel.distributed",
    "free_port": "accel.distributed",
    "launch_with_torchrun": "accel.distributed",
    "local_device": "accel.distributed",
    "restart_store_args": "accel.distributed",
    "torchrun_env": "accel.distributed",
    "world_of_one": "accel.distributed",
    "nvidia_gpus": "accel.hardware",
    "ELEMENT_BYTES": "accel.memory",
    "MemoryQuery": "accel.memory",
    "MemoryRow": "accel.memory",
    "ModelSummary": "accel.memory",
    "replicated": "accel.memory",
    "unsupported": "accel.memory",
    "map_tensors": "accel.nested",
    "PreparedOptimizer": "accel.prepared",
    "run_process": "accel.processes",
    "Tracker": "accel.tracking",
    "as_scalar": "accel.tracking:_as_scalar",
    "flatten": "accel.tracking:_flatten",
    "requested": "accel.tracking:_requested",
    "KwargsHandler": "accel.utils.handlers",
}

__all__ = [
    "API_VERSION",
    "AccelError",
    "CheckpointError",
    "Collectives",
    "Component",
    "ELEMENT_BYTES",
    "EXCLUSIVE_ROLES",
    "HardwareInfo",
    "ItemRecord",
    "KernelView",
    "KwargsHandler",
    "LAUNCH_UNSET",
    "LaunchPlan",
    "MemoryQuery",
    "MemoryRow",
    "ModelSummary",
    "Options",
    "PluginError",
    "PreparedOptimizer",
    "ProcessGroupComponent",
    "Question",
    "Settings",
    "Topology",
    "Tracker",
    "UsageError",
    "agree",
    "as_scalar",
    "barrier_if_initialized",
    "dcp_load",
    "dcp_reader",
    "destroy_process_group",
    "did_you_mean",
    "error_line",
    "flatten",
    "free_port",
    "hookimpl",
    "hookspec",
    "launch_with_torchrun",
    "load_weights_only",
    "local_device",
    "map_tensors",
    "nvidia_gpus",
    "read_tree",
    "replicated",
    "requested",
    "restart_store_args",
    "run_process",
    "shard_dataloader",
    "torchrun_env",
    "unhonoured_launch_settings",
    "unsupported",
    "weights_only_reason",
    "world_of_one",
    "write_tree",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, _, attribute_name = _LAZY[name].partition(":")
        value = getattr(importlib.import_module(module), attribute_name or name)
        globals()[name] = value
        return value
    from accel.deprecations import attribute

    return attribute(__name__, name)  # a deprecated name (with a warning naming its replacement), or AttributeError


def __dir__() -> list[str]:
    return sorted(__all__)
