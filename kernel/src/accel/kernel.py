"""The Kernel: one training loop for one process or many, whatever plugins are installed.

Everything backend-specific is asked of the active plugins through the hooks in :mod:`accel.hookspecs`; the
kernel keeps the bookkeeping every backend shares (gradient accumulation, the objects it prepared) and holds its
other parts as objects (:mod:`accel.members`): the collectives on nested data (``_ops``), the dataloader arguments
(``_arguments``), what ``prepare`` returned (``_prepared``), and the parts the built-in features give it by name
(``_tracking``, ``_checkpoints``: :mod:`accel.parts`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import pluggy
import torch

from accel import active, forksafe, preparing
from accel.arguments import resolve_arguments, warn_arguments
from accel.builtin import make_parts
from accel.contract import Topology
from accel.data_arguments import DataArguments, assign_member, missing_member
from accel.debug import CheckedCollectives
from accel.dispatch import HotHooks, call_isolated
from accel.errors import UsageError
from accel.gradient_state import GradientState
from accel.members import Attribute, Forward
from accel.partial_state import PartialState
from accel.parts import CheckpointPart, TrackingPart
from accel.plugins import Plugins
from accel.prepared import PreparedOptimizer, PreparedScheduler, _Accumulate, check_prepare_arguments, no_grad_message
from accel.preparing import Prepared
from accel.process_ops import ProcessOps
from accel.processes import note_failure_time
from accel.project import configure_project

if TYPE_CHECKING:
    from accel.data_arguments import DataLoaderConfiguration, GradientAccumulationPlugin
    from accel.project import ProjectConfiguration

__all__ = ["Kernel", "PartialState", "PreparedOptimizer", "PreparedScheduler", "active_kernel"]


class Kernel:
    """The training-loop companion. ``Kernel().prepare(model, optimizer, dataloader, scheduler)``, then
    ``kernel.backward(loss)``; the same script runs on one CPU process or many, with any installed plugin.

    Arguments (all optional; ``None`` means "from ``accel launch``/environment/default"): ``mixed_precision``,
    ``gradient_accumulation_steps``, ``cpu``, ``log_with``, ``project_dir``, ``dynamo_backend``, ``plugins`` (names to
    select), ``even_batches``, ``extra_plugins`` ((name, module-or-object) pairs registered without entry points),
    ``project_config`` (:class:`accel.ProjectConfiguration`), ``kwargs_handlers`` (:mod:`accel.utils`' handler
    objects: their fields set the options plugins declare for them), any option a plugin declares
    (``Kernel(fsdp_reshard_after_forward=False)``), and Accelerate's dataloader and scheduler arguments with their
    meaning (:mod:`accel.data_arguments`). An argument of another library that a plugin explains
    (``accel_explain_name``) raises that line; see :mod:`accel.arguments`.
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
        note_failure_time()  # a worker of `accel launch`: its failure summary can name the first process that failed
        env = dict(os.environ)
        # 1. the installed plugins, and the settings from the arguments, the launch, the environment and the defaults
        self.plugins = Plugins.load(env=env, extra=extra_plugins)
        given = resolve_arguments(
            self.plugins, env, mixed_precision=mixed_precision, gradient_accumulation_steps=gradient_accumulation_steps,
            cpu=cpu, log_with=log_with, project_dir=project_dir, dynamo_backend=dynamo_backend, plugin_names=plugins,
            even_batches=even_batches, project_config=project_config, split_batches=split_batches,
            dataloader_config=dataloader_config, dispatch_batches=dispatch_batches,
            use_seedable_sampler=use_seedable_sampler, rng_types=rng_types, device_placement=device_placement,
            step_scheduler_with_optimizer=step_scheduler_with_optimizer,
            gradient_accumulation_plugin=gradient_accumulation_plugin, kwargs_handlers=kwargs_handlers, options=options,
        )  # fmt: skip
        self.settings, self._data, self.profile_handler = given.settings, given.data, given.handled.profile
        self.even_batches = given.data.even_batches
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer  # checked by resolve_arguments
        self._accumulation_steps = int(self.settings["gradient_accumulation_steps"])
        self.project_configuration = configure_project(project_config, self.settings["project_dir"])
        # 2. the step's state and the parts
        self.gradient_state = GradientState()
        self._prepared = Prepared(self)  # what prepare() returned; the lists below are its own (the same objects)
        self._models, self._optimizers = self._prepared.models, self._prepared.optimizers
        self._schedulers, self._dataloaders = self._prepared.schedulers, self._prepared.dataloaders
        self._originals, self._inner = self._prepared.originals, self._prepared.inner
        self._ops, self._arguments = ProcessOps(self), DataArguments(self)
        self.__dict__.update(make_parts(self))  # _tracking, _checkpoints
        self._failed: set[Any] = set()  # plugin names (trackers) and (plugin, hook) pairs that raised
        self._torn_down = False
        self._loader_check_due = False  # set once the topology is known (several processes)
        # 3. the active components, then what they answer: topology, device, collectives, autocast
        self.plugins.activate(self.settings)
        hook = self.plugins.pm.hook
        hook.accel_setup(kernel=self)
        self.topology: Topology = hook.accel_topology(kernel=self)
        warn_arguments(self, given.handled)
        self._loader_check_due = self.num_processes > 1
        if self.num_processes > 1:  # a DataLoader worker forked beside the process group's threads
            forksafe.install()
        self.device: torch.device = hook.accel_device(kernel=self)
        self.collectives = hook.accel_collectives(kernel=self)
        if self.settings["debug"] and self.num_processes > 1:  # accel/debug.py: each collective checked first
            self.collectives = CheckedCollectives(self.collectives, self.process_index)
        self._autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = hook.accel_autocast(kernel=self)
        # 4. the per-step hooks, resolved once (again at each prepare), and this Kernel as the process's
        self._hot = HotHooks(self.plugins.pm)
        self._accumulating = _Accumulate(self, ())
        self._join_uneven = False  # inside join_uneven_inputs with uneven batches: passes end where the data ends
        active.ACTIVE.append(self)
        atexit.register(self._teardown)

    # ---- settings and topology ----------------------------------------------------------------------------

    mixed_precision: Attribute[str] = Attribute(
        "settings", "The mixed_precision setting: no, fp16, bf16...", readonly=True
    )

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (the script may change it between steps: the count of the cycle in
        progress is kept, and the loss is divided by the new value from the next ``backward``)."""
        return self._accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"gradient_accumulation_steps expects a whole number >= 1, got {value!r}")
        self._accumulation_steps = value

    # where this process sits in the run (``topology``, which the strategy plugin answered)
    num_processes: Attribute[int] = Attribute("topology", "Processes of the run, over all machines.", readonly=True)
    process_index: Attribute[int] = Attribute("topology", "This process's rank, 0 .. num_processes - 1.", readonly=True)
    local_process_index: Attribute[int] = Attribute("topology", "This process's rank on its machine.", readonly=True)
    is_main_process: Attribute[bool] = Attribute("topology", "Whether this is process 0 of the run.", readonly=True)
    is_local_main_process: Attribute[bool] = Attribute("topology", "Process 0 of its machine.", readonly=True)
    data_parallel_index: Attribute[int] = Attribute("_ops", ProcessOps.data_parallel_index.__doc__, readonly=True)
    data_parallel_size: Attribute[int] = Attribute("_ops", ProcessOps.data_parallel_size.__doc__, readonly=True)
    is_last_process: Attribute[bool] = Attribute("_ops", readonly=True)
    use_distributed: Attribute[bool] = Attribute("_ops", readonly=True)

    @property
    def components(self) -> list[Any]:
        """The active plugin components, in the order hooks ask them."""
        return list(self.plugins.components)

    state = property(PartialState.of, PartialState.assign, doc=PartialState.of.__doc__)

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

    def __repr__(self) -> str:
        return active.describe(self)

    def __reduce__(self) -> tuple[Any, ...]:
        """Picklable, as Accelerate's ``Accelerator`` (``datasets.map`` pickles functions that use it): in another
        process a detached Kernel that answers the run's facts and refuses the rest in one line (:mod:`accel.active`)."""
        return active.pickled(self, Kernel)

    def __getattr__(self, name: str) -> Any:  # a member it lacks: a plugin's line for it, else Python's
        raise missing_member(self, name)

    __setattr__ = assign_member  # a member it lacks that a plugin explains: that line, not a new attribute

    # ---- the parts' members (accel.members): each is the same-named member of the part ---------------------

    # processes and collectives on nested data
    debug: Attribute[bool] = Attribute("_ops", ProcessOps.debug.__doc__)
    wait_for_everyone = Forward("_ops", ProcessOps.wait_for_everyone)
    print = Forward("_ops", ProcessOps.print)
    main_process_first = Forward("_ops", ProcessOps.main_process_first)
    local_main_process_first = Forward("_ops", ProcessOps.local_main_process_first)
    on_main_process = Forward("_ops", ProcessOps.on_main_process)
    on_local_main_process = Forward("_ops", ProcessOps.on_local_main_process)
    on_last_process = Forward("_ops", ProcessOps.on_last_process)
    on_process = Forward("_ops", ProcessOps.on_process)
    on_local_process = Forward("_ops", ProcessOps.on_local_process)
    split_between_processes = Forward("_ops", ProcessOps.split_between_processes)
    synchronize_rng_states = Forward("_ops", ProcessOps.synchronize_rng_states)
    gather = Forward("_ops", ProcessOps.gather)
    gather_object = Forward("_ops", ProcessOps.gather_object)
    gather_for_metrics = Forward("_ops", ProcessOps.gather_for_metrics)
    reduce = Forward("_ops", ProcessOps.reduce)
    pad_across_processes = Forward("_ops", ProcessOps.pad_across_processes)
    broadcast = Forward("_ops", ProcessOps.broadcast)
    profile = Forward("_ops", ProcessOps.profile)
    set_trigger = Forward("_ops", ProcessOps.set_trigger)
    check_trigger = Forward("_ops", ProcessOps.check_trigger)
    # Accelerate's dataloader arguments, read back
    split_batches: Attribute[bool] = Attribute("_arguments")
    non_blocking: Attribute[bool] = Attribute("_arguments")
    dataloader_config: Attribute[DataLoaderConfiguration] = Attribute("_arguments")
    device_placement: Attribute[bool] = Attribute("_arguments", DataArguments.device_placement.__doc__)
    rng_types: Attribute[tuple[str, ...]] = Attribute("_arguments", DataArguments.rng_types.__doc__)
    dispatch_batches: Attribute[bool] = Attribute("_arguments", readonly=True)
    use_seedable_sampler: Attribute[bool] = Attribute("_arguments", readonly=True)
    use_stateful_dataloader: Attribute[bool] = Attribute("_arguments", readonly=True)
    logging_dir: Attribute[str | None] = Attribute("_arguments", readonly=True)
    project_dir: Attribute[str | None] = Attribute("_arguments", DataArguments.project_dir.__doc__, readonly=True)
    # what prepare() returned
    prepare_model = Forward("_prepared", Prepared.prepare_model)
    prepare_optimizer = Forward("_prepared", Prepared.prepare_optimizer)
    prepare_data_loader = Forward("_prepared", Prepared.prepare_data_loader)
    prepare_scheduler = Forward("_prepared", Prepared.prepare_scheduler)
    model_init_context = Forward("_prepared", Prepared.model_init_context)
    unwrap_model = Forward("_prepared", Prepared.unwrap_model)
    _is_prepared = Forward("_prepared", Prepared.knows)
    free_memory = clear = Forward("_prepared", Prepared.free_memory)
    skip_first_batches = Forward("_prepared", Prepared.skip_first_batches)
    optimizer_step_was_skipped: Attribute[bool] = Attribute("_prepared", readonly=True)
    join_uneven_inputs = preparing.join_uneven_inputs
    # trackers (accel.tracking)
    log_with: Attribute[list[str]] = Attribute("_tracking", TrackingPart.log_with.__doc__)
    trackers: Attribute[list[Any]] = Attribute("_tracking", TrackingPart.trackers.__doc__)
    init_trackers = Forward("_tracking", TrackingPart.init_trackers)
    log = Forward("_tracking", TrackingPart.log)
    log_images = Forward("_tracking", TrackingPart.log_images)
    log_table = Forward("_tracking", TrackingPart.log_table)
    get_tracker = Forward("_tracking", TrackingPart.get_tracker)
    # checkpoints and exported weights (accel.checkpoint)
    save = Forward("_checkpoints", CheckpointPart.save)
    get_state_dict = Forward("_checkpoints", CheckpointPart.get_state_dict)
    register_for_checkpointing = Forward("_checkpoints", CheckpointPart.register_for_checkpointing)
    register_save_state_pre_hook = Forward("_checkpoints", CheckpointPart.register_save_state_pre_hook)
    register_load_state_pre_hook = Forward("_checkpoints", CheckpointPart.register_load_state_pre_hook)
    save_state = Forward("_checkpoints", CheckpointPart.save_state)
    wait_for_save = Forward("_checkpoints", CheckpointPart.wait_for_save)
    load_state = Forward("_checkpoints", CheckpointPart.load_state)
    latest_checkpoint = Forward("_checkpoints", CheckpointPart.latest_checkpoint)
    save_iteration: Attribute[int] = Attribute("_checkpoints", CheckpointPart.save_iteration.__doc__, readonly=True)
    save_model = Forward("_checkpoints", CheckpointPart.save_model)

    # ---- prepare ------------------------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: bool = True) -> Any:
        """Prepare models, optimizers, dataloaders and schedulers (any number, any order) for this run; return
        them in the same order (one object returned as itself). Other objects pass through unchanged."""
        check_prepare_arguments(args)
        self._hot = HotHooks(self.plugins.pm)
        self._accumulating = _Accumulate(self, ())  # it reads the hooks just resolved
        return self._prepared.prepare(args, device_placement)

    # ---- training step ------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward through the active plugins (scaler, engine, ...). The loss is divided by
        ``gradient_accumulation_steps`` so accumulated gradients average over micro-batches. Keyword arguments
        (``retain_graph=True``, ``inputs=[...]``) go on to ``Tensor.backward``."""
        if not getattr(loss, "requires_grad", False):
            raise UsageError(no_grad_message(loss))
        if self._loader_check_due:
            self._prepared.warn_unprepared_loaders()
        if self._hot.plain_backward:  # only the kernel's default answers: its call, made here
            steps = self._accumulation_steps  # scale_for_accumulation, inlined (one Python call fewer per step)
            if steps > 1:
                loss = loss / steps
            if kwargs:
                loss.backward(**kwargs)
            else:
                loss.backward()  # `**{}` would take the interpreter's slower call path on every step
        else:
            self._hot.backward(kernel=self, loss=loss, backward_kwargs=kwargs)

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
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)  # torch reads either as float
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

    # ---- the end ------------------------------------------------------------------------------------------

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
            self._checkpoints.finish(release=True)
        finally:
            self._tracking.end()
            if not self._torn_down:
                self.call_isolated("accel_end_training", kernel=self, trackers=False)
            self._teardown()

    def _teardown(self) -> None:
        if self._torn_down:
            return
        self._torn_down = True
        self._checkpoints.finish(at_exit=True)  # at interpreter exit: an asynchronous save in flight, no collectives
        self._tracking.end()  # a script that never called end_training still gets its logs flushed
        self.call_isolated("accel_teardown", kernel=self)
        if self in active.ACTIVE:
            active.ACTIVE.remove(self)
        if not active.ACTIVE:
            self._checkpoints.exit_if_lost()  # an asynchronous save lost at interpreter exit: exit code 1


active.KERNEL_CLASS[:] = [Kernel]  # what PartialState() makes when a script has no Kernel


def active_kernel() -> Kernel | None:
    """The most recently created Kernel of this process that has not ended, if any (:mod:`accel.active`)."""
    return cast("Kernel | None", active.active_kernel())
