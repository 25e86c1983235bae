"""``accelerate.utils.environment``: reading flags from the environment."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    value = value.lower()
    if value in ("y", "yes", "t", "true", "on", "1"):
        return True if to_bool else 1
    if value in ("n", "no", "f", "false", "off", "0"):
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}")


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    return bool(str_to_bool(os.environ.get(key, str(default))))


def get_int_from_env(env_keys: list[str], default: int) -> int:
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set the upper-cased variables for the block, then restore what was there (accel's ``launchers.environment``)."""
    from accel.launchers import environment

    with environment({key.upper(): str(value) for key, value in kwargs.items()}):
        yield
