"""The Kernel: one training loop for one process or many, whatever plugins are installed.

Everything backend-specific is asked of the active plugins through the hooks in :mod:`accel.hookspecs`; the
kernel only keeps the bookkeeping every backend shares (gradient accumulation, dataloader state, collectives on
nested structures, the objects it prepared).
"""

from __future__ import annotations

import atexit
import base64
import collections
import contextlib
import gc
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import pluggy
import torch

from accel import active, forksafe
from accel.contract import Topology
from accel.data import GradientState, skip_first_batches
from accel.data_arguments import (
    DataArgumentsMixin,
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    check_bool,
    resolve_data_settings,
)
from accel.debug import CheckedCollectives
from accel.dispatch import HotHooks, call_isolated
from accel.errors import UsageError, user_stacklevel
from accel.options import KERNEL, Settings, did_you_mean, int_env, known_plugins, resolve, unread_accelerate_variables
from accel.plugins import Plugins
from accel.prepared import (
    PreparedOptimizer,
    PreparedScheduler,
    _Accumulate,
    check_prepare_arguments,
    no_grad_message,
)
from accel.preparing import Prepared, join_uneven_inputs, warn_unprepared_loaders
from accel.process_ops import ProcessOpsMixin
from accel.processes import note_failure_time
from accel.project import ProjectConfiguration, check_project_config, configure_project
from accel.tracking import TrackingMixin, check_tracker_names
from accel.utils.dataclasses import DistributedType

__all__ = ["Kernel", "PartialState", "PreparedOptimizer", "PreparedScheduler", "active_kernel"]

#: Keyword arguments of ``Kernel(...)`` that are options of the kernel (plugins may declare more).
_ARGUMENTS = (
    "mixed_precision",
    "gradient_accumulation_steps",
    "cpu",
    "log_with",
    "project_dir",
    "dynamo_backend",
    "plugins",
)


