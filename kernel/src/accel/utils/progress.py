"""``tqdm``: a progress bar shown on one process per machine (tqdm is optional for the kernel)."""

from __future__ import annotations

import os
from typing import Any

from accel.errors import UsageError


def local_process_index() -> int:
    """This process's index on its machine: from the active Kernel, else from the launcher's ``LOCAL_RANK``."""
    from accel.active import active_kernel  # imports no torch

    kernel = active_kernel()
    return kernel.local_process_index if kernel is not None else int(os.environ.get("LOCAL_RANK") or 0)


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm(*args, **kwargs)``, disabled on every process but the local main one when
    ``main_process_only`` (as Accelerate's ``accelerate.utils.tqdm``)."""
    try:
        from tqdm.auto import tqdm as progress_bar
    except ImportError:
        raise UsageError("accel.utils.tqdm needs the tqdm package: pip install tqdm") from None
    if args and isinstance(args[0], bool):
        raise UsageError("accel.utils.tqdm: pass main_process_only=True/False as a keyword, not as the first argument")
    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        disable = local_process_index() != 0
    return progress_bar(*args, **kwargs, disable=disable)
