"""What ``kernel.prepare(...)`` does with its arguments, and the objects it returned: the part of a Kernel that sorts
the arguments into models, optimizers, schedulers and dataloaders, asks the plugins to prepare them
(``accel_transform_model``, ``accel_prepare_training``, ``accel_prepare_dataloader``), wraps what they return
(autocast, :class:`~accel.prepared.PreparedOptimizer`, :class:`~accel.prepared.PreparedScheduler`) and remembers it,
so that ``unwrap_model``, checkpoints and ``free_memory`` find every prepared object and the script's own module.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from accel.data import PreparedDataLoader, skip_first_batches
from accel.data_arguments import check_bool
from accel.errors import UsageError, user_stacklevel
from accel.prepared import AutocastModule, PreparedOptimizer, PreparedScheduler, StepKernel

if TYPE_CHECKING:
    from accel.plugins import Plugins


class JoiningKernel(Protocol):
    """What ``join_uneven_inputs`` reads of the Kernel."""

    even_batches: bool
    _inner: dict[int, torch.nn.Module]
    _dataloaders: list[PreparedDataLoader]
    _join_uneven: bool

    @property
    def num_processes(self) -> int: ...


class PreparingKernel(StepKernel, Protocol):
    """What preparing reads of the Kernel beyond :class:`accel.prepared.StepKernel`."""

    plugins: Plugins
    _autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None
    _loader_check_due: bool

    def prepare(self, *args: Any, device_placement: bool = True) -> Any: ...


#: The models any Kernel of this process returned wrapped (not the script's own object) -> the script's model: never
#: wrapped again; ``unwrap_model`` of any Kernel finds the script's model.
WRAPPED_MODELS: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


class Prepared:
    """The objects one Kernel's ``prepare`` returned, in the order prepared, and what each wraps."""

    def __init__(self, kernel: PreparingKernel) -> None:
        self.kernel = kernel
        self.models: list[torch.nn.Module] = []
        self.optimizers: list[PreparedOptimizer] = []
        self.schedulers: list[PreparedScheduler] = []
        self.dataloaders: list[PreparedDataLoader] = []
        self.originals: dict[int, torch.nn.Module] = {}  # prepared model -> the user's module
        self.inner: dict[int, torch.nn.Module] = {}  # prepared model -> what the strategy returned
        self.passed_loaders: set[int] = set()  # ids of the DataLoaders given to prepare

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(o.step_was_skipped for o in self.optimizers)

    def knows(self, obj: Any) -> bool:
        """Whether ``prepare`` returned ``obj`` before."""
        return any(
            obj is known
            for group in (self.models, self.optimizers, self.schedulers, self.dataloaders)
            for known in group
        )

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """``kernel.prepare`` of one model (Accelerate's name)."""
        return self.kernel.prepare(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        """``kernel.prepare`` of one optimizer (Accelerate's name)."""
        return self.kernel.prepare(optimizer)

    def prepare_data_loader(self, dataloader: Any) -> Any:
        """``kernel.prepare`` of one data loader (Accelerate's name)."""
        return self.kernel.prepare(dataloader)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """``kernel.prepare`` of one scheduler (Accelerate's name)."""
        return self.kernel.prepare(scheduler)

    def model_init_context(self) -> contextlib.AbstractContextManager[Any]:
        """The context to build models in (``with kernel.model_init_context(): model = Net()``): a strategy that
        partitions parameters as they are created (DeepSpeed ZeRO-3 with ``zero3_init_flag``) answers it; with
        every other plugin it does nothing."""
        return self.kernel.plugins.pm.hook.accel_model_init_context(kernel=self.kernel)

    def skip_first_batches(self, dataloader: Any, num_batches: int) -> Any:
        """A dataloader whose next pass starts at batch ``num_batches``; skipped batches are not loaded."""
        return skip_first_batches(dataloader, num_batches)

    def warn_unprepared_loaders(self) -> None:
        """Once, at the first ``backward`` or ``gather_for_metrics`` of a run of several processes (see
        :func:`warn_unprepared_loaders`)."""
        kernel = self.kernel
        kernel._loader_check_due = False
        if kernel.is_main_process:
            warn_unprepared_loaders(self.passed_loaders, kernel.num_processes)

    def prepare(self, args: Sequence[Any], device_placement: bool) -> Any:
        """``kernel.prepare(*args)``: each argument prepared by the plugins (or passed through), in order."""
        from torch.utils.data import DataLoader

        kernel = self.kernel
        hook = kernel.plugins.pm.hook
        kinds: list[str] = []
        models, optimizers, schedulers, dataloaders = [], [], [], []
        for position, obj in enumerate(args, 1):
            if self.knows(obj):  # prepared before (by this kernel): returned as it is, never wrapped twice
                kinds.append("other")
            elif obj in WRAPPED_MODELS:
                raise UsageError(
                    f"kernel.prepare() argument {position} is a model another Kernel prepared already (a "
                    f"{type(obj).__name__} around it); wrapping it again would run it twice over; prepare the "
                    "original model once, or pass kernel.unwrap_model(model) to this Kernel"
                )
            elif isinstance(obj, torch.nn.Module):
                kinds.append("model")
                models.append(obj)
            elif isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, PreparedOptimizer):
                kinds.append("optimizer")
                optimizers.append(obj)
            elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
                hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "get_last_lr")
            ):
                kinds.append("scheduler")
                schedulers.append(obj)
            elif isinstance(obj, DataLoader):
                kinds.append("dataloader")
                dataloaders.append(obj)
                self.passed_loaders.add(id(obj))
            else:
                kinds.append("other")
        for model in models:
            hook.accel_transform_model(kernel=kernel, model=model)
        w_models, w_opts, w_scheds = hook.accel_prepare_training(
            kernel=kernel, models=models, optimizers=optimizers, schedulers=schedulers, dataloaders=dataloaders
        )
        if not (len(w_models), len(w_opts), len(w_scheds)) == (len(models), len(optimizers), len(schedulers)):
            raise RuntimeError("accel_prepare_training returned lists of the wrong length")
        autocast = kernel._autocast
        for original, inner in zip(models, w_models, strict=True):
            wrapped = AutocastModule(inner, autocast) if autocast is not None else inner
            self.originals[id(wrapped)] = original
            if wrapped is not original:
                WRAPPED_MODELS[wrapped] = original
            self.inner[id(wrapped)] = inner
            self.models.append(wrapped)
        prepared_opts = [PreparedOptimizer(kernel, o) for o in w_opts]
        self.optimizers.extend(prepared_opts)
        prepared_scheds = [PreparedScheduler(kernel, s, self.optimizers) for s in w_scheds]
        self.schedulers.extend(prepared_scheds)
        queues = {
            "model": iter(self.models[len(self.models) - len(models) :]),
            "optimizer": iter(prepared_opts),
            "scheduler": iter(prepared_scheds),
        }
        out = []
        for obj, kind in zip(args, kinds, strict=True):
            if kind == "dataloader":
                loader = hook.accel_prepare_dataloader(kernel=kernel, dataloader=obj)
                if isinstance(loader, PreparedDataLoader):
                    loader.device_placement = device_placement
                self.dataloaders.append(loader)
                out.append(loader)
            elif kind == "other":
                out.append(obj)
            else:
                out.append(next(queues[kind]))
        return out[0] if len(out) == 1 else tuple(out)

    def unwrap_model(self, model: torch.nn.Module, keep_torch_compile: bool = True) -> torch.nn.Module:
        """The module the script passed to ``prepare`` for this prepared model: that very object, whatever wrapper
        the strategy and the autocast returned around it (an object ``prepare`` did not return is returned as it is).
        ``keep_torch_compile=False`` also strips ``torch.compile``'s wrapper."""
        original = self.originals.get(id(model))
        if original is None:  # another Kernel's (or no Kernel's) model
            original = WRAPPED_MODELS.get(model, model)
        if not keep_torch_compile and hasattr(original, "_orig_mod"):
            original = cast(torch.nn.Module, original._orig_mod)
        return original

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget the prepared objects, collect garbage and empty the device cache. Returns ``[None] * len(objects)``
        so ``model, opt = kernel.free_memory(model, opt)`` drops the caller's references too."""
        for group in (self.models, self.optimizers, self.schedulers, self.dataloaders, self.originals, self.inner):
            group.clear()
        gc.collect()
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and accelerator.is_available():
            memory = getattr(accelerator, "memory", None)
            empty = getattr(memory, "empty_cache", None) if memory is not None else None
            if empty is not None:
                empty()
        return [None] * len(objects)


