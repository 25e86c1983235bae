"""``save_state`` reached by the main process alone: Accelerate's (and every diffusers training script's)
``if accelerator.is_main_process: accelerator.save_state(path)``.

Every process entering ``save_state`` first meets the others through the process group's key-value store (the
c10d store behind ``torch.distributed``'s default group; no collective): each process other than the main one sets a
key numbered by how often it called save_state (not by the target, which may differ per process), then reads the main process's decision; the main
process waits at most ``save_join_timeout`` seconds for those keys (:data:`REFUSE_FACTOR` times as long where its
being alone is refused) and decides:

- ``"all"``: every process came; the collective save follows (atomic publish, kill -9 safety, asynchronous saves);
- ``"solo"``: it is alone and the run's state is replicated (no plugin implements ``accel_save_state``): it writes
  everything shared plus its own per-process items, and publishes, with no collective; a late process learns the
  decision from the store and writes nothing;
- refused: it is alone and a plugin writes state itself (a sharded strategy, whose save is a collective), or the save
  numbers its checkpoint automatically (collective in Accelerate too): every process that came raises one line.

A run without a c10d store (one process, or a strategy whose collectives are not torch.distributed's) skips the
meeting and saves collectively, as before.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import TYPE_CHECKING, Any

from accel.checkpoint.items import _component_name
from accel.errors import UsageError
from accel.options import KERNEL

if TYPE_CHECKING:
    from accel.checkpoint.items import CheckpointKernel

ALL, SOLO, REFUSED = "all", "solo", "refused:"
#: where being alone is refused, the main process waits this many join windows before it says so
REFUSE_FACTOR = 10
#: save_state calls on this process, numbering the meeting keys (module-wide: keys stay unique across Kernels of one
#: process group). Not keyed by the target: processes may each pass their own directory (Accelerate's test scripts
#: save to a per-process temporary directory), and the collective save writes to the main process's.
_CALLS = itertools.count()


def state_writers(kernel: CheckpointKernel) -> list[str]:
    """The active components other than the kernel that implement ``accel_save_state``: they may claim items and
    write them collectively, so the run's state is not known to be replicated."""
    impls = kernel.plugins.pm.hook.accel_save_state.get_hookimpls()
    return sorted({_component_name(i) for i in impls if not (i.wrapper or i.hookwrapper)} - {KERNEL})


def _default_store() -> Any:
    """The c10d store of torch.distributed's default process group, or None (not initialised)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def meet(kernel: CheckpointKernel, output_dir: str | os.PathLike[str] | None) -> str:
    """How this ``save_state`` goes: :data:`ALL` or :data:`SOLO` (see the module's docstring); raises
    :class:`UsageError` (one line) where the main process is alone and the save must be collective."""
    if kernel.num_processes == 1:
        return ALL
    store = _default_store()
    if store is None:
        return ALL
    base = f"accel/save_state/{next(_CALLS)}"
    window = float(kernel.settings.get("save_join_timeout", 5.0))
    if kernel.is_main_process:
        decision = _decide(kernel, store, base, window, output_dir is None)
        store.set(f"{base}/decision", decision)
    else:
        store.set(f"{base}/{kernel.process_index}", "1")
        try:
            decision = store.get(f"{base}/decision").decode()  # waits for the main process (the store's timeout)
        except RuntimeError as exc:  # torch.distributed.DistStoreError: the main process never came
            raise UsageError(
                f"save_state: process {kernel.process_index} waited for the main process, which did not call it "
                f"({type(exc).__name__}); call save_state on every process, or on the main process alone"
            ) from None
    if decision.startswith(REFUSED):
        raise UsageError(decision[len(REFUSED) :])
    return decision


def _decide(kernel: CheckpointKernel, store: Any, base: str, window: float, automatic: bool) -> str:
    """The main process: wait up to ``window`` seconds for the other processes' keys, or, where being alone is an
    error (a refusal stops the run, a solo save does not), :data:`REFUSE_FACTOR` times as long; then decide."""
    keys = [f"{base}/{rank}" for rank in range(1, kernel.num_processes)]
    writers = state_writers(kernel)
    refuse = bool(writers) or automatic
    waited = window * (REFUSE_FACTOR if refuse else 1)
    if _arrived(store, keys, waited):
        return ALL
    absent = [rank for rank, key in enumerate(keys, 1) if not store.check([key])]
    where = (
        f"save_state: process(es) {', '.join(map(str, absent))} did not call it within {waited:g} s (save_join_timeout)"
    )
    if writers:
        return (
            f"{REFUSED}{where}; save_state is collective under {', '.join(writers)}: call it on every process, not "
            "inside `if is_main_process`"
        )
    if automatic:
        return (
            f"{REFUSED}{where}; with automatic checkpoint naming save_state is collective (as in Accelerate): call "
            "it on every process, not inside `if is_main_process`"
        )
    return SOLO


def _arrived(store: Any, keys: list[str], seconds: float) -> bool:
    """Whether every key is set within ``seconds`` (polling ``store.check``: a timed-out ``store.wait`` prints
    c10d's socket warnings on stderr)."""
    deadline = time.monotonic() + seconds
    pause = 0.0002
    while not store.check(keys):
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    return True
