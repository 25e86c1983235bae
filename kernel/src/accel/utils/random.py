"""``set_seed``: one seed for Python's ``random``, numpy (when installed) and torch on every device;
``synchronize_rng_states``: process 0's generator states on every process."""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from accel.errors import UsageError

if TYPE_CHECKING:
    import torch


#: Accelerate's ``RNGType`` values: ``"torch"`` (the CPU generator), ``"generator"`` (the one passed) and device types.
RNG_TYPES = ("torch", "generator", "cuda", "xla", "mlu", "sdaa", "musa", "npu", "xpu", "hpu", "neuron")


def rng_kinds(rng_types: Iterable[Any]) -> list[str]:
    """``synchronize_rng_states``'s ``rng_types`` as names; a UsageError for one Accelerate does not have."""
    kinds = [str(getattr(kind, "value", kind)) for kind in ([rng_types] if isinstance(rng_types, str) else rng_types)]
    unknown = [kind for kind in kinds if kind not in RNG_TYPES]
    if unknown:
        raise UsageError(f"synchronize_rng_states: unknown rng_types {unknown}; known: {', '.join(RNG_TYPES)}")
    return kinds


def process_index() -> int:
    """This process's index in the run: from the active Kernel, else from the launcher's ``RANK``."""
    from accel.active import active_kernel

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


def synchronize_rng_states(rng_types: Iterable[Any], generator: torch.Generator | None = None) -> None:
    """Accelerate's ``synchronize_rng_states``: every process takes process 0's state of each generator named in
    ``rng_types`` (names or Accelerate's ``RNGType``): ``"torch"`` (the CPU generator), ``"generator"``
    (``generator``, which must be given), or the run's device type such as ``"cuda"`` (the default generator of
    this process's device; another device type is refused, as Accelerate fails on it). Call it on every process,
    after ``Kernel()`` (:meth:`accel.Kernel.synchronize_rng_states`); on one process it changes nothing."""
    from accel.active import active_kernel

    kernel = active_kernel()
    if kernel is not None:
        kernel.synchronize_rng_states(rng_types, generator)
        return
    rng_kinds(rng_types)
    if int(os.environ.get("WORLD_SIZE") or 1) > 1:
        raise UsageError("synchronize_rng_states needs the run's processes connected: create the Kernel first")
