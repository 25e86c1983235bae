"""``accelerate.logging``: ``get_logger`` (messages on the main process unless asked otherwise)."""

from __future__ import annotations

from typing import Any

import accel.logging


class MultiProcessAdapter(accel.logging.MultiProcessAdapter):
    """accel's adapter, plus Accelerate's ``warning_once`` (TRL's trainers call it): a message with the same
    arguments is logged once per logger."""

    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        key = repr((args, sorted(kwargs.items())))
        seen: set[str] = self.__dict__.setdefault("_warned_once", set())
        if key not in seen:
            seen.add(key)
            self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    adapter = accel.logging.get_logger(name, log_level)
    return MultiProcessAdapter(adapter.logger, {})


__all__ = ["MultiProcessAdapter", "get_logger"]
