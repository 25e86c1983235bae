"""Whether a checkpoint fits this run, checked before anything is loaded: the plugins that wrote it are active,
the same items on both sides, as many processes for per-process items, the kernel-written models' parameter names
and shapes, the optimizers' parameter groups, the dataloaders' positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from accel.checkpoint.files import TREE_FORMAT, _decode, _tree_doc, tree_shapes
from accel.checkpoint.items import Item
from accel.contract import DCP_FORMAT, ItemRecord
from accel.errors import CheckpointError
from accel.options import KERNEL, install_hint

if TYPE_CHECKING:
    from accel.checkpoint.items import CheckpointKernel
    from accel.contract import KernelView


def check_compatible(
    kernel: CheckpointKernel, items: Mapping[str, Item], records: Mapping[str, ItemRecord], directory: Path
) -> None:
    """Raise :class:`CheckpointError` saying what differs between the checkpoint and this run, before anything
    is loaded: a plugin that wrote items is not active, items missing on either side, a different number of
    processes for per-process items or dataloader positions, different parameter names or shapes."""
    active = {c.name for c in kernel.components}
    for key, rec in sorted(records.items()):
        if rec.plugin != KERNEL and rec.plugin not in active:
            raise CheckpointError(
                f"checkpoint item {key!r} of {directory} was written by plugin {rec.plugin!r}"
                f"{' ' + rec.version if rec.version else ''} in format {rec.format!r}; "
                f"{_plugin_advice(kernel, rec.plugin)}"
                + (
                    f"; or load only models and optimizers, in any run, with accel_{rec.plugin}.load_sharded"
                    if rec.format == DCP_FORMAT
                    else ""
                )
            )
        if rec.plugin == KERNEL and rec.format != TREE_FORMAT:
            raise CheckpointError(f"checkpoint item {key!r} has unknown kernel format {rec.format!r}")
    missing = [k for k in items if k not in records]
    if missing:
        held = ", ".join(sorted(records)) or "nothing"
        raise CheckpointError(
            f"checkpoint {directory} has no {', '.join(repr(k) for k in missing)} "
            f"(this run has {_describe(items, missing)}); it holds: {held}"
        )
    extra = [k for k in records if k not in items]
    if extra:
        hints = []
        for k in extra:
            provider = records[k].extra.get("provider", KERNEL)
            if provider != KERNEL:
                hints.append(f"{k!r} came from plugin {provider!r}: {_plugin_advice(kernel, provider)}")
        raise CheckpointError(
            f"checkpoint {directory} holds {', '.join(repr(k) for k in extra)} that this run does "
            f"not have (prepare/register the same objects as the run that saved it)"
            f"{'; ' + '; '.join(hints) if hints else ''}"
        )
    for key, rec in records.items():
        size = rec.extra.get("world_size")
        solo = "ranks" in rec.extra  # saved by the main process alone: each process restores what is there
        if items[key].per_rank and size is not None and int(size) != kernel.num_processes and not solo:
            raise CheckpointError(
                f"checkpoint item {key!r} holds one state per process for {size} process(es); "
                f"this run has {kernel.num_processes}: resume with {size} process(es)"
            )
    for key, item in items.items():
        rec = records[key]
        if rec.plugin != KERNEL:
            continue
        if item.kind == "model":
            _check_model(kernel, key, item, directory)
        elif item.kind == "optimizer":
            _check_optimizer(key, item, directory)
        elif item.kind == "dataloader":
            _check_dataloader(key, item, directory)


def _describe(items: Mapping[str, Item], keys: list[str]) -> str:
    parts = []
    for k in keys:
        item = items[k]
        if item.kind == "custom":
            parts.append(f"{k!r}: an object given to register_for_checkpointing ({type(item.obj).__name__})")
        elif item.kind == "plugin":
            parts.append(f"{k!r} from plugin {item.provider!r}")
        else:
            parts.append(f"{k!r}: a prepared {item.kind}")
    return "; ".join(parts)


def _plugin_advice(kernel: CheckpointKernel, name: str) -> str:
    rec = kernel.plugins.records.get(name)
    if rec is not None and rec.status == "loaded":
        return (
            f"it is installed ({rec.distribution} {rec.version}) but not active in this run: select it with "
            f"--plugin {name} (or Kernel(plugins=[{name!r}]))"
        )
    if rec is not None:
        return f"it is installed ({rec.distribution} {rec.version}) but {rec.status}: {rec.reason}"
    hint = install_hint(name)
    return f"install it with `{hint}`" if hint else f"install the plugin that provides {name!r}"


def _check_model(kernel: KernelView, key: str, item: Item, directory: Path) -> None:
    saved = tree_shapes(directory, key)
    current = {k: v for k, v in kernel.unwrap_model(item.obj).state_dict().items() if isinstance(v, torch.Tensor)}
    kinds = sorted({type(v).__name__ for v in current.values() if hasattr(v, "placements")})  # distributed tensors
    if kinds:  # the kernel restores whole tensors; a strategy that shards the model writes (and reads) it itself
        raise CheckpointError(
            f"checkpoint item {key!r} of {directory} holds the full model as written without a "
            f"sharding strategy, but this run's model holds {', '.join(kinds)} values (its strategy "
            "shards it): resume with the strategy that saved the checkpoint, or load the weights "
            "into the model before prepare() (accel.load_model for save_model's files)"
        )
    problems = []
    for name in current:
        if name not in saved:
            problems.append(f"{name} is missing from the checkpoint")
        elif tuple(current[name].shape) != saved[name][0]:
            problems.append(
                f"{name} has shape {tuple(saved[name][0])} in the checkpoint, "
                f"{tuple(current[name].shape)} in this model"
            )
    for name in saved:
        if name not in current:
            problems.append(f"{name} is in the checkpoint but not in this model")
    if problems:
        more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
        raise CheckpointError(f"checkpoint item {key!r} does not fit this model: {'; '.join(problems[:6])}{more}")


def _check_optimizer(key: str, item: Item, directory: Path) -> None:
    tree = _decode(_tree_doc(directory, key)["tree"], _NoTensors())
    saved = [len(g.get("params", ())) for g in tree.get("param_groups", [])] if isinstance(tree, dict) else []
    current = [len(g["params"]) for g in item.obj.param_groups]
    if saved != current:
        raise CheckpointError(
            f"checkpoint item {key!r} does not fit this optimizer: parameters per group "
            f"{saved} in the checkpoint, {current} in this run"
        )


def _check_dataloader(key: str, item: Item, directory: Path) -> None:
    state = _decode(_tree_doc(directory, key)["tree"], _NoTensors())
    check = getattr(item.obj, "check_state", None)
    if callable(check):
        problem = check(state)
        if problem:
            raise CheckpointError(f"checkpoint item {key!r}: {problem}")


class _NoTensors(dict):  # type: ignore[type-arg]
    """Tensor lookups during checks, which only read the JSON structure."""

    def __missing__(self, key: str) -> None:
        return None