def warn_unprepared_loaders(passed: set[int], num_processes: int) -> None:
    """A torch DataLoader held by the calling frames (the training loop and its callers) that never went through
    ``prepare`` (its id not in ``passed``) and has no DistributedSampler gives every process the whole dataset: one
    warning naming it. Loaders of iterable datasets are left out (they may shard themselves)."""
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

    def unsharded(value: Any) -> bool:
        samplers = (
            getattr(value, "sampler", None),
            getattr(getattr(value, "batch_sampler", None), "sampler", None),
        )
        return (
            isinstance(value, DataLoader)
            and id(value) not in passed
            and not isinstance(value.dataset, IterableDataset)
            and not any(isinstance(s, DistributedSampler) for s in samplers)
        )

    names: dict[str, None] = {}
    frame: Any = sys._getframe(1)
    while frame is not None:
        if not str(frame.f_globals.get("__name__", "")).startswith("accel."):
            names.update((name, None) for name, value in list(frame.f_locals.items()) if unsharded(value))
        frame = frame.f_back
    if names:
        listed = ", ".join(f"`{n}`" for n in names)
        warnings.warn(
            f"DataLoader {listed} did not go through kernel.prepare(): each of the {num_processes} "
            "processes iterates its whole dataset (the same batches everywhere, an epoch "
            f"{num_processes}x too long); pass it to kernel.prepare() to give each process its own shard",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


@contextlib.contextmanager
def join_uneven_inputs(
    kernel: JoiningKernel, joinables: Sequence[Any], even_batches: bool | None = None
) -> Iterator[None]:
    """Train or evaluate on uneven inputs through torch's ``Join`` (Accelerate's; ``kernel.join_uneven_inputs``): with
    ``even_batches=False`` (the argument, else the Kernel's) a process that runs out of batches stops its passes over
    the prepared dataloaders instead of getting empty batches, and ``Join`` shadows the collectives of ``joinables``
    (prepared models of a strategy whose model torch can join: DDP) until every process is done, so none waits
    forever. With even batches, or one process, it changes nothing."""
    from torch.distributed.algorithms import Join, Joinable

    if even_batches is not None:
        check_bool("join_uneven_inputs(even_batches=...)", even_batches)
    uneven = not (kernel.even_batches if even_batches is None else even_batches)
    if kernel.num_processes == 1 or not uneven:
        yield
        return
    inner = [kernel._inner.get(id(obj), obj) for obj in joinables]
    for obj, joinable in zip(joinables, inner, strict=True):
        if not isinstance(joinable, Joinable):
            raise UsageError(
                f"join_uneven_inputs: {type(obj).__name__} is not something torch's Join can shadow (a "
                "torch.distributed.algorithms.Joinable); pass the models prepare returned, in a run whose "
                "strategy makes them joinable (data parallel: --plugin ddp)"
            )
    loaders = [dl for dl in kernel._dataloaders if dl.set_even_batches(False) is not None]
    if len(loaders) < len(kernel._dataloaders) and kernel.even_batches:
        warnings.warn(
            "join_uneven_inputs(even_batches=False): overriding even_batches is only supported for map-style "
            "datasets; dataloaders over an IterableDataset keep even batches (Accelerate's warning)",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    kernel._join_uneven = True
    try:
        with Join(inner, throw_on_early_termination=False):
            yield
    finally:
        kernel._join_uneven = False
        for dl in loaders:
            dl.set_even_batches(kernel.even_batches)
