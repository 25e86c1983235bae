"""Built-in plugin ``accel.data``: data sharding. A prepared dataloader gives each process its own shard
(:func:`accel.data.shard_dataloader`); a strategy plugin answering ``accel_prepare_dataloader`` comes first."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accel.hookspecs import hookimpl

if TYPE_CHECKING:
    from accel.contract import KernelView


@hookimpl(trylast=True)
def accel_prepare_dataloader(kernel: KernelView, dataloader: Any) -> Any:
    from accel.data import shard_dataloader

    return shard_dataloader(kernel, dataloader)
