"""``accelerate.utils.memory``: freeing memory and finding a batch size that fits (accel.utils.memory)."""

from __future__ import annotations

import gc

from accel.utils.memory import find_executable_batch_size, release_memory, should_reduce_batch_size


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Collect garbage if asked, then empty the accelerator's cache (nothing to do on the CPU)."""
    if garbage_collection:
        gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    elif hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.empty_cache()


__all__ = ["clear_device_cache", "find_executable_batch_size", "release_memory", "should_reduce_batch_size"]
