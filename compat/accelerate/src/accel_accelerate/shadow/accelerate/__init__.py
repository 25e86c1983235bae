"""``accelerate``, implemented on accel (the accel-accelerate distribution). Scripts and libraries written for
Hugging Face Accelerate import it unchanged; every object here is backed by an ``accel.Kernel`` and its plugins.
Which ``accelerate`` a process imports is decided at start-up (``accel_accelerate.startup``)."""

from __future__ import annotations

import importlib
from typing import Any

from accel_accelerate import ACCELERATE_API_VERSION

__version__ = ACCELERATE_API_VERSION

_NAMES = {
    "Accelerator": "accelerate.accelerator",
    "PartialState": "accelerate.state",
    "AcceleratorState": "accelerate.state",
    "GradientState": "accelerate.state",
    "ParallelismConfig": "accelerate.parallelism_config",
    "skip_first_batches": "accelerate.data_loader",
    "notebook_launcher": "accelerate.launchers",
    "debug_launcher": "accelerate.launchers",
    "init_empty_weights": "accelerate.big_modeling",
    "init_on_device": "accelerate.big_modeling",
    "dispatch_model": "accelerate.big_modeling",
    "load_checkpoint_and_dispatch": "accelerate.big_modeling",
    "cpu_offload": "accelerate.big_modeling",
    "cpu_offload_with_hook": "accelerate.big_modeling",
    "disk_offload": "accelerate.big_modeling",
    "infer_auto_device_map": "accelerate.utils",
    "load_checkpoint_in_model": "accelerate.utils",
    "synchronize_rng_states": "accelerate.utils",
    "find_executable_batch_size": "accelerate.utils",
    "DataLoaderConfiguration": "accelerate.utils",
    "DeepSpeedPlugin": "accelerate.utils",
    "DistributedDataParallelKwargs": "accelerate.utils",
    "DDPCommunicationHookType": "accelerate.utils",
    "DistributedType": "accelerate.utils",
    "FullyShardedDataParallelPlugin": "accelerate.utils",
    "GradScalerKwargs": "accelerate.utils",
    "InitProcessGroupKwargs": "accelerate.utils",
    "ProfileKwargs": "accelerate.utils",
    "AutocastKwargs": "accelerate.utils",
    "is_rich_available": "accelerate.utils",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'accelerate' has no attribute {name!r} (accel-accelerate {__version__})")
