"""The objects ``Kernel.prepare`` hands back around the user's: the optimizer and scheduler wrappers, the
autocast module wrapper and the accumulation context (re-exported by :mod:`accel.kernel`)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from accel.data import DataKernel
from accel.errors import UsageError
from accel.nested import map_tensors

if TYPE_CHECKING:
    from accel.dispatch import HotHooks


class StepKernel(DataKernel, Protocol):
    """What the prepared objects use of the Kernel beyond :class:`accel.data.DataKernel`."""

    _accumulation_steps: int
    _hot: HotHooks
    _inner: dict[int, torch.nn.Module]
    step_scheduler_with_optimizer: bool

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[None]: ...


class _Accumulate:
    """The context ``Kernel.accumulate`` returns (a small class: it runs on every training step, where a generator
    based context manager costs several times more). It reads the kernel's per-step hooks when it is made, so the
    Kernel makes a new one at each ``prepare`` (which resolves them again)."""

    __slots__ = ("kernel", "models", "stack", "state", "skip_sync")

    def __init__(self, kernel: StepKernel, models: tuple[torch.nn.Module, ...]):
        self.kernel, self.models, self.state = kernel, models, kernel.gradient_state
        #: whether the steps that do not synchronise enter the strategy's ``no_sync`` (nothing to enter where only
        #: the kernel's null context answers it, or for no model)
        self.skip_sync = bool(models) and kernel._hot.no_sync_needed
        #: what was entered on this step: the strategy's ``no_sync`` context of the one model, or an ExitStack of
        #: several models' contexts (``Kernel.no_sync`` made directly, without its generator-based wrapper)
        self.stack: contextlib.AbstractContextManager[Any] | None = None

    def __enter__(self) -> None:
        state = self.state
        if state.end_of_dataloader:  # the epoch's last batch always synchronises, and starts the count again
            state.step = 0
            state.sync_gradients = True
            return
        step = state.step = state.step + 1
        sync = state.sync_gradients = step % self.kernel._accumulation_steps == 0
        if not sync and self.skip_sync:
            self._enter_no_sync()

    def _enter_no_sync(self) -> None:
        kernel = self.kernel
        no_sync, inner = kernel._hot.no_sync, kernel._inner
        if len(self.models) == 1:
            model = self.models[0]
            context = no_sync(kernel=kernel, model=inner.get(id(model), model))
            context.__enter__()
            self.stack = context
            return
        with contextlib.ExitStack() as stack:  # closes what was entered if a later no_sync fails
            for model in self.models:
                stack.enter_context(no_sync(kernel=kernel, model=inner.get(id(model), model)))
            self.stack = stack.pop_all()

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> bool:
        stack = self.stack
        if stack is None:
            return False
        self.stack = None
        return bool(stack.__exit__(kind, value, traceback))


class PreparedOptimizer(torch.optim.Optimizer):
    """Wraps a user optimizer: ``step`` and ``zero_grad`` act only on steps that sync gradients, and go through the
    active plugins (grad scaler, DeepSpeed engine, ...). ``step_was_skipped`` tells whether the last step was
    skipped (inf/NaN gradients). Every other attribute is the wrapped optimizer's, read and written through (a
    schedule-free optimizer's ``train()``/``eval()``, ``optimizer.foo = x``)."""

    def __init__(self, kernel: StepKernel, optimizer: torch.optim.Optimizer):  # noqa: D107 - no super().__init__ on purpose
        own = self.__dict__
        own["optimizer"] = optimizer
        own["kernel"] = kernel
        own["gradient_state"] = kernel.gradient_state  # read on every step: one attribute away, not two
        own["step_was_skipped"] = False

    def __getattr__(self, name: str) -> Any:  # only called for names the wrapper does not have
        if name in _PREPARED_OPTIMIZER_OWN:
            raise AttributeError(name)
        return getattr(self.__dict__["optimizer"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _PREPARED_OPTIMIZER_OWN or hasattr(type(self), name):  # the wrapper's own (step, state, ...)
            object.__setattr__(self, name, value)
        else:
            setattr(self.__dict__["optimizer"], name, value)

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__:
            object.__delattr__(self, name)
        else:
            delattr(self.__dict__["optimizer"], name)

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> Any:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> Any:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: Any) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self.gradient_state.sync_gradients:
            return
        kernel = self.kernel
        if kernel._hot.plain_optimizer:  # only the kernel's default answers: its call, made here
            if set_to_none:
                self.optimizer.zero_grad()  # the default: a call without keywords is cheaper on every step
            else:
                self.optimizer.zero_grad(set_to_none=False)
        else:
            kernel._hot.zero_grad(kernel=kernel, optimizer=self.optimizer, set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        if not self.gradient_state.sync_gradients:
            return
        if closure is not None:
            raise UsageError("optimizer.step(closure) is not supported by prepared optimizers; call the closure first")
        kernel = self.kernel
        if kernel._hot.plain_optimizer:  # only the kernel's default answers: its call, made here
            self.optimizer.step()
            if self.step_was_skipped:  # (a store through __setattr__ costs a Python call: only when it changes)
                self.__dict__["step_was_skipped"] = False
        else:
            self.__dict__["step_was_skipped"] = (
                kernel._hot.optimizer_step(kernel=kernel, optimizer=self.optimizer) is False
            )

    def __repr__(self) -> str:
        return f"Prepared{self.optimizer!r}"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


_PREPARED_OPTIMIZER_OWN = frozenset({"optimizer", "kernel", "gradient_state", "step_was_skipped"})


def _forward_to_optimizer(name: str) -> Callable[..., Any]:
    def forward(self: PreparedOptimizer, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.optimizer, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    return forward


# torch.optim.Optimizer's other public methods (hook registration, ...) act on the wrapped optimizer: the wrapper
# never ran Optimizer.__init__, so it has none of the state they would touch on itself.
for _name, _value in vars(torch.optim.Optimizer).items():
    if not _name.startswith("_") and inspect.isfunction(_value) and _name not in vars(PreparedOptimizer):
        setattr(PreparedOptimizer, _name, _forward_to_optimizer(_name))


class PreparedScheduler:
    """Wraps an LR scheduler so it steps as it does under Accelerate (``scheduler_steps="accelerate"``, the
    default): a scheduler built for ``len(dataloader) * epochs`` batches *before* ``prepare`` ends on time.

    - It steps only when the optimizer stepped: not on accumulation steps (there it only counts ``_step_count``,
      as Accelerate's ``adjust_scheduler`` does) and not after a step skipped for inf/NaN gradients.
    - On a step it steps ``num_processes`` times, since each process saw ``1/num_processes`` of the batches the
      schedule was built from; once with ``split_batches`` (the batches are split, not dealt). A scheduler with
      ``total_steps`` (``OneCycleLR``) stops at its end instead of raising.
    - ``Kernel(step_scheduler_with_optimizer=False)``: every call steps once, as written.

    ``scheduler_steps="per_optimizer_step"`` steps once per optimizer step whatever the number of processes: a
    schedule counted in optimizer steps (``num_training_steps`` from the prepared dataloader's length). Every other
    attribute is the wrapped scheduler's, read and written through."""

    def __init__(self, kernel: StepKernel, scheduler: Any, optimizers: Sequence[PreparedOptimizer]):
        own = self.__dict__
        own["scheduler"] = scheduler
        own["kernel"] = kernel
        inner = getattr(scheduler, "optimizer", None)
        own["optimizers"] = [o for o in optimizers if o.optimizer is inner] or list(optimizers)
        per_optimizer_step = kernel.settings["scheduler_steps"] == "per_optimizer_step"
        #: scheduler steps per optimizer step; Accelerate's rule also counts accumulation steps in _step_count
        own["_repeat"] = 1 if (per_optimizer_step or kernel.split_batches) else kernel.data_parallel_size
        own["_count_accumulation"] = not per_optimizer_step and kernel._data.adjust_scheduler
        own["_limited"] = hasattr(scheduler, "total_steps")  # OneCycleLR: raises when stepped past its end

    def step(self, *args: Any, **kwargs: Any) -> None:
        kernel = self.kernel
        scheduler = self.scheduler
        if not kernel.step_scheduler_with_optimizer:
            scheduler.step(*args, **kwargs)
            return
        if not kernel.gradient_state.sync_gradients:
            if self._count_accumulation and hasattr(scheduler, "_step_count"):
                scheduler._step_count += 1
            return
        for optimizer in self.optimizers:
            if optimizer.step_was_skipped:
                return
        repeat = self._repeat
        if repeat == 1 and not self._limited:
            scheduler.step(*args, **kwargs)
            return
        for _ in range(repeat):
            if self._limited and scheduler._step_count > scheduler.total_steps:
                break  # OneCycleLR raises past its last step; Accelerate stops it there
            scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # only called for names the wrapper does not have
        if name in ("scheduler", "kernel", "optimizers"):
            raise AttributeError(name)
        return getattr(self.__dict__["scheduler"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__ or hasattr(type(self), name):
            object.__setattr__(self, name, value)
        else:
            setattr(self.__dict__["scheduler"], name, value)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)


class AutocastModule(torch.nn.Module):
    """Runs the wrapped module's forward under the precision plugin's autocast and returns float outputs in fp32.
    ``unwrap_model`` returns the user's module without it."""

    def __init__(self, module: torch.nn.Module, context: Callable[[], contextlib.AbstractContextManager[Any]]):
        super().__init__()
        self.module = module
        self._context = context

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # runs on every forward: the module from _modules directly (``self.module`` would go through two Python
        # __getattr__ calls)
        with self._context():
            out = self._modules["module"](*args, **kwargs)  # type: ignore[misc]  # set in __init__, never None
        return _to_fp32(out)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)


_HALF = frozenset((torch.float16, torch.bfloat16))


def _half_to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _HALF else t


def _to_fp32(obj: Any) -> Any:
    """Half-precision float tensors of a nested output (named tuples included) cast to fp32; a tensor output (the
    common case, on every forward) without map_tensors' walk of a structure."""
    return _half_to_fp32(obj) if type(obj) is torch.Tensor else map_tensors(_half_to_fp32, obj)


#: What ``prepare`` takes, for its error messages.
PREPARE_TAKES = "prepare takes models, optimizers, DataLoaders and LR schedulers"


def check_prepare_arguments(args: Sequence[Any]) -> None:
    """One-line UsageErrors for what ``prepare`` would otherwise pass through silently although it cannot be meant:
    ``None`` alone (``None`` among other objects passes, as in Accelerate: an optional scheduler), a tensor, an
    iterator or generator (it would be used up by the first epoch and never sharded), the same object twice."""
    import collections.abc

    from torch.utils.data import DataLoader, Dataset

    if args and all(obj is None for obj in args):
        raise UsageError(f"kernel.prepare() got only None; {PREPARE_TAKES}")
    seen: dict[int, int] = {}
    for position, obj in enumerate(args, 1):
        where = f"kernel.prepare() argument {position}"
        if isinstance(obj, torch.Tensor):
            raise UsageError(
                f"{where} is a tensor; {PREPARE_TAKES}; move a tensor with tensor.to(kernel.device), or wrap data in "
                "a Dataset and a DataLoader"
            )
        if isinstance(obj, Dataset):
            raise UsageError(
                f"{where} is a Dataset ({type(obj).__name__}), not a DataLoader; {PREPARE_TAKES}: pass "
                "DataLoader(dataset, batch_size=...) and it is split between processes"
            )
        if isinstance(obj, (list, tuple)) and any(_preparable(x) for x in obj):
            raise UsageError(
                f"{where} is a {type(obj).__name__} of objects to prepare; pass them as separate arguments: "
                "kernel.prepare(*objects), or model, optimizer = kernel.prepare(model, optimizer)"
            )
        if isinstance(obj, collections.abc.Iterator) and not isinstance(obj, DataLoader):
            raise UsageError(
                f"{where} is an iterator ({type(obj).__name__}), which is used up after one pass and cannot be "
                f"split between processes; {PREPARE_TAKES}: pass the DataLoader itself"
            )
        if _preparable(obj):
            first = seen.setdefault(id(obj), position)
            if first != position:
                raise UsageError(
                    f"{where} is the same {type(obj).__name__} object as argument {first}; pass each object once"
                )


def _preparable(obj: Any) -> bool:
    """Whether ``prepare`` takes ``obj`` (a model, optimizer, DataLoader or LR scheduler)."""
    from torch.utils.data import DataLoader

    return isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, DataLoader)) or hasattr(obj, "get_last_lr")


def no_grad_message(loss: Any) -> str:
    """Why ``kernel.backward(loss)`` cannot run, for a loss that is not a tensor that requires grad."""
    if not isinstance(loss, torch.Tensor):
        return f"kernel.backward() needs the loss tensor, got {type(loss).__name__} {loss!r:.40}"
    return (
        "kernel.backward(): the loss does not require grad: it was computed under torch.no_grad() or "
        "torch.inference_mode(), from detached tensors (.item(), .detach()), or from a model with no trainable "
        "parameters; compute it from the model's output with grad enabled"
    )
