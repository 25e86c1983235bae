"""Built-in plugin ``accel.checkpoint``: the checkpoint writer, the default implementation of the state hooks.

It gives the kernel's own items (prepared models, optimizers, schedulers, dataloader positions, registered objects,
random states), writes every item no plugin claimed and reads them back, in the kernel's own format
(:mod:`accel.checkpoint`). Its items and records belong to the kernel (``"accel"`` in the manifest)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accel.contract import ItemRecord
from accel.hookspecs import hookimpl

if TYPE_CHECKING:
    from accel.checkpoint.items import CheckpointKernel


@hookimpl(trylast=True)
def accel_state_items(kernel: CheckpointKernel) -> dict[str, Any]:
    from accel.checkpoint import kernel_items

    return kernel_items(kernel)


@hookimpl(trylast=True)
def accel_save_state(
    kernel: CheckpointKernel, items: Mapping[str, Any], directory: Path, asynchronous: bool
) -> dict[str, ItemRecord]:
    # called last, once the plugins' claims are agreed between processes: writes every item nobody claimed
    from accel.checkpoint import write_unclaimed

    return write_unclaimed(kernel, directory, asynchronous)


@hookimpl(trylast=True)
def accel_load_state(
    kernel: CheckpointKernel, items: Mapping[str, Any], directory: Path, records: Mapping[str, ItemRecord]
) -> list[str]:
    from accel.checkpoint import restore_own

    return restore_own(kernel, items, directory, records)
