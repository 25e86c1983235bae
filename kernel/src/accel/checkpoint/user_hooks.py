"""The script's own save and load hooks (Accelerate's ``register_save_state_pre_hook`` /
``register_load_state_pre_hook``, which every diffusers training script uses).

Before ``save_state`` writes anything, each save hook is called as ``hook(models, weights, output_dir)``: the
models as the script built them (unwrapped from data parallelism, as Accelerate passes them), their state dicts and the checkpoint's directory, still the temporary one, so whatever the hook
writes there is published with the checkpoint and listed in its manifest (accel never opens those files). A model
whose state dict the hook removed from ``weights`` is not saved by accel; the main process decides, as it is the
one that saves models in Accelerate (the diffusers hooks remove weights on the main process only). The others are
written from the state dicts the hooks saw, taken once (as Accelerate writes its ``weights``).

Before ``load_state`` restores anything, each load hook is called as ``hook(models, input_dir)``; a model the hook
removed from ``models`` has been loaded by the hook, and accel neither checks nor restores that model's item.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accel.checkpoint.items import CheckpointKernel, Item
    from accel.contract import ItemRecord

SaveHook = Callable[[list[Any], list[dict[str, Any]], str], None]
LoadHook = Callable[[list[Any], str], None]


def run_save_hooks(
    kernel: CheckpointKernel, items: Mapping[str, Item], directory: Path, alone: bool
) -> dict[str, Item]:
    """Call the save hooks; the items left for accel to write (all of them when there is no hook)."""
    hooks: list[SaveHook] = list(kernel._checkpoints.save_hooks.values())
    if not hooks:
        return dict(items)
    from accel.checkpoint.items import _state_of

    models = [item for item in items.values() if item.kind == "model"]
    weights = [_state_of(kernel, item) for item in models]
    for item, state in zip(models, weights, strict=True):
        item.state = state  # taken once: the writer saves what the hooks saw
    left = list(weights)
    for hook in hooks:
        hook([kernel.unwrap_model(item.obj) for item in models], left, os.fspath(directory))
    dropped = [item.key for item, state in zip(models, weights, strict=True) if not any(state is s for s in left)]
    if not alone:
        dropped = kernel.collectives.broadcast_object(dropped, 0)
    return {key: item for key, item in items.items() if key not in dropped}


def run_load_hooks(
    kernel: CheckpointKernel, items: Mapping[str, Item], records: Mapping[str, ItemRecord], directory: Path
) -> tuple[dict[str, Item], dict[str, ItemRecord]]:
    """Call the load hooks; the items and records left for accel to check and restore."""
    hooks: list[LoadHook] = list(kernel._checkpoints.load_hooks.values())
    if not hooks:
        return dict(items), dict(records)
    models = {item.key: kernel.unwrap_model(item.obj) for item in items.values() if item.kind == "model"}
    left = list(models.values())
    for hook in hooks:
        hook(left, os.fspath(directory))
    loaded = {key for key, model in models.items() if not any(model is obj for obj in left)}
    return (
        {key: item for key, item in items.items() if key not in loaded},
        {key: rec for key, rec in records.items() if key not in loaded},
    )
