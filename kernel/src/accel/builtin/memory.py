"""Built-in plugin ``accel.memory``: ``accel estimate-memory``'s row for one process without a strategy plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel.hookspecs import hookimpl

if TYPE_CHECKING:
    from accel.memory import MemoryQuery, MemoryRow, ModelSummary


@hookimpl(trylast=True)
def accel_estimate_memory(model: ModelSummary, query: MemoryQuery) -> list[MemoryRow]:
    from accel.memory import single_process_rows

    return single_process_rows(model, query)
