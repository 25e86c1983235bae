"""``LocalSGD``: train without gradient synchronisation and average the parameters every N steps."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Protocol

from accel.errors import UsageError

if TYPE_CHECKING:
    import torch


class SGDKernel(Protocol):
    """What ``LocalSGD`` uses of the Kernel (:class:`accel.Kernel` is one)."""

    @property
    def num_processes(self) -> int: ...

    @property
    def components(self) -> list[Any]: ...

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[None]: ...

    def wait_for_everyone(self) -> None: ...

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any: ...


#: The capability a strategy component lists in ``provides`` when every process holds a full replica of the
#: model's parameters (so averaging them across processes is meaningful).
CAPABILITY = "local_sgd"


class LocalSGD:
    """``with LocalSGD(kernel, model, local_sgd_steps=8) as local_sgd:`` ... ``local_sgd.step()`` after each
    optimizer step. Inside, the model's gradient synchronisation is off (``kernel.no_sync``); every
    ``local_sgd_steps`` steps, and when the block ends, the parameters are averaged across processes. Disabled
    (a no-op) with one process or ``enabled=False``. Accelerate's class, same arguments."""

    def __init__(self, accelerator: SGDKernel, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True):
        if local_sgd_steps < 1:
            raise UsageError(f"LocalSGD(local_sgd_steps={local_sgd_steps}): must be at least 1")
        distributed = accelerator.num_processes > 1
        if distributed and not any(CAPABILITY in c.provides for c in accelerator.components if c.role == "strategy"):
            strategy = next((c.name for c in accelerator.components if c.role == "strategy"), "none")
            raise UsageError(
                f"LocalSGD averages full parameter replicas; the active strategy ({strategy}) does not "
                f"keep one per process (it provides no {CAPABILITY!r}); use the ddp plugin"
            )
        self.enabled = enabled and distributed
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self._no_sync: contextlib.ExitStack | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            with contextlib.ExitStack() as stack:
                stack.enter_context(self.accelerator.no_sync(self.model))
                self._no_sync = stack.pop_all()
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if self.enabled and self._no_sync is not None:
            stack, self._no_sync = self._no_sync, None
            try:
                if kind is None:  # after a failure the other processes may never arrive: no collective then
                    self._sync_and_avg_model_params()
            finally:
                stack.__exit__(kind, value, traceback)

    def step(self) -> None:
        """Count one step; average the parameters every ``local_sgd_steps`` steps."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._sync_and_avg_model_params()

    def _sync_and_avg_model_params(self) -> None:
        import torch

        kernel = self.accelerator
        kernel.wait_for_everyone()
        with torch.no_grad():
            for param in self.model.parameters():
                param.data = kernel.reduce(param.data, reduction="mean")
