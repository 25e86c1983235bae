"""The accel hook contract.

Every plugin inherits this file. Each hook says **when** it is called, **who answers** and **what it returns**:

- *first answer wins* (``firstresult``): hooks are asked in order until one returns something other than ``None``.
  The kernel's own answer (registered ``trylast``) comes last, so a hook always has an answer.
- *everyone*: every implementation is called, one at a time; an exception in one is reported with the plugin's
  name (for trackers and teardown it is warned about and skipped, so logging never stops training).
- *wrapper*: any hook may also be implemented with ``@hookimpl(wrapper=True)`` to act around the others
  (e.g. a precision plugin unscales gradients before the strategy clips them).

There are two kinds of implementers:

1. **Discovery hooks** (``accel_add_options``, ``accel_detect_hardware``, ``accel_activate``) are implemented at
   module level by the module an entry point names (group ``accel``). They must be cheap and **must not import
   torch** (they run for ``accel --help``, ``accel plugins``, ``accel env``).
2. **Runtime hooks** (everything else) are answered only by the :class:`accel.Component` objects that
   ``accel_activate`` returned for this run. Call order: strategy, compiler, precision, other roles, kernel
   defaults. A plugin module that implements a runtime hook at module level is refused with a clear error, so an
   installed plugin never changes a run it was not chosen for.

Rules inherited from pluggy: an implementation may accept any subset of a hook's arguments, but must not give them
default values (arguments with defaults are never passed). Misspelt hook names are an error naming the plugin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Mapping

import pluggy

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from accel.contract import Collectives, Component, HardwareInfo, ItemRecord, LaunchPlan, Topology
    from accel.kernel import Kernel
    from accel.options import Options, Settings

PROJECT = "accel"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: Hooks a plugin module may implement at module level. All others belong on components.
DISCOVERY_HOOKS = ("accel_add_options", "accel_detect_hardware", "accel_activate")


# --------------------------------------------------------------------------------------------------------------
# Discovery (plugin modules; no torch import)


@hookspec
def accel_add_options(options: Options) -> None:
    """Declare the plugin's launch flags, config-file keys, environment variables and Kernel arguments.

    When: each time the CLI builds a parser or validates a config file, and when a Kernel resolves its settings.
    Who: everyone. Returns nothing; call ``options.add(name, type=..., default=..., config_key=..., help=...)``.
    A name declared twice (by two plugins) is an error naming both.
    """


@hookspec
def accel_detect_hardware(env: Mapping[str, str]) -> HardwareInfo | None:
    """Report hardware this plugin can drive, from cheap checks (environment, files, ``importlib.util.find_spec``).

    When: ``accel env``, ``accel launch`` (default process count for ``--multi_gpu``) and Kernel start-up.
    Who: everyone; the kernel keeps the answer with the highest ``priority`` (its own CPU answer has priority 0).
    Returns a :class:`~accel.contract.HardwareInfo` or ``None``.
    """


@hookspec
def accel_activate(settings: Settings) -> Component | None:
    """Decide whether the plugin takes part in this run and return the component that will answer runtime hooks.

    When: once per Kernel (in every worker, ``phase == "run"``) and once in ``accel launch`` (``phase ==
    "launch"``, with the planned ``world_size``). Who: everyone, one at a time.
    Returns a :class:`~accel.Component` or ``None``. A strategy typically activates when it is selected
    (``settings.is_selected(name)``) or, for the default data-parallel strategy, when ``world_size > 1``. If two
    components claim one exclusive role, the one the user selected wins; with no selection it is an error naming
    both. Must not touch devices or start processes: that happens in ``accel_setup``.
    """


# --------------------------------------------------------------------------------------------------------------
# Launching (components active in ``accel launch``)


@hookspec(firstresult=True)
def accel_launch(plan: LaunchPlan) -> int | None:
    """Start the worker processes and wait for them.

    When: ``accel launch`` after settings are resolved and components activated (``plan.dry_run``: only print
    the exact command and return 0). Who: first answer wins; a strategy that needs several processes answers
    (DDP through torchrun); the kernel's default runs one ``python script`` process and refuses more.
    Returns the exit code.
    """


# --------------------------------------------------------------------------------------------------------------
# Process start-up and teardown (components, in each worker)


@hookspec
def accel_setup(kernel: Kernel) -> None:
    """Prepare this process: initialise the process group, pick the device, seed.

    When: once, at the end of ``Kernel()``. Who: everyone, strategy first. Returns nothing.
    """


@hookspec(firstresult=True)
def accel_topology(kernel: Kernel) -> Topology | None:
    """Where this process sits: process index, count, local index and local count.

    When: once, after ``accel_setup``. Who: first answer wins (strategy); default: a single process.
    """


@hookspec(firstresult=True)
def accel_device(kernel: Kernel) -> torch.device | None:
    """The device this process trains on.

    When: once, after ``accel_topology``. Who: first answer wins; default: the current accelerator of torch
    (``torch.accelerator``) unless ``cpu=True``, else the CPU.
    """


@hookspec(firstresult=True)
def accel_collectives(kernel: Kernel) -> Collectives | None:
    """The object that talks between processes (all_gather, all_reduce, broadcast, barrier, objects).

    When: once, after ``accel_device``; the Kernel keeps it, so collectives never go through a hook per call.
    Who: first answer wins (strategy); default: the single-process identity.
    """


@hookspec
def accel_teardown(kernel: Kernel) -> None:
    """Release what ``accel_setup`` acquired (destroy the process group, finish trackers).

    When: ``kernel.end_training()`` or interpreter exit, once. Who: everyone, each isolated (an error is warned
    about, the others still run). Returns nothing.
    """


# --------------------------------------------------------------------------------------------------------------
# prepare()


@hookspec
def accel_transform_model(kernel: Kernel, model: torch.nn.Module) -> None:
    """Change a model in place before it is placed and wrapped (compile it, swap layers for fp8, add activation
    checkpointing). In place matters: the user's module stays the module ``unwrap_model`` returns, and compiling
    before DDP wraps is what makes compilation happen at all.

    When: ``prepare()``, once per model, before ``accel_prepare_training``. Who: everyone. Returns nothing.
    """


@hookspec(firstresult=True)
def accel_prepare_training(
    kernel: Kernel, models: list[Any], optimizers: list[Any], schedulers: list[Any]
) -> tuple[list[Any], list[Any], list[Any]] | None:
    """Set up models, optimizers and schedulers *together* (a DeepSpeed engine needs all three; FSDP must swap the
    optimizer's parameters after sharding).

    When: ``prepare()``, once per call, with the objects of that call. Who: first answer wins; the default calls
    ``accel_wrap_model`` for each model, then ``accel_wrap_optimizer`` for each optimizer, and keeps schedulers.
    Returns the three lists, same lengths and order.
    """


@hookspec(firstresult=True)
def accel_wrap_model(kernel: Kernel, model: torch.nn.Module) -> torch.nn.Module | None:
    """Place a model on the device and wrap it for the strategy (``DistributedDataParallel(model)``).

    When: by the default ``accel_prepare_training``, once per model. Who: first answer wins (strategy);
    default: ``model.to(kernel.device)``. Returns the module the user will call.
    """


@hookspec(firstresult=True)
def accel_wrap_optimizer(kernel: Kernel, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """Adapt an optimizer to the wrapped models (ZeRO, parameter swaps). Called after every model was wrapped.

    Who: first answer wins; default: the optimizer unchanged. The Kernel then wraps the result so that ``step``
    and ``zero_grad`` follow gradient accumulation.
    """


@hookspec(firstresult=True)
def accel_prepare_dataloader(kernel: Kernel, dataloader: Any) -> Any | None:
    """Make a dataloader yield this process's share of batches on the right device.

    When: ``prepare()``, once per dataloader. Who: first answer wins; default: the kernel's sharding
    (``accel.data.shard_dataloader``: disjoint shards by process index, ``even_batches``, moves batches to the
    device, tracks the end of the epoch for ``gather_for_metrics``). A plugin that needs its own loader (XLA) may
    wrap the kernel's: ``accel.data.shard_dataloader(kernel, dataloader)``.
    """


@hookspec(firstresult=True)
def accel_autocast(kernel: Kernel) -> Callable[[], ContextManager[Any]] | None:
    """A zero-argument factory of the context that the forward of prepared models and ``kernel.autocast()`` run
    under (``functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)``).

    When: once, at the end of ``Kernel()``. Who: first answer wins; a strategy that realises the precision natively
    (FSDP's MixedPrecisionPolicy, DeepSpeed's bf16) answers ``contextlib.nullcontext`` to keep the precision
    plugin out; the precision plugin answers its autocast; default: ``None`` (no context, models are not wrapped).
    """


# --------------------------------------------------------------------------------------------------------------
# Training step. Answers must be consistent for a given object: the kernel resolves who answers at prepare().


@hookspec(firstresult=True)
def accel_backward(kernel: Kernel, loss: torch.Tensor) -> bool | None:
    """Run backward for ``loss``.

    When: ``kernel.backward(loss)``, each micro-batch. Who: first answer wins: a strategy that owns backward
    (DeepSpeed's engine), then precision (``scaler.scale(loss).backward()``), then the default
    ``loss.backward()``. Scale the loss for accumulation with ``kernel.scale_for_accumulation(loss)`` unless you
    own accumulation. Returns ``True`` when done.
    """


@hookspec(firstresult=True)
def accel_optimizer_step(kernel: Kernel, optimizer: torch.optim.Optimizer) -> bool | None:
    """Apply an optimizer step. Only called on steps where gradients are synchronised.

    Who: first answer wins (strategy: DeepSpeed engine, XLA; precision: ``scaler.step`` + ``update``; default:
    ``optimizer.step()``). Returns ``True`` if the step was applied, ``False`` if it was skipped (inf/NaN
    gradients); a skipped step also skips the scheduler and sets ``optimizer.step_was_skipped``.
    """


@hookspec(firstresult=True)
def accel_zero_grad(kernel: Kernel, optimizer: torch.optim.Optimizer, set_to_none: bool) -> bool | None:
    """Reset gradients. Only called on steps where gradients are synchronised.

    Who: first answer wins; default: ``optimizer.zero_grad(set_to_none)``. Returns ``True``.
    """


@hookspec(firstresult=True)
def accel_no_sync(kernel: Kernel, model: torch.nn.Module) -> ContextManager[Any] | None:
    """The context that skips gradient synchronisation for one micro-batch (gradient accumulation).

    When: ``kernel.no_sync(model)`` and ``kernel.accumulate(model)`` on non-sync steps. Who: first answer wins;
    DDP answers ``model.no_sync()``; default: no context.
    """


@hookspec(firstresult=True)
def accel_clip_grad_norm(
    kernel: Kernel, parameters: list[torch.nn.Parameter], max_norm: float, norm_type: float
) -> torch.Tensor | None:
    """Clip gradients by their global norm and return the norm (before clipping).

    When: ``kernel.clip_grad_norm_`` on sync steps, after ``accel_unscale_gradients``. Who: first answer wins
    (FSDP: sharded gradients; DeepSpeed: the engine); default: ``torch.nn.utils.clip_grad_norm_``.
    """


@hookspec
def accel_unscale_gradients(kernel: Kernel) -> None:
    """Bring gradients to their true scale before they are inspected or clipped (a grad scaler's ``unscale_``).

    When: ``kernel.unscale_gradients()``, and before ``clip_grad_norm_``/``clip_grad_value_`` on sync steps.
    Who: everyone (precision plugins with a scaler). Returns nothing.
    """


# --------------------------------------------------------------------------------------------------------------
# State: checkpoints and exported weights


@hookspec
def accel_state_items(kernel: Kernel) -> Mapping[str, Any] | None:
    """Extra stateful objects (with ``state_dict``/``load_state_dict``) to include in checkpoints, by key, e.g.
    ``{"grad_scaler": scaler}``.

    When: ``save_state`` and ``load_state``. Who: everyone; a key given by two plugins is an error naming both.
    """


@hookspec
def accel_save_state(kernel: Kernel, items: Mapping[str, Any], directory: Path) -> Mapping[str, ItemRecord] | None:
    """Write the checkpoint items this plugin owns (FSDP: sharded model/optimizer with
    torch.distributed.checkpoint; DeepSpeed: the engine's checkpoint) into ``directory``.

    When: ``save_state``, on every process, inside the not-yet-published checkpoint directory. Who: everyone; each
    returns ``{key: ItemRecord}`` for the keys it wrote, and the kernel writes every key nobody claimed in its own
    formats (safetensors / JSON / weights-only torch files) and records all of it in the manifest.
    A key claimed twice is an error naming both plugins.
    """


@hookspec
def accel_load_state(
    kernel: Kernel, items: Mapping[str, Any], directory: Path, records: Mapping[str, ItemRecord]
) -> Iterable[str] | None:
    """Restore the items whose manifest record names this plugin.

    When: ``load_state``, on every process, after the kernel checked the manifest. Who: everyone; returns the keys
    it restored. A record naming a plugin that is not active is an error naming the plugin to install.
    """


@hookspec(firstresult=True)
def accel_model_state_dict(kernel: Kernel, model: torch.nn.Module) -> dict[str, Any] | None:
    """The full, unsharded state dict of a prepared model (gathering FSDP shards or ZeRO-3 partitions), on the
    main process; other processes may return an empty dict.

    When: ``kernel.get_state_dict(model)`` and ``save_model``. Who: first answer wins; default:
    ``kernel.unwrap_model(model).state_dict()``.
    """


# --------------------------------------------------------------------------------------------------------------
# Tracking


@hookspec
def accel_init_trackers(kernel: Kernel, project_name: str, config: Mapping[str, Any], init_kwargs: Mapping[str, Any]) -> None:
    """Start a run in each active tracker and record the hyper-parameters.

    When: ``kernel.init_trackers(...)``. Who: every tracker component, each isolated (a failure is warned about
    once and that tracker is skipped from then on). ``init_kwargs`` is the whole mapping; take your own entry.
    """


@hookspec
def accel_log(kernel: Kernel, values: Mapping[str, Any], step: int | None) -> None:
    """Log values. When: ``kernel.log(values, step)``. Who: every tracker, each isolated as above.

    Tracker components are called on the main process only, unless the component sets
    ``main_process_only = False``."""


@hookspec
def accel_end_training(kernel: Kernel) -> None:
    """The script ended normally: finish tracker runs; a strategy may wait for every process here so none tears
    down while another still communicates. When: ``kernel.end_training()`` (not at interpreter exit, which may
    follow an error). Who: every component, each isolated."""