class Kernel(ProcessOpsMixin, TrackingMixin, DataArgumentsMixin):
    """The training-loop companion. ``Kernel().prepare(model, optimizer, dataloader, scheduler)``, then
    ``kernel.backward(loss)``; the same script runs on one CPU process or many, with any installed plugin.

    Arguments (all optional; ``None`` means "from ``accel launch``/environment/default"):
    ``mixed_precision`` ("no", "fp16", "bf16", "fp8" or another mode a plugin provides), ``gradient_accumulation_steps``, ``cpu``, ``log_with``,
    ``project_dir``, ``dynamo_backend``, ``plugins`` (names to select), ``even_batches`` (default True),
    ``extra_plugins`` ((name, module-or-object) pairs registered without entry points, for tests),
    ``project_config`` (:class:`accel.ProjectConfiguration`: checkpoint naming and retention), ``kwargs_handlers``
    (Accelerate's handler objects from :mod:`accel.utils`: their fields set the options plugins declare for them),
    and any option a plugin declares (``Kernel(fsdp_reshard_after_forward=False)``).

    Accelerate's arguments keep their meaning (:mod:`accel.data_arguments`): ``split_batches``, ``dataloader_config``
    (:class:`accel.DataLoaderConfiguration`), ``dispatch_batches``/``use_seedable_sampler`` (accepted where they
    change nothing), ``rng_types`` (``["generator"]`` only), ``device_placement`` (True only),
    ``step_scheduler_with_optimizer``, ``gradient_accumulation_plugin`` (:class:`accel.GradientAccumulationPlugin`),
    and the ``scheduler_steps`` option (``"accelerate"``: Accelerate's rule, default; ``"per_optimizer_step"``). An
    argument of another library that a plugin explains (``accel_explain_name``: accel-accelerate's tables of
    Accelerate's names) raises that line.
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
            split_batches=split_batches,
            even_batches=even_batches,
            dataloader_config=dataloader_config,
            rng_types=rng_types,
            device_placement=device_placement,
            dispatch_batches=dispatch_batches,
            use_seedable_sampler=use_seedable_sampler,
            gradient_accumulation_plugin=gradient_accumulation_plugin,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )
        check_bool("Kernel(step_scheduler_with_optimizer=...)", step_scheduler_with_optimizer)
        note_failure_time()  # a worker of `accel launch`: its failure summary can name the first process that failed
        env = dict(os.environ)
        check_project_config(project_config)
        if project_dir is None and project_config is not None:
            project_dir = project_config.project_dir
        self.plugins = Plugins.load(env=env, extra=extra_plugins)
        declared = self.plugins.options()
        for name in options:
            if name not in declared:
                refusal = self.plugins.pm.hook.accel_explain_name(kind="argument", name=name)
                if refusal:
                    raise UsageError(refusal)
                raise TypeError(
                    f"Kernel() got an unexpected argument {name!r}{did_you_mean(name, [o.name for o in declared])}"
                )
        from accel.utils.handlers import route  # Accelerate's kwargs handlers -> the options plugins declare for them

        handled = route(kwargs_handlers or (), declared, options)
        self.profile_handler = handled.profile
        kwargs = {**handled.options, **options}
        for name, value in (
            ("mixed_precision", mixed_precision),
            ("gradient_accumulation_steps", gradient_accumulation_steps),
            ("cpu", cpu),
            ("dynamo_backend", dynamo_backend),
            ("plugins", plugins),
            ("project_dir", None if project_dir is None else os.fspath(project_dir)),
            ("log_with", [log_with] if isinstance(log_with, str) else log_with),
        ):
            if value is not None:
                kwargs[name] = value
        text = env.get("ACCEL_CONFIG") or "{}"
        try:
            if text.startswith("base64:"):  # launchers that re-quote exported values (pdsh, mpirun) carry it encoded
                text = base64.b64decode(text[len("base64:") :], validate=True).decode()
            launched = json.loads(text)
        except ValueError:
            raise UsageError(
                "environment variable ACCEL_CONFIG is not valid JSON; unset it or launch with accel launch"
            ) from None
        values, sources = resolve(declared, env=env, launched=launched, kwargs=kwargs)
        world = int_env(env, "WORLD_SIZE", 1)
        self.settings = Settings(values, sources, world_size=world, phase="run", env=env)
        self._data = data
        self.even_batches = data.even_batches
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self._accumulation_steps = int(self.settings["gradient_accumulation_steps"])
        self.project_configuration = configure_project(project_config, self.settings["project_dir"])
        self._custom_objects: list[Any] = []
        # accel.checkpoint.user_hooks; ordered dicts, as torch's RemovableHandle holds them by weak reference
        self._save_state_pre_hooks: dict[int, Any] = collections.OrderedDict()
        self._load_state_pre_hooks: dict[int, Any] = collections.OrderedDict()
        self.gradient_state = GradientState()
        self._prepared = Prepared()  # what prepare() returned; the lists below are its own (the same objects)
        self._models, self._optimizers = self._prepared.models, self._prepared.optimizers
        self._schedulers, self._dataloaders = self._prepared.schedulers, self._prepared.dataloaders
        self._originals, self._inner = self._prepared.originals, self._prepared.inner
        self._failed: set[Any] = set()  # plugin names (trackers) and (plugin, hook) pairs that raised
        self._warned: set[str] = set()
        self._torn_down = False
        self._leaders = None  # gather_for_metrics: the first process of each data shard
        self._loader_check_due = False  # set once the topology is known (several processes)
        check_tracker_names(self.settings["log_with"] or [], self.plugins.records)
        self.plugins.activate(self.settings)
        hook = self.plugins.pm.hook
        hook.accel_setup(kernel=self)
        self.topology: Topology = hook.accel_topology(kernel=self)
        idle = handled.unused(declared, [KERNEL, *(c.name for c in self.plugins.components)])
        # `accel launch` said the plugin-selection warnings already (it hands ACCEL_CONFIG to its workers)
        said = [] if "ACCEL_CONFIG" in env else self.plugins.warnings
        if self.is_main_process:
            for message in [idle, *said, unread_accelerate_variables(env, declared)]:
                if message:
                    warnings.warn(message, UserWarning, stacklevel=user_stacklevel())
        self._loader_check_due = self.num_processes > 1
        if self.num_processes > 1:  # a DataLoader worker forked beside the process group's threads
            forksafe.install()
        self.device: torch.device = hook.accel_device(kernel=self)
        self.collectives = hook.accel_collectives(kernel=self)
        if self.settings["debug"] and self.num_processes > 1:  # accel/debug.py: each collective checked first
            self.collectives = CheckedCollectives(self.collectives, self.process_index)
        self._autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = hook.accel_autocast(kernel=self)
        self._hot = HotHooks(self.plugins.pm)  # per-step hooks, resolved once (again at each prepare)
        self._accumulating = _Accumulate(self, ())
        self._join_uneven = False  # inside join_uneven_inputs with uneven batches: passes end where the data ends
        active.ACTIVE.append(self)
        atexit.register(self._teardown)

    # ---- settings and topology ----------------------------------------------------------------------------

    @property
    def mixed_precision(self) -> str:
        """The ``mixed_precision`` setting: ``"no"`` or a mode a plugin provides (``"fp16"``, ``"bf16"``, ``"fp8"``...)."""
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

    @property
    def log_with(self) -> list[str]:
        return list(self.settings["log_with"] or [])

    @log_with.setter
    def log_with(self, value: str | Sequence[str] | None) -> None:
        """Accepted when it names the trackers this run has; trackers are plugins chosen by ``Kernel(log_with=...)``,
        so another choice is one line saying so."""
        names = [value] if isinstance(value, str) else list(value or [])
        if sorted(names) != sorted(self.log_with):
            raise UsageError(
                f"kernel.log_with = {value!r}: trackers are chosen when the Kernel is created (they are plugins); "
                f"pass Kernel(log_with={value!r}) instead (this run has log_with={self.log_with!r})"
            )

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
    def state(self) -> PartialState:
        """Accelerate's ``accelerator.state``: a read-only view of this Kernel's distributed facts with Accelerate's
        names (``distributed_type``, ``process_index``, ...; :class:`accel.PartialState`). The settings are
        ``kernel.settings``, the active plugins ``kernel.components``."""
        return PartialState.of(self)

    @state.setter
    def state(self, value: PartialState) -> None:  # Accelerate's is a plain attribute: assigning its own view is fine
        if value != self.state:
            raise UsageError(
                f"kernel.state is this Kernel's read-only view, got {value!r}: create another Kernel for other "
                "settings (only kernel.state.debug can be set)"
            )

    @property
    def debug(self) -> bool:
        """Whether debug mode checks each collective first (accel/debug.py): the ``debug`` setting, and settable
        (Accelerate's ``state.debug = True``). Only a run of several processes has anything to check."""
        return isinstance(self.collectives, CheckedCollectives)

    @debug.setter
    def debug(self, value: bool) -> None:
        if check_bool("kernel.debug", value) and self.num_processes > 1 and not self.debug:
            self.collectives = CheckedCollectives(self.collectives, self.process_index)
        elif not value and isinstance(self.collectives, CheckedCollectives):
            self.collectives = self.collectives.inner

    @property
    def hook(self) -> pluggy.HookRelay:
        """pluggy's hook relay of this run: ``kernel.hook.accel_<plugin>_<what>(kernel=kernel, ...)`` calls a hook a
        plugin added (``accel_hookspecs``) on every active component that implements it."""
        return self.plugins.pm.hook

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
        if "_detached" in self.__dict__:
            return f"Kernel(detached copy, process {self.process_index}/{self.num_processes}, device={self.device})"
        comps = ", ".join(f"{c.name}:{c.role}" for c in self.plugins.components) or "none"
        own = self.__dict__  # also while Kernel() is still asking the plugins (hook tracing prints the kernel)
        where = (
            f"process {own['topology'].process_index}/{own['topology'].num_processes}"
            if "topology" in own
            else "starting"
        )
        return (
            f"Kernel({where}, device={own.get('device', '?')}, mixed_precision={self.mixed_precision}, "
            f"plugins=[{comps}])"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Picklable, as Accelerate's ``Accelerator`` is (``datasets.map`` pickles functions that use it): unpickled
        in the same process it is this Kernel again; in another process (a DataLoader worker, a ``map`` worker) a
        detached Kernel that answers the run's facts (process index and count, device, even batches...) and refuses
        collectives, hooks and checkpoints in one line."""
        facts = {name: self.__dict__[name] for name in _DETACHED_FACTS if name in self.__dict__}
        return (_unpickle_kernel, (os.getpid(), id(self), facts))

    # ---- prepare ------------------------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: bool = True) -> Any:
        """Prepare models, optimizers, dataloaders and schedulers (any number, any order) for this run; return
        them in the same order (one object returned as itself). Other objects pass through unchanged."""
        check_prepare_arguments(args)
        self._hot = HotHooks(self.plugins.pm)
        return self._prepared.prepare(self, args, device_placement)

    def _warn_unprepared_loaders(self) -> None:
        """Once, at the first ``backward`` or ``gather_for_metrics`` of a run of several processes (see
        :func:`accel.preparing.warn_unprepared_loaders`)."""
        self._loader_check_due = False
        if self.is_main_process:
            warn_unprepared_loaders(self._prepared.passed_loaders, self.num_processes)

    def _is_prepared(self, obj: Any) -> bool:
        """Whether ``prepare`` returned ``obj`` before (Accelerate returns such objects as they are, too)."""
        return self._prepared.knows(obj)

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
        return self._prepared.unwrap(model, keep_torch_compile)

    # ---- training step ------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward through the active plugins (scaler, engine, ...). The loss is divided by
        ``gradient_accumulation_steps`` so accumulated gradients average over micro-batches. Keyword arguments
        (``retain_graph=True``, ``inputs=[...]``) go on to ``Tensor.backward``."""
        if not getattr(loss, "requires_grad", False):
            raise UsageError(no_grad_message(loss))
        if self._loader_check_due:
            self._warn_unprepared_loaders()
        hot = self._hot
        if hot.plain_backward:  # only the kernel's default answers: its call, made here
            steps = self._accumulation_steps  # scale_for_accumulation, inlined (one Python call fewer per step)
            if steps > 1:
                loss = loss / steps
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

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: torch.nn.Module) -> Iterator[None]:
        """The backward inside synchronises gradients even though the forward ran under ``no_sync`` (Accelerate's):
        several forwards under ``no_sync``, the backward of all but the last outside any context (accumulated
        locally), the last backward inside this context (one all-reduce of the sum)."""
        inner = self._inner.get(id(model), model)
        with self.plugins.pm.hook.accel_sync_in_backward(kernel=self, model=inner):
            yield

    def join_uneven_inputs(
        self, joinables: Sequence[Any], even_batches: bool | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Train or evaluate on uneven inputs through torch's ``Join`` (Accelerate's): with ``even_batches=False``
        (the argument, else the Kernel's) a process that runs out of batches stops its passes over the prepared
        dataloaders instead of getting empty batches, and ``Join`` shadows the collectives of ``joinables`` (prepared
        models of a strategy whose model torch can join: DDP) until every process is done, so none waits forever.
        With even batches, or one process, it changes nothing."""
        return join_uneven_inputs(self, joinables, even_batches)

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

    def clip_grad_norm_(
        self, parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor | None:
        """Clip by global norm on sync steps and return the norm; on accumulation steps do nothing, return None
        (the local gradients are partial there)."""
        if not self.gradient_state.sync_gradients:
            return None
        hot = self._hot
        if hot.unscale_needed:  # unscale_gradients(), inlined; nothing to call where no plugin implements it
            hot.unscale_gradients(kernel=self)
        if hot.plain_clip:  # only the kernel's default answers: its call, made here
            return torch.nn.utils.clip_grad_norm_(parameters, float(max_norm), norm_type=float(norm_type))
        return hot.clip_grad_norm(
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

    # ---- saving -------------------------------------------------------------------------------------------

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = True) -> None:
        """Save on the main process only: a flat dict of tensors as safetensors, anything else with torch.save."""
        if not self.is_main_process:
            return
        if (
            safe_serialization
            and isinstance(obj, Mapping)
            and obj
            and all(isinstance(v, torch.Tensor) for v in obj.values())
        ):
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
                raise UsageError(
                    f"register_for_checkpointing: {type(obj).__name__} has no state_dict() and "
                    "load_state_dict(); only such objects can be checkpointed"
                )
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """Call ``hook(models, weights, output_dir)`` at the start of every ``save_state`` (Accelerate's): files
        it writes into ``output_dir`` are part of the checkpoint; a model whose state dict it removes from
        ``weights`` is not saved by accel. Returns a handle whose ``remove()`` unregisters it."""
        from torch.utils.hooks import RemovableHandle

        handle = RemovableHandle(self._save_state_pre_hooks)
        self._save_state_pre_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """Call ``hook(models, input_dir)`` at the start of every ``load_state`` (Accelerate's): a model it removes
        from ``models`` is one it loaded itself, which accel does not restore. Returns a handle (``remove()``)."""
        from torch.utils.hooks import RemovableHandle

        handle = RemovableHandle(self._load_state_pre_hooks)
        self._load_state_pre_hooks[handle.id] = hook
        return handle

    def save_state(
        self, output_dir: str | os.PathLike[str] | None = None, asynchronous: bool | None = None
    ) -> os.PathLike[str]:
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

    def save_model(
        self, model: torch.nn.Module, save_directory: str | os.PathLike[str], max_shard_size: int | str = "10GB"
    ) -> list[os.PathLike[str]]:
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
        self._prepared.clear()
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
        call_isolated(self.plugins.pm, hook_name, self._failed, self.is_main_process, trackers, kwargs)

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
        if self in active.ACTIVE:
            active.ACTIVE.remove(self)
        checkpoint = sys.modules.get("accel.checkpoint")
        if checkpoint is not None and not active.ACTIVE:
            checkpoint.exit_if_lost()  # an asynchronous save lost at interpreter exit: exit code 1


#: What a pickled Kernel carries to another process: the run's facts, nothing that runs collectives or hooks.
_DETACHED_FACTS = (
    "topology",
    "device",
    "_data",
    "even_batches",
    "_accumulation_steps",
    "step_scheduler_with_optimizer",
    "project_configuration",
)


def _unpickle_kernel(pid: int, ident: int, facts: dict[str, Any]) -> Kernel:
    """The Kernel a pickle names: the live one in the process that pickled it, else a detached copy of its facts."""
    if pid == os.getpid():
        for kernel in active.ACTIVE:
            if id(kernel) == ident:
                return cast(Kernel, kernel)
    kernel = Kernel.__new__(Kernel)
    kernel.__dict__.update(facts, _detached=pid)
    return kernel


def active_kernel() -> Kernel | None:
    """The most recently created Kernel of this process that has not ended, if any (:mod:`accel.active`)."""
    return cast("Kernel | None", active.active_kernel())


#: what the view answers, each the same-named member of its Kernel
_FROM_KERNEL = frozenset(
    {
        "device",
        "num_processes",
        "process_index",
        "local_process_index",
        "is_main_process",
        "is_local_main_process",
        "is_last_process",
        "use_distributed",
        "mixed_precision",
        "print",
        "wait_for_everyone",
        "main_process_first",
        "local_main_process_first",
        "on_main_process",
        "on_local_main_process",
        "on_last_process",
        "on_process",
        "on_local_process",
        "split_between_processes",
    }
)


def distributed_type(kernel: Kernel) -> Any:
    """Accelerate's ``DistributedType`` of a Kernel: ``NO`` on one process, else the value of Accelerate's config
    file that selects the Kernel's strategy plugin (``known_plugins.json``), ``MULTI_<device>`` for the plugin
    that several values select (``MULTI_GPU`` on ``cuda``). Worked out once per Kernel (its plugins and device are
    fixed): scripts and libraries read it at every step (transformers' ``Trainer`` three times)."""
    cached = kernel.__dict__.get("_distributed_type")
    if cached is None:
        cached = kernel.__dict__["_distributed_type"] = _distributed_type(kernel)
    return cached


def _distributed_type(kernel: Kernel) -> Any:
    device = kernel.device.type
    multi = "MULTI_" + ("GPU" if device == "cuda" else device.upper())
    plugins = {component.name for component in kernel.components}
    found = [name for name, plugin in known_plugins()["distributed_type"].items() if plugin in plugins]
    single = [name for name in found if not name.startswith("MULTI_")]
    if single and multi not in found:
        return DistributedType[single[0]]
    if kernel.num_processes == 1 or multi not in DistributedType.__members__:
        return DistributedType.NO
    return DistributedType[multi]


class PartialState:
    """Accelerate's ``PartialState``/``AcceleratorState`` facts of one Kernel, read-only (see the module)."""

    # the Kernel stays out of __dict__ (empty: Accelerate's test scripts compare state.__dict__ across a pickle);
    # two views are equal when they view the same Kernel (__eq__)
    __slots__ = ("__dict__", "_kernel")

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        kernel = active_kernel()
        if kernel is None or cpu or kwargs:
            kernel = Kernel(cpu=cpu, **kwargs)
        object.__setattr__(self, "_kernel", kernel)

    @classmethod
    def of(cls, kernel: Kernel) -> PartialState:
        """The view of ``kernel`` (``kernel.state``)."""
        view = cls.__new__(cls)
        object.__setattr__(view, "_kernel", kernel)
        return view

    def __getattr__(self, name: str) -> Any:
        if name in _FROM_KERNEL:
            return getattr(self._kernel, name)
        raise AttributeError(f"'PartialState' object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "debug":
            self._kernel.debug = value
            return
        raise UsageError(
            f"kernel.state.{name} is read-only: accel's state is a view of the Kernel's facts, decided by the "
            "launch, the device and the plugins (only state.debug can be set); choose them with accel launch "
            "options or Kernel(...) arguments"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PartialState) and other._kernel is self._kernel

    def __hash__(self) -> int:
        return id(self._kernel)

    @property
    def distributed_type(self) -> Any:
        """Accelerate's ``DistributedType`` of the Kernel (:func:`distributed_type`)."""
        return distributed_type(self._kernel)

    @property
    def debug(self) -> bool:
        """Whether debug mode checks the Kernel's collectives (settable, as Accelerate's ``state.debug``)."""
        return bool(self._kernel.debug)

    @property
    def initialized(self) -> bool:
        return True

    def destroy_process_group(self, group: Any = None) -> None:
        """End the Kernel's run (``kernel.end_training()``): its trackers and its processes' resources."""
        self._kernel.end_training()

    def __repr__(self) -> str:
        k = self._kernel
        return (
            f"Distributed environment: {self.distributed_type.value}\nNum processes: {k.num_processes}\n"
            f"Process index: {k.process_index}\nLocal process index: {k.local_process_index}\nDevice: {k.device}\n"
            f"Mixed precision type: {k.mixed_precision}\n"
        )
