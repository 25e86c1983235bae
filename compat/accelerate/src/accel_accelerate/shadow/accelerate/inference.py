"""``accelerate.inference``: ``prepare_pippy`` is there to import, and refuses in one line when called (accel has no
pipeline parallelism)."""

from __future__ import annotations

from typing import Any

from accel.errors import UsageError


def prepare_pippy(model: Any, *args: Any, **kwargs: Any) -> Any:
    raise UsageError("prepare_pippy: accel has no pipeline parallelism (docs/parallelism.md)")


__all__ = ["prepare_pippy"]
