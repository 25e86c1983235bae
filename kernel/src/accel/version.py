"""The installed accel-kernel's version (``accel.__version__``), read on first use: a package-metadata lookup
scans sys.path. Kept apart from the package's ``__init__`` so that kernel modules need not import the package."""

from __future__ import annotations

import functools


@functools.cache
def kernel_version() -> str:
    """accel-kernel's installed version; ``"0.0.0"`` when running from a source tree without installation. Read
    once per process: every ``save_state`` records it, and the lookup costs about a millisecond."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("accel-kernel")
    except PackageNotFoundError:
        return "0.0.0"
