"""``DummyOptim`` / ``DummyScheduler``: stand-ins for the optimizer and scheduler a DeepSpeed config file defines
(its ``optimizer`` / ``scheduler`` sections), with Accelerate's names and arguments. ``prepare()`` builds the real
ones inside the engine from the config; what it returns are the engine's optimizer and (a view of) its scheduler.
The engine steps its scheduler itself at each optimizer step, so ``scheduler.step()`` on the prepared one does
nothing (as Accelerate)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from accel.spi import UsageError

WHY = "stands for the {} of the DeepSpeed config; pass it to kernel.prepare() and use what prepare() returns"


class DummyOptim(torch.optim.Optimizer):
    """``DummyOptim(params, lr=0.001, weight_decay=0, **kwargs)``: the parameters (or parameter groups) for the
    config's ``optimizer`` section; ``lr`` / ``weight_decay`` fill its ``"auto"`` values."""

    def __init__(self, params: Any, lr: float = 0.001, weight_decay: float = 0, **kwargs: Any):
        groups = list(params)
        #: What DeepSpeed gets as ``model_parameters``: the groups as the script gave them (a group without "lr"
        #: takes the config's learning rate, not this class's default).
        self.params = [dict(g) if isinstance(g, dict) else g for g in groups]
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        raise UsageError("DummyOptim " + WHY.format("optimizer"))


class DummyScheduler:
    """``DummyScheduler(optimizer, total_num_steps=None, warmup_num_steps=0, lr_scheduler_callable=None)``: fills
    the ``"auto"`` values of the config's ``scheduler`` section, or (without one) ``lr_scheduler_callable(optimizer)``
    builds the scheduler the engine steps."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int | None = None,
        warmup_num_steps: int = 0,
        lr_scheduler_callable: Callable[[Any], Any] | None = None,
        **kwargs: Any,
    ):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise UsageError("DummyScheduler " + WHY.format("scheduler"))

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def auto_values(self, world_size: int) -> dict[str, Any]:
        """Values for the ``"auto"`` entries of the config's ``scheduler.params`` (Accelerate's rule: the total
        steps the script counted over the whole dataset are divided among the processes)."""
        opt = self.optimizer
        max_lr = opt.defaults["lr"] if getattr(opt, "defaults", None) else getattr(opt, "lr", None)
        values: dict[str, Any] = {
            "warmup_min_lr": 0,
            "warmup_max_lr": max_lr,
            "warmup_num_steps": max(1, self.warmup_num_steps),
        }
        if self.total_num_steps is not None:
            values["total_num_steps"] = math.ceil(self.total_num_steps / world_size)
        return values


class EngineScheduler:
    """What ``prepare()`` returns for a ``DummyScheduler``: the engine's own scheduler, which the engine steps at
    each applied optimizer step; ``step()`` here does nothing (the kernel calls it once per optimizer step)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.optimizer = engine.basic_optimizer

    @property
    def scheduler(self) -> Any:
        return self.engine.lr_scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        inner = self.scheduler
        if inner is not None and hasattr(inner, "get_last_lr"):
            return list(inner.get_last_lr())
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        inner = self.scheduler
        return inner.state_dict() if inner is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scheduler is not None and state_dict:
            self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name in ("engine", "optimizer"):
            raise AttributeError(name)
        return getattr(self.engine.lr_scheduler, name)


def prune_scheduler(scheduler: Any, kept: list[int], before: int) -> None:
    """After DeepSpeed dropped the empty parameter groups of an optimizer (keeping groups ``kept`` of ``before``),
    drop the same entries from every per-group list of a scheduler built on it (``base_lrs``, ``_last_lr``,
    ``lr_lambdas``, ``max_lrs``, ...), and of the schedulers it chains, so it keeps stepping."""
    for name, value in list(vars(scheduler).items()):
        if isinstance(value, (list, tuple)) and len(value) == before:
            setattr(scheduler, name, type(value)(value[i] for i in kept))
    for child in getattr(scheduler, "_schedulers", None) or ():
        prune_scheduler(child, kept, before)
