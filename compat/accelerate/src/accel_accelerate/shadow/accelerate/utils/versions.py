"""``accelerate.utils.versions``: compare an installed package's version."""

from __future__ import annotations

import importlib.metadata
import operator
from typing import Any

from packaging.version import Version

_OPERATIONS = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}


def compare_versions(library_or_version: Any, operation: str, requirement_version: str) -> bool:
    if operation not in _OPERATIONS:
        raise ValueError(f"`operation` must be one of {sorted(_OPERATIONS)}, got {operation!r}")
    version = library_or_version
    if isinstance(version, str) and not version[:1].isdigit():
        version = importlib.metadata.version(version)
    return bool(_OPERATIONS[operation](Version(str(version)), Version(requirement_version)))


def is_torch_version(operation: str, version: str) -> bool:
    import torch

    return compare_versions(Version(torch.__version__).base_version, operation, version)
