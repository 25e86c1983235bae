"""Checkpoint items of sharded models and their optimizers: written and read by the plugin API's toolkit
(:mod:`accel.spi.sharded`: DCP directories for ``SHARDED_STATE_DICT``, ``<key>.safetensors``/``<key>.pt`` on the
main process for ``FULL_STATE_DICT``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def SafeReader(path: Path) -> Any:  # noqa: N802 - the kernel's class, built on first use (imports torch)
    """A DCP storage reader that never runs code from the files (see :func:`accel.spi.dcp_load`)."""
    from accel.spi import dcp_reader

    return dcp_reader(path)
