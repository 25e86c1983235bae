"""The tracker component: the runtime hooks, as methods of an ``accel.Tracker``."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

from accel.spi import KernelView, Tracker, as_scalar, hookimpl


def _plain(value: Any) -> Any:
    """A JSON-friendly version of a logged value (tensors and numpy numbers become Python numbers)."""
    number = as_scalar(value)
    if number is not None:
        return number
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, type(None))) else str(value)


class JsonlTracker(Tracker):
    """Appends one JSON object per event to ``<project_dir>/jsonl/<project_name>.jsonl``.

    ``init_kwargs={"jsonl": {"path": "file.jsonl"}}`` writes to that file instead."""

    provides = frozenset({"tracker:jsonl"})

    def __init__(self) -> None:
        self.run = None  # the open file while a run is going on (``get_tracker("jsonl", unwrap=True)``)

    def _write(self, event: dict[str, Any]) -> None:
        event["time"] = time.time()
        self.run.write(json.dumps(event) + "\n")
        self.run.flush()

    @hookimpl
    def accel_init_trackers(
        self, kernel: KernelView, project_name: str, config: Mapping[str, Any], init_kwargs: Mapping[str, Any]
    ) -> None:
        options = init_kwargs.get("jsonl", {})
        path = options.get("path") or os.path.join(kernel.project_dir or ".", "jsonl", f"{project_name}.jsonl")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.run = open(path, "a", encoding="utf-8")
        self._write({"event": "init", "project": project_name, "config": _plain(config)})

    @hookimpl
    def accel_log(
        self, kernel: KernelView, values: Mapping[str, Any], step: int | None, log_kwargs: Mapping[str, Any]
    ) -> None:
        self._write({"event": "log", "step": step, "values": _plain(values)})

    @hookimpl
    def accel_log_table(
        self,
        kernel: KernelView,
        table_name: str,
        columns: list[str],
        data: list[list[Any]],
        step: int | None,
        log_kwargs: Mapping[str, Any],
    ) -> None:
        self._write({"event": "table", "name": table_name, "step": step, "columns": columns, "data": _plain(data)})

    @hookimpl
    def accel_end_training(self, kernel: KernelView) -> None:
        if self.run is not None:
            self._write({"event": "end"})
            self.run.close()
            self.run = None
