"""``get_logger(name)``: a logger whose calls take ``main_process_only=`` (default True) and ``in_order=``."""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any


def _rank() -> tuple[int, int, int]:
    """(process index, local process index, process count) of the active Kernel, else from the environment."""
    from accel.active import active_kernel  # torch is loaded by now if a Kernel exists

    kernel = active_kernel()
    if kernel is not None:
        return kernel.process_index, kernel.local_process_index, kernel.num_processes
    from accel.options import int_env

    env = os.environ
    return int_env(env, "RANK", 0), int_env(env, "LOCAL_RANK", 0), int_env(env, "WORLD_SIZE", 1)


class MultiProcessAdapter(logging.LoggerAdapter):
    """Logs on the main process only unless ``main_process_only=False``; ``in_order=True`` logs on every process
    one after the other. Messages are prefixed with the process index when there are several."""

    # [override]: LoggerAdapter.log takes **kwargs: object, which could fill main_process_only/in_order; the same
    # two keywords as Accelerate's MultiProcessAdapter.log
    def log(  # type: ignore[override]
        self, level: int, msg: Any, *args: Any, main_process_only: bool = True, in_order: bool = False, **kwargs: Any
    ) -> None:
        if not self.isEnabledFor(level):
            return
        rank, _, world = _rank()
        prefix = f"[RANK {rank}] " if world > 1 else ""
        if in_order and world > 1:
            from accel.active import active_kernel

            kernel = active_kernel()
            for i in range(world):
                if i == rank:
                    self.logger.log(level, prefix + str(msg), *args, **kwargs)
                if kernel is not None:
                    kernel.wait_for_everyone()
            return
        if main_process_only and rank != 0:
            return
        self.logger.log(level, prefix + str(msg), *args, **kwargs)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs

    def debug(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.WARNING, msg, *args, **kwargs)

    def error(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.ERROR, msg, *args, **kwargs)

    def critical(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.CRITICAL, msg, *args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """A logger for multi-process scripts. The level comes from ``log_level`` or ``ACCEL_LOG_LEVEL``."""
    logger = logging.getLogger(name)
    level = log_level or os.environ.get("ACCEL_LOG_LEVEL")
    if level:
        logger.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})
