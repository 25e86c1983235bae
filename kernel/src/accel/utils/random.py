"""``set_seed``: one seed for Python's ``random``, numpy (when installed) and torch on every device."""

from __future__ import annotations

import os
import random


def process_index() -> int:
    """This process's index in the run: from the active Kernel, else from the launcher's ``RANK``."""
    from accel.kernel import active_kernel

    kernel = active_kernel()
    return kernel.process_index if kernel is not None else int(os.environ.get("RANK") or 0)


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed ``random``, ``numpy.random`` (if numpy is installed) and torch (the CPU generator and every
    accelerator torch knows: ``torch.manual_seed`` seeds them all). ``device_specific`` adds the process index, so
    each process draws differently; ``deterministic`` calls ``torch.use_deterministic_algorithms(True)``."""
    import torch

    if device_specific:
        seed += process_index()
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
