"""The Kernel: one training loop for one process or many, whatever plugins are installed.

Everything backend-specific is asked of the active plugins through the hooks in :mod:`accel.hookspecs`; the
kernel only keeps the bookkeeping every backend shares (gradient accumulation, dataloader state, collectives on
nested structures, the objects it prepared).
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import functools
import gc
import inspect
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from accel.compat import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    argument_refusal,
    check_bool,
    member_message,
    resolve_data_settings,
)
from accel.contract import Topology
from accel.data import PreparedDataLoader, skip_first_batches
from accel.dispatch import HotHooks
from accel.errors import UsageError
from accel.options import KERNEL, Settings, did_you_mean, int_env, resolve
from accel.plugins import Plugins
from accel.project import ProjectConfiguration, check_project_config, configure_project
from accel.tracking import TrackingMixin, user_stacklevel

#: Keyword arguments of ``Kernel(...)`` that are options of the kernel (plugins may declare more).
_ARGUMENTS = ("mixed_precision", "gradient_accumulation_steps", "cpu", "log_with", "project_dir", "dynamo_backend",
              "plugins")


class GradientState:
    """Shared between the Kernel and its dataloaders: whether this step syncs and where the epoch is."""

    def __init__(self) -> None:
        self.sync_gradients = True
        self.step = 0
        self.active: list[PreparedDataLoader] = []
        #: Whether the innermost dataloader being iterated has handed out its last batch. A plain attribute, kept
        #: up to date by ``enter``/``leave``/``refresh`` (the dataloaders call them), since every step reads it.
        self.end_of_dataloader = False

    def enter(self, loader: PreparedDataLoader) -> None:
        self.active.append(loader)
        self.refresh()

    def leave(self, loader: PreparedDataLoader) -> None:
        if loader in self.active:
            self.active.remove(loader)
        self.refresh()

    def refresh(self) -> None:
        """Read ``end_of_dataloader`` again from the innermost active dataloader (after it changed)."""
        self.end_of_dataloader = bool(self.active) and self.active[-1].end_of_dataloader

    @property
    def remainder(self) -> int:
        return self.active[-1].remainder if self.active else 0


class _Accumulate:
    """The context ``Kernel.accumulate`` returns (a small class: it runs on every training step, where a generator
    based context manager costs several times more)."""

    __slots__ = ("kernel", "models", "stack")

    def __init__(self, kernel: Kernel, models: tuple[torch.nn.Module, ...]):
        self.kernel, self.models = kernel, models
        self.stack: contextlib.ExitStack[bool | None] | None = None

    def __enter__(self) -> None:
        kernel = self.kernel
        state = kernel.gradient_state
        state.step += 1
        end = state.end_of_dataloader
        state.sync_gradients = end or state.step % kernel._accumulation_steps == 0
        if end:
            state.step = 0
        if not state.sync_gradients and self.models and kernel._hot.no_sync_needed:
            with contextlib.ExitStack() as stack:  # closes what was entered if a later no_sync fails
                for model in self.models:
                    stack.enter_context(kernel.no_sync(model))
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

    def __init__(self, kernel: Kernel, optimizer: torch.optim.Optimizer):  # noqa: D107 - no super().__init__ on purpose
        own = self.__dict__
        own["optimizer"] = optimizer
        own["kernel"] = kernel
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
        kernel = self.kernel
        if not kernel.gradient_state.sync_gradients:
            return
        if kernel._hot.plain_optimizer:  # only the kernel's default answers: its call, made here
            if set_to_none:
                self.optimizer.zero_grad()  # the default: a call without keywords is cheaper on every step
            else:
                self.optimizer.zero_grad(set_to_none=False)
        else:
            kernel._hot.zero_grad(kernel=kernel, optimizer=self.optimizer, set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        kernel = self.kernel
        if not kernel.gradient_state.sync_gradients:
            return
        if closure is not None:
            raise UsageError("optimizer.step(closure) is not supported by prepared optimizers; call the closure first")
        if kernel._hot.plain_optimizer:  # only the kernel's default answers: its call, made here
            self.optimizer.step()
            if self.step_was_skipped:  # (a store through __setattr__ costs a Python call: only when it changes)
                self.__dict__["step_was_skipped"] = False
        else:
            self.__dict__["step_was_skipped"] = kernel._hot.optimizer_step(kernel=kernel, optimizer=self.optimizer) is False

    def __repr__(self) -> str:
        return f"Prepared{self.optimizer!r}"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


_PREPARED_OPTIMIZER_OWN = frozenset({"optimizer", "kernel", "step_was_skipped"})


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

    def __init__(self, kernel: Kernel, scheduler: Any, optimizers: Sequence[PreparedOptimizer]):
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
        with self._context():
            out = self.module(*args, **kwargs)
        return _to_fp32(out)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)


def _to_fp32(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in (torch.float16, torch.bfloat16) else obj
    if isinstance(obj, dict):
        return type(obj)({k: _to_fp32(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to_fp32(v) for v in obj)
    return obj


def _recursive(fn: Callable[[torch.Tensor], Any]) -> Callable[[Any], Any]:
    """Apply a tensor function over nested lists/tuples/dicts of tensors."""

    def apply(data: Any) -> Any:
        if isinstance(data, torch.Tensor):
            return fn(data)
        if isinstance(data, Mapping):
            return type(data)({k: apply(v) for k, v in data.items()})  # type: ignore[call-arg]  # dict, OrderedDict...
        if isinstance(data, tuple) and hasattr(data, "_fields"):
            return type(data)(*(apply(v) for v in data))
        if isinstance(data, (list, tuple)):
            return type(data)(apply(v) for v in data)
        raise TypeError(f"expected tensors (or lists/tuples/dicts of tensors), got {type(data).__name__}")

    return apply


class Kernel(TrackingMixin):
    """The training-loop companion. ``Kernel().prepare(model, optimizer, dataloader, scheduler)``, then
    ``kernel.backward(loss)``; the same script runs on one CPU process or many, with any installed plugin.

    Arguments (all optional; ``None`` means "from ``accel launch``/environment/default"):
    ``mixed_precision`` ("no", "fp16", "bf16", "fp8"), ``gradient_accumulation_steps``, ``cpu``, ``log_with``,
    ``project_dir``, ``dynamo_backend``, ``plugins`` (names to select), ``even_batches`` (default True),
    ``extra_plugins`` ((name, module-or-object) pairs registered without entry points, for tests),
    ``project_config`` (:class:`accel.ProjectConfiguration`: checkpoint naming and retention), ``kwargs_handlers``
    (Accelerate's handler objects from :mod:`accel.utils`: their fields set the options plugins declare for them),
    and any option a plugin declares (``Kernel(fsdp_reshard_after_forward=False)``).

    Accelerate's arguments keep their meaning (:mod:`accel.compat`): ``split_batches``, ``dataloader_config``
    (:class:`accel.DataLoaderConfiguration`), ``dispatch_batches``/``use_seedable_sampler`` (accepted where they
    change nothing), ``rng_types`` (``["generator"]`` only), ``device_placement`` (True only),
    ``step_scheduler_with_optimizer``, ``gradient_accumulation_plugin`` (:class:`accel.GradientAccumulationPlugin`),
    and the ``scheduler_steps`` option (``"accelerate"``: Accelerate's rule, default; ``"per_optimizer_step"``). An
    Accelerate argument accel does not have raises one line naming what to use instead.
    """

    def __init__(
        self,
        *,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int | None = None,
        cpu: bool | None = None,
        log_with: str | Sequence[str] | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        dynamo_backend: str | None = None,
        plugins: Sequence[str] | None = None,
        even_batches: bool | None = None,
        extra_plugins: Iterable[tuple[str, Any]] = (),
        project_config: ProjectConfiguration | None = None,
        split_batches: bool | None = None,
        dataloader_config: DataLoaderConfiguration | None = None,
        dispatch_batches: bool | None = None,
        use_seedable_sampler: bool | None = None,
        rng_types: Sequence[Any] | None = None,
        device_placement: bool = True,
        step_scheduler_with_optimizer: bool = True,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        kwargs_handlers: Sequence[Any] | None = None,
        **options: Any,
    ) -> None:
        data, gradient_accumulation_steps = resolve_data_settings(
            split_batches=split_batches, even_batches=even_batches, dataloader_config=dataloader_config,
            rng_types=rng_types, device_placement=device_placement, dispatch_batches=dispatch_batches,
            use_seedable_sampler=use_seedable_sampler, gradient_accumulation_plugin=gradient_accumulation_plugin,
            gradient_accumulation_steps=gradient_accumulation_steps)
        check_bool("Kernel(step_scheduler_with_optimizer=...)", step_scheduler_with_optimizer)
        env = dict(os.environ)
        check_project_config(project_config)
        if project_dir is None and project_config is not None:
            project_dir = project_config.project_dir
        self.plugins = Plugins.load(env=env, extra=extra_plugins)
        declared = self.plugins.options()
        for name in options:
            if name not in declared:
                refusal = argument_refusal(name)
                if refusal:
                    raise UsageError(refusal)
                raise TypeError(f"Kernel() got an unexpected argument {name!r}{did_you_mean(name, [o.name for o in declared])}")
        from accel.utils.handlers import route  # Accelerate's kwargs handlers -> the options plugins declare for them

        handled = route(kwargs_handlers or (), declared, options)
        self.profile_handler = handled.profile
        kwargs = {**handled.options, **options}
        for name, value in (("mixed_precision", mixed_precision), ("gradient_accumulation_steps", gradient_accumulation_steps),
                            ("cpu", cpu), ("dynamo_backend", dynamo_backend), ("plugins", plugins),
                            ("project_dir", None if project_dir is None else os.fspath(project_dir)),
                            ("log_with", [log_with] if isinstance(log_with, str) else log_with)):
            if value is not None:
                kwargs[name] = value
        text = env.get("ACCEL_CONFIG") or "{}"
        try:
            if text.startswith("base64:"):  # launchers that re-quote exported values (pdsh, mpirun) carry it encoded
                text = base64.b64decode(text[len("base64:"):], validate=True).decode()
            launched = json.loads(text)
        except ValueError:
            raise UsageError("environment variable ACCEL_CONFIG is not valid JSON; unset it or launch with accel launch") from None
        values, sources = resolve(declared, env=env, launched=launched, kwargs=kwargs)
        world = int_env(env, "WORLD_SIZE", 1)
        self.settings = Settings(values, sources, world_size=world, phase="run", env=env)
        self._data = data
        self.even_batches = data.even_batches
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self._accumulation_steps = int(self.settings["gradient_accumulation_steps"])
        self.project_configuration = configure_project(project_config, self.settings["project_dir"])
        self._custom_objects: list[Any] = []
        self.gradient_state = GradientState()
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[PreparedOptimizer] = []
        self._schedulers: list[PreparedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []
        self._originals: dict[int, torch.nn.Module] = {}  # prepared model -> the user's module
        self._inner: dict[int, torch.nn.Module] = {}  # prepared model -> what the strategy returned
        self._failed: set[Any] = set()  # plugin names (trackers) and (plugin, hook) pairs that raised
        self._warned: set[str] = set()
        self._torn_down = False
        self._leaders: list[int] | None = None  # gather_for_metrics: the first process of each data shard
        self.plugins.activate(self.settings)
        hook = self.plugins.pm.hook
        hook.accel_setup(kernel=self)
        self.topology: Topology = hook.accel_topology(kernel=self)
        idle = handled.unused(declared, [KERNEL, *(c.name for c in self.plugins.components)])
        if idle and self.is_main_process:
            warnings.warn(idle, UserWarning, stacklevel=user_stacklevel())
        self.device: torch.device = hook.accel_device(kernel=self)
        self.collectives = hook.accel_collectives(kernel=self)
        self._autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = hook.accel_autocast(kernel=self)
        self._hot = HotHooks(self.plugins.pm)  # per-step hooks, resolved once (again at each prepare)
        self._accumulating = _Accumulate(self, ())
        _ACTIVE.append(self)
        atexit.register(self._teardown)

    # ---- settings and topology ----------------------------------------------------------------------------

    @property
    def mixed_precision(self) -> str:
        """The ``mixed_precision`` setting: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``."""
        return self.settings.mixed_precision

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (the script may change it between steps)."""
        return self._accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        """Change the micro-batches per optimizer step between steps, as Accelerate allows (the count of the cycle
        in progress is kept; the loss is divided by the new value from the next ``backward``)."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"gradient_accumulation_steps expects a whole number >= 1, got {value!r}")
        self._accumulation_steps = value

    # Accelerate's dataloader settings, read back under Accelerate's names (see accel.compat).

    @property
    def split_batches(self) -> bool:
        return self._data.split_batches

    @property
    def non_blocking(self) -> bool:
        return self._data.non_blocking

    @property
    def dataloader_config(self) -> DataLoaderConfiguration:
        data = self._data
        return DataLoaderConfiguration(split_batches=data.split_batches, even_batches=self.even_batches,
                                       use_seedable_sampler=True, data_seed=data.data_seed,
                                       non_blocking=data.non_blocking, use_stateful_dataloader=True)

    dispatch_batches = False  # every process reads its own shard
    use_seedable_sampler = True  # shuffling always uses a sampler seeded identically on every process
    use_stateful_dataloader = True  # prepared dataloaders always have state_dict/load_state_dict
    device_placement = True
    rng_types = ("generator",)

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def log_with(self) -> list[str]:
        return list(self.settings["log_with"] or [])

    def __getattr__(self, name: str) -> Any:
        """Accelerate's members that Kernel does not have: one line saying what to use instead."""
        message = member_message(name) if not name.startswith("_") else None
        raise AttributeError(message or f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def project_dir(self) -> str | None:
        """The ``project_dir`` setting: where checkpoints and logs go (``None``: not set)."""
        return self.settings["project_dir"]

    @property
    def num_processes(self) -> int:
        """Processes of the run, over all machines (``topology.num_processes``)."""
        return self.topology.num_processes

    @property
    def process_index(self) -> int:
        """This process's rank, 0 .. ``num_processes - 1`` (``topology.process_index``)."""
        return self.topology.process_index

    @property
    def data_parallel_index(self) -> int:
        """Which data shard this process reads (its process index unless the strategy's topology says otherwise:
        processes of one tensor/context-parallel group read the same shard)."""
        index = self.topology.data_parallel_index
        return self.process_index if index is None else index

    @property
    def data_parallel_size(self) -> int:
        """How many data shards there are (the number of processes unless the strategy's topology says otherwise)."""
        size = self.topology.data_parallel_size
        return self.num_processes if size is None else size

    @property
    def local_process_index(self) -> int:
        return self.topology.local_process_index

    @property
    def is_main_process(self) -> bool:
        """Whether this is process 0 of the run."""
        return self.topology.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.topology.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def components(self) -> list[Any]:
        """The active plugin components, in the order hooks ask them."""
        return list(self.plugins.components)

    @property
    def sync_gradients(self) -> bool:
        """Whether the current step synchronises gradients and steps the optimizer (see ``accumulate``)."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = bool(value)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(o.step_was_skipped for o in self._optimizers)

    def __repr__(self) -> str:
        comps = ", ".join(f"{c.name}:{c.role}" for c in self.plugins.components) or "none"
        return (f"Kernel(process {self.process_index}/{self.num_processes}, device={self.device}, "
                f"mixed_precision={self.mixed_precision}, plugins=[{comps}])")

    # ---- prepare ------------------------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: bool = True) -> Any:
        """Prepare models, optimizers, dataloaders and schedulers (any number, any order) for this run; return
        them in the same order (one object returned as itself). Other objects pass through unchanged."""
        from torch.utils.data import DataLoader

        hook = self.plugins.pm.hook
        self._hot = HotHooks(self.plugins.pm)
        kinds: list[str] = []
        models, optimizers, schedulers, dataloaders = [], [], [], []
        for obj in args:
            if self._is_prepared(obj):  # prepared before (by this kernel): returned as it is, never wrapped twice
                kinds.append("other")
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
            else:
                kinds.append("other")
        for model in models:
            hook.accel_transform_model(kernel=self, model=model)
        w_models, w_opts, w_scheds = hook.accel_prepare_training(
            kernel=self, models=models, optimizers=optimizers, schedulers=schedulers, dataloaders=dataloaders
        )
        if not (len(w_models), len(w_opts), len(w_scheds)) == (len(models), len(optimizers), len(schedulers)):
            raise RuntimeError("accel_prepare_training returned lists of the wrong length")
        for original, inner in zip(models, w_models, strict=True):
            wrapped = AutocastModule(inner, self._autocast) if self._autocast is not None else inner
            self._originals[id(wrapped)] = original
            self._inner[id(wrapped)] = inner
            self._models.append(wrapped)
        prepared_opts = [PreparedOptimizer(self, o) for o in w_opts]
        self._optimizers.extend(prepared_opts)
        prepared_scheds = [PreparedScheduler(self, s, self._optimizers) for s in w_scheds]
        self._schedulers.extend(prepared_scheds)
        queues = {"model": iter(self._models[len(self._models) - len(models):]), "optimizer": iter(prepared_opts),
                  "scheduler": iter(prepared_scheds)}
        out = []
        for obj, kind in zip(args, kinds, strict=True):
            if kind == "dataloader":
                loader = hook.accel_prepare_dataloader(kernel=self, dataloader=obj)
                if isinstance(loader, PreparedDataLoader):
                    loader.device_placement = device_placement
                self._dataloaders.append(loader)
                out.append(loader)
            elif kind == "other":
                out.append(obj)
            else:
                out.append(next(queues[kind]))
        return out[0] if len(out) == 1 else tuple(out)

    def _is_prepared(self, obj: Any) -> bool:
        """Whether ``prepare`` returned ``obj`` before (Accelerate returns such objects as they are, too)."""
        return any(obj is known for group in (self._models, self._optimizers, self._schedulers, self._dataloaders)
                   for known in group)

    def model_init_context(self) -> contextlib.AbstractContextManager[Any]:
        """The context to build models in (``with kernel.model_init_context(): model = Net()``): a strategy that
        partitions parameters as they are created (DeepSpeed ZeRO-3 with ``zero3_init_flag``) answers it; with
        every other plugin it does nothing."""
        return self.plugins.pm.hook.accel_model_init_context(kernel=self)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.prepare(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        return self.prepare(optimizer)

    def prepare_data_loader(self, dataloader: Any) -> Any:
        return self.prepare(dataloader)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        return self.prepare(scheduler)

    def unwrap_model(self, model: torch.nn.Module, keep_torch_compile: bool = True) -> torch.nn.Module:
        """The module the script passed to ``prepare`` for this prepared model: that very object, whatever wrapper
        the strategy and the autocast returned around it (an object ``prepare`` did not return is returned as it is).
        ``keep_torch_compile=False`` also strips ``torch.compile``'s wrapper."""
        original = self._originals.get(id(model), model)
        if not keep_torch_compile and hasattr(original, "_orig_mod"):
            original = cast(torch.nn.Module, original._orig_mod)
        return original

    # ---- training step ------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward through the active plugins (scaler, engine, ...). The loss is divided by
        ``gradient_accumulation_steps`` so accumulated gradients average over micro-batches. Keyword arguments
        (``retain_graph=True``, ``inputs=[...]``) go on to ``Tensor.backward``."""
        hot = self._hot
        if hot.plain_backward:  # only the kernel's default answers: its call, made here
            loss = self.scale_for_accumulation(loss)
            if kwargs:
                loss.backward(**kwargs)
            else:
                loss.backward()  # `**{}` would take the interpreter's slower call path on every step
        else:
            hot.backward(kernel=self, loss=loss, backward_kwargs=kwargs)

    def scale_for_accumulation(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss / gradient_accumulation_steps`` (for plugins answering ``accel_backward``)."""
        steps = self._accumulation_steps
        return loss / steps if steps > 1 else loss

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Skip gradient synchronisation for the backward passes inside (DDP's ``no_sync``)."""
        inner = self._inner.get(id(model), model)
        with self._hot.no_sync(kernel=self, model=inner):
            yield

    def accumulate(self, *models: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """One micro-batch of gradient accumulation: sets ``sync_gradients`` (every
        ``gradient_accumulation_steps``-th step, and on the last batch of an epoch) and skips the gradient
        all-reduce on the other steps. Prepared optimizers and schedulers act only on sync steps."""
        ctx = self._accumulating  # one context per kernel, made again only for other models or while it is in use
        if ctx.stack is None and ctx.models == models:
            return ctx
        ctx = self._accumulating = _Accumulate(self, models)
        return ctx

    def unscale_gradients(self) -> None:
        self._hot.unscale_gradients(kernel=self)

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip by global norm on sync steps and return the norm; on accumulation steps do nothing, return None
        (the local gradients are partial there)."""
        if not self.gradient_state.sync_gradients:
            return None
        self.unscale_gradients()
        return self._hot.clip_grad_norm(
            kernel=self, parameters=list(parameters), max_norm=float(max_norm), norm_type=float(norm_type)
        )

    def clip_grad_value_(self, parameters: Iterable[torch.nn.Parameter], clip_value: float) -> None:
        if not self.gradient_state.sync_gradients:
            return
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context of the active plugins (a no-op without one)."""
        return self._autocast() if self._autocast is not None else contextlib.nullcontext()

    # ---- processes ----------------------------------------------------------------------------------------

    def wait_for_everyone(self) -> None:
        self.collectives.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per machine (on the local main process)."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first (e.g. downloads), then the others."""
        yield from self._first(self.is_main_process)

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        yield from self._first(self.is_local_main_process)

    def _first(self, leader: bool) -> Iterator[None]:
        if not leader:
            self.wait_for_everyone()
        yield
        if leader:
            self.wait_for_everyone()

    def on_main_process(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: run ``fn`` on the main process only (returns None elsewhere)."""
        return self.on_process(fn, process_index=0)

    def on_local_main_process(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.on_local_process(fn, local_process_index=0)

    def on_last_process(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.on_process(fn, process_index=self.num_processes - 1)

    def on_process(self, fn: Callable[..., Any] | None = None, *, process_index: int = 0) -> Any:
        if fn is None:
            return functools.partial(self.on_process, process_index=process_index)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs) if self.process_index == process_index else None

        return run

    def on_local_process(self, fn: Callable[..., Any] | None = None, *, local_process_index: int = 0) -> Any:
        if fn is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs) if self.local_process_index == local_process_index else None

        return run

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Yield this process's contiguous share of a list, tuple, dict of sequences or tensor (the first
        ``len % N`` processes get one more). ``apply_padding`` repeats the last element so all shares are equal."""
        n, r = self.num_processes, self.process_index
        if n == 1:
            yield inputs
            return

        def split(seq: Any) -> Any:
            size, extra = divmod(len(seq), n)
            start = r * size + min(r, extra)
            end = start + size + (1 if r < extra else 0)
            part = seq[start:end]
            if apply_padding and extra and r >= extra:
                pad = seq[-1:]
                part = torch.cat([part, pad]) if isinstance(part, torch.Tensor) else part + type(part)(pad)
            return part

        if isinstance(inputs, Mapping):
            yield type(inputs)({k: split(v) for k, v in inputs.items()})  # type: ignore[call-arg]  # dict, OrderedDict...
        else:
            yield split(inputs)

    # ---- collectives on nested data -----------------------------------------------------------------------

    def gather(self, tensor: Any) -> Any:
        """Gather tensors (or nested structures of them) from all processes and concatenate on dim 0, in process
        order. Works when processes hold different numbers of rows."""
        if self.num_processes == 1:
            return tensor
        return _recursive(self._gather_one)(tensor)

    def _shard_leaders(self) -> list[int]:
        """The first process of each data shard, in shard order (collective the first time)."""
        if self._leaders is None:
            shards = self.collectives.all_gather_object(self.data_parallel_index)
            self._leaders = [shards.index(i) for i in range(self.data_parallel_size)]
        return list(self._leaders)

    def _gather_one(self, tensor: torch.Tensor, keep: list[int] | None = None) -> torch.Tensor:
        if tensor.ndim == 0:
            tensor = tensor[None]
        tensor = tensor.contiguous()
        sizes = [int(s.item()) for s in self.collectives.all_gather(torch.tensor([tensor.shape[0]], device=tensor.device))]
        top = max(sizes)
        if top != tensor.shape[0]:
            pad = tensor.new_zeros((top - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad])
        parts = self.collectives.all_gather(tensor)
        pairs = list(zip(parts, sizes, strict=True))
        return torch.cat([p[:s] for p, s in (pairs if keep is None else [pairs[i] for i in keep])])

    def gather_object(self, obj: Any) -> list[Any]:
        """Gather picklable objects; lists are concatenated, other objects collected in a list."""
        parts = self.collectives.all_gather_object(obj)
        if all(isinstance(p, list) for p in parts):
            return [x for p in parts for x in p]
        return parts

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """``gather`` for evaluation: on the last batch of an epoch, drops the samples that even batching
        duplicated, so the result over an epoch has exactly ``len(dataset)`` items."""
        tensors_only = True
        try:
            _recursive(lambda t: t)(input_data)
        except TypeError:
            tensors_only = False
        if self.data_parallel_size != self.num_processes:  # one process's values per data shard
            keep = self._shard_leaders()
            parts = self.collectives.all_gather_object(input_data) if (use_gather_object or not tensors_only) else None
            if parts is not None:
                parts = [parts[i] for i in keep]
                data = [x for p in parts for x in p] if all(isinstance(p, list) for p in parts) else parts
            else:
                data = _recursive(lambda t: self._gather_one(t, keep))(input_data)
        else:
            data = self.gather_object(input_data) if (use_gather_object or not tensors_only) else self.gather(input_data)
        state = self.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            if isinstance(data, list) and not tensors_only:
                return data[: state.remainder]
            return _recursive(lambda t: t[: state.remainder])(data)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """All-reduce (``"sum"``, ``"mean"``, ``"max"`` or ``"none"``) tensors of a nested structure, then
        multiply by ``scale``. Returns new tensors; inputs are not modified."""
        if reduction not in ("sum", "mean", "max", "none"):
            raise ValueError(f"reduction must be sum, mean, max or none, got {reduction!r}")

        def one(t: torch.Tensor) -> torch.Tensor:
            t = t.clone()
            if reduction != "none" and self.num_processes > 1:
                self.collectives.all_reduce(t, "max" if reduction == "max" else "sum")
                if reduction == "mean":
                    t = t / self.num_processes
            return t * scale if scale != 1.0 else t

        return _recursive(one)(tensor)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad tensors along ``dim`` to the largest size over all processes, so they can be gathered."""

        def one(t: torch.Tensor) -> torch.Tensor:
            if self.num_processes == 1 or t.ndim == 0:
                return t
            d = dim % t.ndim
            sizes = self.collectives.all_gather(torch.tensor([t.shape[d]], device=t.device))
            top = max(int(s.item()) for s in sizes)
            if top == t.shape[d]:
                return t
            shape = list(t.shape)
            shape[d] = top - t.shape[d]
            pad = t.new_full(shape, pad_index)
            return torch.cat([pad, t] if pad_first else [t, pad], dim=d)

        return _recursive(one)(tensor)

    def broadcast(self, data: Any, from_process: int = 0) -> Any:
        """Tensors of process ``from_process`` on every process (in place); other objects via pickling."""
        if self.num_processes == 1:
            return data
        try:
            return _recursive(lambda t: self.collectives.broadcast(t.contiguous(), from_process))(data)
        except TypeError:
            return self.collectives.broadcast_object(data, from_process)

    # ---- saving -------------------------------------------------------------------------------------------

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = True) -> None:
        """Save on the main process only: a flat dict of tensors as safetensors, anything else with torch.save."""
        if not self.is_main_process:
            return
        if safe_serialization and isinstance(obj, Mapping) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous().cpu() for k, v in obj.items()}, os.fspath(f))
        else:
            torch.save(obj, f)

    def get_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """The full state dict of a prepared model (gathered from shards where a plugin shards it)."""
        return self.plugins.pm.hook.accel_model_state_dict(kernel=self, model=model)

    # ---- checkpoints (accel.checkpoint) -------------------------------------------------------------------

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include objects with ``state_dict``/``load_state_dict`` in ``save_state``/``load_state`` (items
        ``custom_0``, ``custom_1``, ... in registration order)."""
        for obj in objects:
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise UsageError(f"register_for_checkpointing: {type(obj).__name__} has no state_dict() and "
                                 "load_state_dict(); only such objects can be checkpointed")
        self._custom_objects.extend(objects)

    def save_state(self, output_dir: str | os.PathLike[str] | None = None,
                   asynchronous: bool | None = None) -> os.PathLike[str]:
        """Save everything needed to resume exactly: prepared models, optimizers, schedulers and dataloader
        positions, registered objects, plugin items (grad scaler, ...), and every process's random states.
        Call it on every process. Without ``output_dir`` it writes ``project_dir/checkpoints/checkpoint_<i>``
        (see :class:`accel.ProjectConfiguration`). Atomic: the directory appears complete or not at all.
        ``asynchronous=True`` (default: the ``async_save`` option) returns once the state is copied to CPU
        memory; the write, fsync and publish happen in the background, and the next ``save_state``,
        ``load_state``, ``latest_checkpoint``, ``wait_for_save`` or ``end_training`` waits for them (and raises
        their error). Returns the checkpoint's directory."""
        from accel import checkpoint  # imported on first use: a run that never saves does not pay for it

        return checkpoint.save_state(self, output_dir, asynchronous)

    def wait_for_save(self) -> None:
        """Wait until the asynchronous ``save_state`` in flight (if any) is written and published; raise its error
        (the same on every process). Call it on every process."""
        self._finish_save()

    def _finish_save(self, at_exit: bool = False, release: bool = False) -> None:
        checkpoint = sys.modules.get("accel.checkpoint")  # not imported: this run never saved
        if checkpoint is not None:
            checkpoint.finish_pending(self, at_exit=at_exit, release=release)

    def load_state(self, input_dir: str | os.PathLike[str] | None = None) -> os.PathLike[str]:
        """Restore what ``save_state`` saved, after checking that it fits this run (plugins, items, number of
        processes, shapes). Without ``input_dir``: the newest complete checkpoint of the project. Call it on every
        process, after ``prepare``. The next pass over each prepared dataloader continues where the saved one
        stopped. Returns the directory loaded."""
        from accel import checkpoint  # imported on first use: a run that never saves does not pay for it

        checkpoint.finish_pending(self)
        return checkpoint.load_state(self, input_dir)

    def latest_checkpoint(self) -> os.PathLike[str] | None:
        """The newest complete checkpoint of the project (as the main process sees it), or None. Call it on every
        process: ``if kernel.latest_checkpoint(): kernel.load_state()``."""
        project = self.project_configuration.project_dir
        from accel import checkpoint  # imported on first use: a run that never saves does not pay for it

        checkpoint.finish_pending(self)
        found = checkpoint.latest_checkpoint(project) if (project and self.is_main_process) else None
        found = self.collectives.broadcast_object(None if found is None else os.fspath(found), 0)
        return None if found is None else Path(found)

    @property
    def save_iteration(self) -> int:
        """The number the next automatic checkpoint gets."""
        return self.project_configuration.iteration

    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike[str],
                   max_shard_size: int | str = "10GB") -> list[os.PathLike[str]]:
        """Write a prepared model's full weights as safetensors (``model.safetensors``, or shards plus
        ``model.safetensors.index.json`` above ``max_shard_size``); tied weights are stored once. Call it on every
        process; the main process writes. Load with :func:`accel.load_model`."""
        from accel import checkpoint  # imported on first use: a run that never saves does not pay for it

        return list(checkpoint.save_model(self, model, save_directory, max_shard_size))

    def skip_first_batches(self, dataloader: Any, num_batches: int) -> Any:
        """A dataloader whose next pass starts at batch ``num_batches``; skipped batches are not loaded."""
        return skip_first_batches(dataloader, num_batches)

    # ---- memory and teardown ------------------------------------------------------------------------------

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget the prepared objects, collect garbage and empty the device cache. Returns ``[None] * len(objects)``
        so ``model, opt = kernel.free_memory(model, opt)`` drops the caller's references too."""
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self._originals.clear()
        self._inner.clear()
        gc.collect()
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and accelerator.is_available():
            memory = getattr(accelerator, "memory", None)
            empty = getattr(memory, "empty_cache", None) if memory is not None else None
            if empty is not None:
                empty()
        return [None] * len(objects)

    clear = free_memory

    def call_isolated(self, hook_name: str, *, trackers: bool | None = None, **kwargs: Any) -> None:
        """Call every implementation of a broadcast hook on its own: one that raises is warned about once and
        skipped from then on (a tracker that raises is skipped for every tracking hook; teardown per hook).
        Trackers run on the main process unless they set ``main_process_only = False``. ``trackers=True`` calls
        only tracker components, ``False`` only the others, ``None`` everyone."""
        for impl in reversed(getattr(self.plugins.pm.hook, hook_name).get_hookimpls()):
            tracker = getattr(impl.plugin, "role", None) == "tracker"
            if trackers is not None and tracker != trackers:
                continue
            key: Any = impl.plugin_name if tracker else (impl.plugin_name, hook_name)
            if key in self._failed:
                continue
            if tracker and getattr(impl.plugin, "main_process_only", True) and not self.is_main_process:
                continue
            try:
                impl.function(*[kwargs[a] for a in impl.argnames])
            except Exception as exc:  # logging and teardown must never stop training
                self._failed.add(key)
                who = f"tracker {impl.plugin.name!r}" if tracker else f"plugin {impl.plugin_name!r}"
                warnings.warn(f"{who} failed in {hook_name} and is skipped from now on: "
                              f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=user_stacklevel())

    def end_training(self) -> None:
        """Finish trackers and release the processes' resources (process group). Safe to call once at the end.
        An asynchronous save in flight is finished first (its error is raised after the teardown)."""
        try:
            self._finish_save(release=True)
        finally:
            self._end_trackers()
            if not self._torn_down:
                self.call_isolated("accel_end_training", kernel=self, trackers=False)
            self._teardown()

    def _teardown(self) -> None:
        if self._torn_down:
            return
        self._torn_down = True
        self._finish_save(at_exit=True)  # at interpreter exit: an asynchronous save in flight, without collectives
        self._end_trackers()  # a script that never called end_training still gets its logs flushed
        self.call_isolated("accel_teardown", kernel=self)
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    # ---- profiling and triggers (Accelerate's utilities) --------------------------------------------------

    @contextlib.contextmanager
    def profile(self, profile_handler: Any = None) -> Iterator[Any]:
        """``torch.profiler.profile`` built from ``profile_handler`` (an :class:`accel.utils.ProfileKwargs`), else
        the one given in ``kwargs_handlers``, else defaults; yields the profiler (call ``prof.step()`` per step when
        a schedule is set). With ``output_trace_dir`` every process writes ``profile_<process index>.json``
        there at the end, then waits for the others."""
        from accel.utils.handlers import PROFILE_PATTERN_NAME, ProfileKwargs

        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is None:
            return
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(handler.output_trace_dir,
                                                  PROFILE_PATTERN_NAME.format(suffix=self.process_index)))
        self.wait_for_everyone()

    def set_trigger(self) -> None:
        """Raise this process's flag; the next ``check_trigger`` on every process sees it (no barrier needed)."""
        self._trigger = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """Whether any process called ``set_trigger`` since the last check (an all-reduce: call it on every
        process). Resets the flag when it was set."""
        flag = getattr(self, "_trigger", None)
        if flag is None:
            flag = self._trigger = torch.tensor(0, device=self.device)
        if int(self.reduce(flag).item()) >= 1:
            self._trigger = torch.tensor(0, device=self.device)
            return True
        return False


_ACTIVE: list[Kernel] = []


def active_kernel() -> Kernel | None:
    """The most recently created Kernel of this process that has not ended, if any."""
    return _ACTIVE[-1] if _ACTIVE else None
