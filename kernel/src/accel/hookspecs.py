"""The accel hook contract.

Every plugin inherits this file. Each hook says **when** it is called, **who answers** and **what it returns**:

- *first answer wins* (``firstresult``): hooks are asked in order until one returns something other than ``None``.
  The kernel's own answer (registered ``trylast``) comes last, so every such hook has an answer except
  ``accel_autocast``, whose ``None`` means "no context".
- *everyone*: every implementation is called, one at a time; an exception in one is reported with the plugin's
  name (for the tracking hooks, ``accel_end_training`` and ``accel_teardown`` it is warned about and the others
  still run, so logging never stops training).
- *wrapper*: any hook may also be implemented with ``@hookimpl(wrapper=True)`` to act around the others
  (e.g. a precision plugin unscales gradients before the strategy clips them). Every hook call goes through
  pluggy (:mod:`accel.dispatch`), so wrappers run on every hook. Where the kernel calls the implementations of a
  hook one at a time (the discovery hooks, tracking, ``accel_end_training``, ``accel_teardown`` and the checkpoint
  state hooks), a wrapper runs around each of those calls and sees that implementation's result (a list of at most
  one answer); elsewhere around the whole call. ``ACCEL_TRACE_PLUGINS=1`` prints every hook call to stderr
  (pluggy's tracing).

There are two kinds of implementers:

1. **Discovery hooks** (``accel_add_options``, ``accel_detect_hardware``, ``accel_activate``,
   ``accel_config_questions``, ``accel_unavailable_reason``, ``accel_estimate_memory``, ``accel_explain_name``)
   are implemented at
   module level by the module an entry point names (group ``accel``). They must be cheap and **must not import
   torch** (they run for ``accel --help``, ``accel plugins``, ``accel env``).
2. **Runtime hooks** (everything else) are answered only by the :class:`accel.Component` objects that
   ``accel_activate`` returned for this run. Call order: strategy, compiler, precision, other roles, kernel
   defaults. A plugin module that implements a runtime hook at module level is refused with a clear error, so an
   installed plugin never changes a run it was not chosen for.

Rules inherited from pluggy: an implementation may accept any subset of a hook's arguments, but must not give them
default values (pluggy does not pass such arguments, so the implementation would always get its default): a plugin
that does is refused, naming the plugin, the hook and the argument. Misspelt hook names are an error naming the
plugin. Both are checked when plugins are discovered, for the module and for the component classes it lists in
``accel_components`` (``accel plugins`` shows such a plugin as failed), and again for each component ``Kernel()``
registers.

Plugins may add hooks of their own (pytest's ``pytest_addhooks``, declared rather than called): a plugin module lists
them in ``accel_hookspecs``, strings ``"package.module"`` or ``"package.module:Class"`` naming modules or classes whose
functions are marked ``@accel.spi.hookspec``. Each hook is named ``accel_<plugin>_<what>`` with its own plugin's name;
another name, or ``accel_hookspecs`` given as a string instead of a list, marks the plugin failed with one line. They
are added when plugins are discovered, after every plugin module is imported and registered and before any implementation (module level or
``accel_components`` class) is checked, so plugin B may implement a hook of plugin A whatever order they load in;
an ``accel_hookspecs`` entry that fails to import, or that holds no hook, marks its plugin failed. Added hooks are
runtime hooks: components implement them, and A's component calls them through the kernel's hook relay,
``kernel.hook.accel_a_what(kernel=kernel, ...)``, by pluggy's rules (the first answer for a
``@hookspec(firstresult=True)``, else the list of every answer). An implementation of a hook whose plugin may be
absent (not installed, or disabled) is marked ``@hookimpl(optionalhook=True)``; without the mark it is refused as
an unknown hook when that plugin is absent.

Roles are declared, never negotiated through call order:

- A strategy that realises a precision itself (FSDP's ``MixedPrecisionPolicy``, DeepSpeed's bf16/fp16 engine, XLA's
  autocast) lists it in its ``provides`` (``"precision:bf16"``). When the run's ``mixed_precision`` is one of those,
  the kernel leaves the precision component out of the run (it answers no hook: no autocast, no grad scaler, no
  fp8 layers); otherwise the precision component is in charge of precision.
- A strategy that shards parameters over processes declares ``"sharding"`` in ``provides``, so components that
  change parameters in ways a sharding strategy cannot take (IPEX's prepacked weights) can refuse it by that
  declaration rather than by the strategy's name.
"""

# Why one file of this size: it is the contract and the single source of the hook documentation (docs/hooks.md is
# generated from its docstrings, which are most of its lines); a plugin author reads one file, as pytest's
# hookspec.py.

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import pluggy

from accel.deprecations import hook_warning

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from accel.contract import (
        Collectives,
        Component,
        HardwareInfo,
        ItemRecord,
        KernelView,
        LaunchPlan,
        Question,
        Topology,
    )
    from accel.memory import MemoryQuery, MemoryRow, ModelSummary
    from accel.options import Options, Settings

PROJECT = "accel"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: Hooks a plugin module may implement at module level. All others belong on components.
DISCOVERY_HOOKS = (
    "accel_add_options",
    "accel_detect_hardware",
    "accel_activate",
    "accel_config_questions",
    "accel_unavailable_reason",
    "accel_estimate_memory",
    "accel_explain_name",
)


# --------------------------------------------------------------------------------------------------------------
# Discovery (plugin modules; no torch import)


@hookspec
def accel_add_options(options: Options) -> None:
    """Declare the plugin's launch flags, config-file keys, environment variables and Kernel arguments.

    When: each time the CLI builds a parser or validates a config file, and when a Kernel resolves its settings.
    Who: everyone. Returns nothing; call ``options.add(name, type=..., default=..., config_key=..., help=...)``
    (every argument and ``type`` value: docs/plugin-api.md);
    ``check=fn`` adds a test of the converted value (``fn(value)`` returns what is wrong, or ``None``).
    A name declared twice (by two plugins) is an error naming both. A plugin whose implementation raises anything
    else is marked failed and left out with every option it declared; runs that do not ask for it go on.
    """


@hookspec
def accel_unavailable_reason() -> str | None:
    """Why this installed plugin cannot run in this environment, or ``None`` when it can: its backend library is
    missing, or installed but built for another torch (IPEX refuses to import, torch-xla fails with an ``undefined
    symbol``).

    When: each time plugins are loaded (``accel plugins``, ``accel env``, ``accel launch``, each ``Kernel()``),
    right after the plugin module is imported and registered. Who: each plugin module for itself (only its own
    answer is used), at module level like the other discovery hooks: cheap, and without importing torch or the
    backend in this process (read versions with ``importlib.metadata``, ``importlib.util.find_spec``; to learn the
    exact import error, try the import in a child interpreter, only when the cheap checks say it may fail).
    Returns one line saying what is missing or mismatched and how to fix it (``"intel-extension-for-pytorch 2.8.0
    needs torch 2.8.*, found 2.13.0: install torch==2.8.* ..."``), or ``None``. An exception raised here marks the
    plugin failed.

    A plugin with a reason is listed as ``unavailable`` with it (``accel plugins``, ``--json``, ``accel env``). Its
    options stay declared, so its flags, config keys and ``Kernel`` arguments still parse. Of the other discovery
    hooks it is asked only ``accel_activate``, where it may still take part in what needs no backend here (a TPU
    pod launch runs only gcloud locally) and must otherwise return ``None``. A run that asks for it (``--plugin
    NAME``, ``Kernel(plugins=[NAME])``, or one of its options set to a value other than the default) while it does
    not take part is refused with a ``UsageError`` that gives the reason.
    """


@hookspec
def accel_detect_hardware(env: Mapping[str, str]) -> HardwareInfo | None:
    """Report hardware this plugin can drive, from cheap checks (environment, files, ``importlib.util.find_spec``).

    When: ``accel env``, ``accel config`` (to choose its defaults), ``accel launch`` (default process count for
    ``--multi_gpu``; whether ``--enable_cpu_affinity`` has a GPU to bind to) and ``notebook_launcher`` without a
    process count; never inside a ``Kernel()`` (it asks ``accel_device``). Who: everyone; the kernel keeps the answer with the highest ``priority`` (its own CPU answer has priority 0).
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
    both. Must not touch devices or start processes: that happens in ``accel_setup``. A ``UsageError`` refuses the
    run (one line); any other exception stops the run only when the plugin was selected, else the plugin is marked
    failed and left out.
    """


@hookspec
def accel_config_questions(answers: Mapping[str, Any]) -> Sequence[Question] | None:
    """The plugin's questions for the interactive ``accel config``, given the answers so far.

    When: ``accel config`` only (never in a run). The kernel asks its own questions in three sections: (1) the
    machine: ``distributed_type`` (``"NO"``, ``"MULTI_CPU"``, ``"MULTI_GPU"``, ``"XLA"``, or the strategy chosen in
    the same section, ``"DEEPSPEED"``/``"FSDP"``), ``cpu``, ``num_machines``, ``machine_rank``, ``main_process_ip``,
    ``main_process_port``, ``same_network``, ``rdzv_backend``, ``debug``; (2) compilation: ``dynamo_backend``
    (``"no"`` or a backend); (3) ``num_processes``, ``gpu_ids``, ``mixed_precision``. After each section it calls
    this hook with every answer so far, keyed by option name (plus the ``store=False`` keys), asks the first
    returned question whose key has no answer yet (plugins in call order, questions in list order), and calls the
    hook again with that answer added, until no implementation returns an unanswered question. So return, each
    time, every question that applies to these answers, in the order they should be asked: answered ones are
    skipped, and a follow-up appears right after the answer it depends on (``my_stage`` >= 2 -> offload devices).

    Who: everyone, at module level like the other discovery hooks (cheap, no torch import). A plugin asks only about
    its own backend, and only when the answers select it (``answers.get("distributed_type") == "MY_STRATEGY"``,
    ``answers.get("dynamo_backend", "no") != "no"``, ``answers.get("mixed_precision") == "fp8"``). A question's
    ``key`` should be an option the plugin declares in ``accel_add_options`` with an Accelerate-compatible
    ``config_key``; that option checks the answer and places it in the YAML file.

    Returns a sequence of :class:`~accel.contract.Question` records, or ``None``. A complete example, Accelerate's
    questions for a sharding strategy, is accel-plugin-deepspeed's (``plugins/deepspeed``); in short::

        @hookimpl
        def accel_config_questions(answers):
            if answers.get("distributed_type") != "MY_STRATEGY":
                return None
            questions = [Question("my_stage", "Which sharding stage should be used?",
                                  kind="select", choices=("0", "1", "2", "3"), default="2")]
            if int(answers.get("my_stage", 0)) >= 2:
                questions.append(Question("offload_optimizer_device", "Where to offload optimizer states?",
                                          kind="select", choices=("none", "cpu", "nvme"), default="none"))
            return questions
    """


@hookspec
def accel_estimate_memory(model: ModelSummary, query: MemoryQuery) -> Sequence[MemoryRow] | None:
    """Per-process memory of the model states (parameters, gradients, optimizer state; no activations) under this
    plugin's strategy, for each of its option sets and each precision asked.

    When: ``accel estimate-memory MODEL`` only (never in a run), once, after the model was built on the meta device
    and summarised. Who: everyone, at module level like the other discovery hooks (cheap, no torch import: the
    arithmetic needs only the :class:`~accel.spi.ModelSummary`); the kernel's own answer is the single-process
    row. A strategy answers for itself, whether selected or not (the user asks before choosing); other plugins
    return ``None``. A plugin that splits parameters over a group of processes (tensor parallelism) answers with
    one row per group size that divides ``query.num_processes``, naming it in ``options`` (``"tp=2, dp=2"``); it
    may read each parameter's shape and owning module type in ``model.parameters`` to know what it shards.

    Returns a sequence of :class:`~accel.spi.MemoryRow`: one per option set (``options``, e.g. ``"ZeRO-2 +
    offload optimizer"``) and dtype of ``query.dtypes`` (``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``: accel's
    ``mixed_precision`` values), for ``query.num_processes`` processes and ``query.optimizer``; bytes on the training
    device in ``parameters``, ``gradients`` (communication buckets included), ``optimizer`` (fp32 master weights
    included where they are a copy), bytes moved to host memory by offloading in ``cpu``, the largest layer gathered
    at once in ``gathered``. A combination the plugin refuses in a run is a row with ``supported=False`` and the
    reason in ``note``. An exception is an error naming the plugin.
    """


@hookspec(firstresult=True)
def accel_explain_name(kind: str, name: str) -> str | None:
    """What to use instead of a name ``Kernel`` does not know, when it is another library's name: the line the user
    sees instead of Python's bare error.

    When: ``Kernel(NAME=...)`` with an argument no plugin declares (``kind="argument"``), and reading or assigning an
    attribute a Kernel does not have (``kind="member"``, public names only). Who: first answer wins, at module level
    like the other discovery hooks (cheap, no torch import); the kernel has no answer of its own.
    accel-accelerate's ``accelerate-names`` plugin answers for Accelerate's ``Accelerator`` arguments and members
    (``Kernel(deepspeed_plugin=...)``: use ``--use_deepspeed`` or ``Kernel(plugins=["deepspeed"])``).
    Returns one line naming what to use, or ``None`` (then the argument is a ``TypeError`` and the attribute an
    ``AttributeError`` with Python's usual words). An answer for an argument is raised as a ``UsageError``; for a
    member, as the ``AttributeError``'s message.
    """


# --------------------------------------------------------------------------------------------------------------
# Launching (components active in ``accel launch``)


@hookspec(firstresult=True)
def accel_launch(plan: LaunchPlan) -> int | None:
    """Start the worker processes and wait for them.

    When: ``accel launch`` after settings are resolved and components activated (``plan.dry_run``: only print
    the exact command and return 0). Who: first answer wins; a strategy that needs several processes answers
    (DDP through torchrun); the kernel's default runs one ``python script`` process (a run of more processes
    needs a component that provides ``distributed``, which the kernel checks before). A launcher component answers
    with ``@hookimpl(tryfirst=True)``, before the strategy. Launcher is not an exclusive role: two selected
    launchers both take part, the first one called answers and the other is never asked. Which one is first follows
    the order the components were registered in (within ``tryfirst``, the one registered last), not the order of the
    ``--plugin`` flags; ``accel launch --dry-run --verbose`` shows it (``accel_launch: a:launcher (then
    b:launcher, ...)``): select one launcher. Returns the exit code. What a strategy's launcher must honour or
    refuse (``plan.settings``: machines, ranks, addresses, ``gpu_ids``, ...) is listed in docs/plugin-api.md; the
    conformance suites check it (``accel.testing.launch_check``).
    """


# --------------------------------------------------------------------------------------------------------------
# Process start-up and teardown (components, in each worker)


@hookspec
def accel_setup(kernel: KernelView) -> None:
    """Prepare this process: initialise the process group, choose the device ``accel_device`` will report,
    import the backend and refuse combinations it cannot run (one line, ``UsageError``).

    When: once, at the end of ``Kernel()``, after ``accel_activate``. Who: everyone, strategy first. Returns
    nothing.
    """


@hookspec(firstresult=True)
def accel_topology(kernel: KernelView) -> Topology | None:
    """Where this process sits: process index, count, local index and local count, and, for a strategy whose
    processes do not each read their own data (tensor or context parallel groups read the same batches), its
    data-parallel index and size (``Topology.data_parallel_index``/``data_parallel_size``): prepared dataloaders
    shard by them, ``gather_for_metrics`` keeps one process's values per data shard, and a prepared scheduler
    counts data-parallel processes.

    When: once, after ``accel_setup``. Who: first answer wins (strategy); default: a single process.
    """


@hookspec(firstresult=True)
def accel_device(kernel: KernelView) -> torch.device | None:
    """The device this process trains on.

    When: once, after ``accel_topology``. Who: first answer wins; default: the current accelerator of torch
    (``torch.accelerator``) unless ``cpu=True``, else the CPU.
    """


@hookspec(firstresult=True)
def accel_collectives(kernel: KernelView) -> Collectives | None:
    """The object that talks between processes (all_gather, all_reduce, broadcast, barrier, objects).

    When: once, after ``accel_device``; the Kernel keeps it, so collectives never go through a hook per call.
    Who: first answer wins (strategy); default: the single-process identity.
    """


@hookspec
def accel_teardown(kernel: KernelView) -> None:
    """Release what ``accel_setup`` acquired (destroy the process group, an engine). Trackers do not answer it:
    they finish their runs in ``accel_end_training``, which the kernel calls first.

    When: ``kernel.end_training()`` (after ``accel_end_training``) or interpreter exit, once; also after a failure,
    so it must not wait for other processes. Who: everyone, each isolated (an error is warned about, the others
    still run). Returns nothing.
    """


# --------------------------------------------------------------------------------------------------------------
# prepare()


@hookspec(firstresult=True)
def accel_model_init_context(kernel: KernelView) -> AbstractContextManager[Any] | None:
    """The context in which the script builds its models (``with kernel.model_init_context(): model = Net()``),
    so a strategy can create parameters already partitioned over the processes (DeepSpeed's ``zero.Init``)
    instead of materialising the whole model in every process first.

    When: ``kernel.model_init_context()``, before ``prepare()``. Who: first answer wins (strategy); default: no
    context (``contextlib.nullcontext()``), so scripts that use it run unchanged with every plugin.
    """


@hookspec
def accel_transform_model(kernel: KernelView, model: torch.nn.Module) -> None:
    """Change a model in place before it is placed and wrapped (compile it, swap layers for fp8, add activation
    checkpointing). In place matters: the user's module stays the module ``unwrap_model`` returns, and compiling
    before DDP wraps is what makes compilation happen at all.

    When: ``prepare()``, once per model, before ``accel_prepare_training``. Who: everyone. Returns nothing.
    """


@hookspec(firstresult=True)
def accel_prepare_training(
    kernel: KernelView, models: list[Any], optimizers: list[Any], schedulers: list[Any], dataloaders: list[Any]
) -> tuple[list[Any], list[Any], list[Any]] | None:
    """The strategy's one entry point in ``prepare()``: place and wrap the models (a data-parallel or sharding
    wrapper), adapt the optimizers to them (ZeRO, parameter swaps after sharding) and keep or replace the
    schedulers, *together* (a DeepSpeed engine needs all three; FSDP must swap the optimizer's parameters after
    sharding).

    When: ``prepare()``, once per call, with the objects of that call (possibly empty lists), after
    ``accel_transform_model``. ``dataloaders`` are the DataLoaders of the same call, in call order and not yet
    prepared (they are prepared right after): read them, do not change them (a strategy that must know the
    per-process batch size, like DeepSpeed's micro-batch size, takes it here). Who: first answer wins (strategy);
    other components act around it with ``@hookimpl(wrapper=True)`` (IPEX optimizes the pairs before, a precision
    plugin records the optimizers after); default: each model moved to ``kernel.device``, optimizers and
    schedulers unchanged. Returns the three lists (models, optimizers, schedulers), same lengths and order; the
    kernel then wraps each optimizer so that ``step`` and ``zero_grad`` follow gradient accumulation.
    """


@hookspec(firstresult=True)
def accel_prepare_dataloader(kernel: KernelView, dataloader: Any) -> Any | None:
    """Make a dataloader yield this process's share of batches on the right device.

    When: ``prepare()``, once per dataloader. Who: first answer wins; default: the kernel's sharding
    (``accel.spi.shard_dataloader``: disjoint shards by process index, ``even_batches``, moves batches to the
    device, tracks the end of the epoch for ``gather_for_metrics``). A plugin that needs its own loader (XLA) may
    wrap the kernel's: ``accel.spi.shard_dataloader(kernel, dataloader)``.
    """


@hookspec(firstresult=True)
def accel_autocast(kernel: KernelView) -> Callable[[], AbstractContextManager[Any]] | None:
    """A zero-argument factory of the context that the forward of prepared models and ``kernel.autocast()`` run
    under (``functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)``).

    When: once, at the end of ``Kernel()``. Who: first answer wins. The precision component answers its autocast
    (and sets up what goes with it, such as a grad scaler). A strategy answers only for a precision it declares in
    ``provides`` (then the kernel has left the precision component out): its own autocast (XLA), or
    ``contextlib.nullcontext`` where the precision lives in the wrapped model (FSDP's ``MixedPrecisionPolicy``,
    DeepSpeed's engine). Default: ``None``. With an answer, each prepared model is wrapped so its forward runs
    under the context and returns floating-point outputs in fp32; with ``None`` models are not wrapped.
    """


# --------------------------------------------------------------------------------------------------------------
# Training step. Answers must be consistent for a given object. ``accel_backward``, ``accel_optimizer_step``,
# ``accel_zero_grad``, ``accel_no_sync``, ``accel_clip_grad_norm`` and ``accel_unscale_gradients`` run every step,
# so the kernel resolves their implementations once (at Kernel() and again at each prepare(), accel/dispatch.py)
# and calls them directly, in pluggy's order and with pluggy's rules (first answer wins; everyone for unscale). A
# hook that has a wrapper implementation, or any hook while call monitoring or tracing is on at that moment, keeps
# pluggy's dispatch. Register components through accel_activate, not later.


@hookspec(firstresult=True)
def accel_backward(kernel: KernelView, loss: torch.Tensor, backward_kwargs: dict[str, Any]) -> bool | None:
    """Run backward for ``loss``.

    When: ``kernel.backward(loss, **backward_kwargs)``, each micro-batch. Who: first answer wins: a strategy that
    owns backward (DeepSpeed's engine), then precision (``scaler.scale(loss).backward()``), then the default
    ``kernel.scale_for_accumulation(loss).backward(**backward_kwargs)``. Scale the loss for accumulation with
    ``kernel.scale_for_accumulation(loss)`` unless you own accumulation. ``backward_kwargs`` are the keyword
    arguments the script gave (``retain_graph``, ``inputs``, ...): pass them on to ``Tensor.backward``, or raise
    ``accel.UsageError`` naming the ones your backend cannot honour. Returns ``True`` when done.
    """


@hookspec(firstresult=True)
def accel_optimizer_step(kernel: KernelView, optimizer: torch.optim.Optimizer) -> bool | None:
    """Apply an optimizer step.

    When: ``optimizer.step()`` of a prepared optimizer, only on steps where gradients are synchronised (on the
    others the call does nothing). Who: first answer wins (strategy: DeepSpeed engine, XLA; precision: ``scaler.step`` + ``update``; default:
    ``optimizer.step()``). Returns ``True`` if the step was applied, ``False`` if it was skipped (inf/NaN
    gradients); a skipped step also skips the scheduler and sets ``optimizer.step_was_skipped``. Only ``False``
    means skipped: ``None`` counts as applied. So a wrapper (``@hookimpl(wrapper=True)``) must return the result
    its ``yield`` gave (or its own ``True``/``False``); a wrapper returning ``None`` turns a skipped step into an
    applied one (the scheduler steps, ``step_was_skipped`` is ``False``).
    """


@hookspec(firstresult=True)
def accel_zero_grad(kernel: KernelView, optimizer: torch.optim.Optimizer, set_to_none: bool) -> bool | None:
    """Reset gradients.

    When: ``optimizer.zero_grad()`` of a prepared optimizer, only on steps where gradients are synchronised.
    Who: first answer wins; default: ``optimizer.zero_grad(set_to_none)``. Returns ``True``.
    """


@hookspec(firstresult=True)
def accel_no_sync(kernel: KernelView, model: torch.nn.Module) -> AbstractContextManager[Any] | None:
    """The context that skips gradient synchronisation for one micro-batch (gradient accumulation).

    When: ``kernel.no_sync(model)`` and ``kernel.accumulate(model)`` on non-sync steps. Who: first answer wins;
    DDP answers ``model.no_sync()``; default: no context.
    """


@hookspec(firstresult=True)
def accel_sync_in_backward(kernel: KernelView, model: torch.nn.Module) -> AbstractContextManager[Any] | None:
    """The context in which the next backward synchronises gradients although the forward ran under
    ``accel_no_sync`` (Accelerate's ``trigger_sync_in_backward``).

    When: ``kernel.trigger_sync_in_backward(model)``. Who: first answer wins; DDP answers a context that prepares
    its reducer for the backward; default: no context (a strategy that decides at backward time needs none).
    """


@hookspec(firstresult=True)
def accel_clip_grad_norm(
    kernel: KernelView, parameters: list[torch.nn.Parameter], max_norm: float, norm_type: float
) -> torch.Tensor | None:
    """Clip gradients by their global norm and return the norm (before clipping).

    When: ``kernel.clip_grad_norm_`` on sync steps, after ``accel_unscale_gradients``. Who: first answer wins
    (FSDP: sharded gradients; DeepSpeed: the engine); default: ``torch.nn.utils.clip_grad_norm_``.
    """


@hookspec
def accel_unscale_gradients(kernel: KernelView) -> None:
    """Bring gradients to their true scale before they are inspected or clipped (a grad scaler's ``unscale_``).

    When: ``kernel.unscale_gradients()``, and before ``clip_grad_norm_``/``clip_grad_value_`` on sync steps.
    Who: everyone (precision plugins with a scaler). Returns nothing.
    """


# --------------------------------------------------------------------------------------------------------------
# State: checkpoints and exported weights


@hookspec
def accel_state_items(kernel: KernelView) -> Mapping[str, Any] | None:
    """Extra stateful objects (with ``state_dict``/``load_state_dict``) to include in checkpoints, by key, e.g.
    ``{"grad_scaler": scaler}``.

    When: ``save_state`` and ``load_state``, on every process. Who: everyone; a key given by two plugins, or one of
    the kernel's keys, is an error naming both. The kernel's own default implementation, called last, gives the
    kernel's keys (``model``..., ``optimizer``..., ``scheduler``..., ``dataloader``..., ``custom_<i>``, ``gradients``,
    ``rng``, ``kernel``). Unless a plugin claims it in ``accel_save_state``, the kernel writes the item from the main
    process (its state must be the same on every process) and the manifest records the plugin that gave it, so
    loading without that plugin says which plugin to install. The three state hooks are called once per
    implementing component, through pluggy (``subset_hook_caller``), so that each answer is known to be that
    component's: a wrapper implementation wraps each component's call and sees its answer.
    """


@hookspec
def accel_save_state(
    kernel: KernelView, items: Mapping[str, Any], directory: Path, asynchronous: bool
) -> Mapping[str, ItemRecord] | None:
    """Write the checkpoint items this plugin owns (FSDP: sharded model/optimizer with
    torch.distributed.checkpoint; DeepSpeed: the engine's checkpoint) into ``directory``.

    ``items`` maps every key of the run to its object: ``model``, ``model_1``, ... (the prepared models, as
    ``prepare`` returned them), ``optimizer``... (``PreparedOptimizer``; ``.optimizer`` is what the strategy
    returned), ``scheduler``..., ``dataloader``..., ``custom_<i>`` (``register_for_checkpointing``), the keys of
    ``accel_state_items``, and the kernel's own ``gradients`` (per process: gradients pending in the middle of
    accumulation), ``rng`` (per process) and ``kernel``.

    When: ``save_state``, on every process, before the kernel writes anything, inside the not-yet-published
    temporary directory (it is fsynced, given a manifest and renamed into place afterwards). Who: everyone; each
    returns ``{key: ItemRecord(plugin=..., format=..., files=...)}`` for the keys it wrote. ``files`` are paths
    relative to ``directory`` (a directory name covers everything below it); the records of all processes are
    merged (union of files), so each process lists what it wrote. ``plugin`` and ``version`` are filled in by the
    kernel. The kernel's own default implementation, called last (after the plugins' claims are agreed between
    processes), writes every key nobody claimed (safetensors + JSON, see ``accel.checkpoint``); the kernel records
    all of it in the manifest. A key claimed twice is an error naming both plugins. Formats must not need
    unpickling arbitrary objects: use ``accel.spi.write_tree``/``read_tree``, safetensors, JSON, or torch
    files that ``accel.spi.load_weights_only`` accepts.

    A run in which no component but the kernel implements this hook has replicated state: ``save_state`` may then
    be called by the main process alone (Accelerate's ``if is_main_process: save_state(...)``), and the kernel
    writes everything from it, without collectives and without calling this hook on the plugins. Implementing it
    makes such a call a one-line error: implement it when the plugin's state is not the same on every process or
    its state dicts are gathered collectively (``accel_model_state_dict``).

    ``asynchronous`` is true for ``save_state(asynchronous=True)`` (or the ``async_save`` option). The hook still
    runs on the training thread and its files must be complete when it returns (the kernel fsyncs and publishes
    them with the rest, in the background), so a plugin that writes here simply makes the loop wait for its own
    write. A plugin whose writing cannot be done that way (collectives of its own, an engine that writes by
    itself) raises ``UsageError`` in one line when ``asynchronous`` is true: nothing is published and every
    process raises. No background thread ever calls a hook.
    """


@hookspec
def accel_load_state(
    kernel: KernelView, items: Mapping[str, Any], directory: Path, records: Mapping[str, ItemRecord]
) -> Iterable[str] | None:
    """Restore the items whose manifest record names this plugin (``records`` holds only those).

    When: ``load_state``, on every process, after the kernel checked the checkpoint against the run (every file
    listed with its size and nothing else present; no plugin missing; no item missing or extra; per-process items
    saved by as many processes; the kernel-written models' parameter names and shapes) and before it restores its
    own items (random states last: the kernel's default implementation, called last, restores the records naming
    ``"accel"``). Who: every component named by a record; it returns the keys it restored, and a key it leaves
    out is an error. A record naming a plugin that is not active is an error, raised before
    anything is loaded, naming the plugin (and ``pip install ...`` when it is a published one).
    """


@hookspec(firstresult=True)
def accel_model_state_dict(kernel: KernelView, model: torch.nn.Module) -> dict[str, Any] | None:
    """The full, unsharded state dict of a prepared model (gathering FSDP shards or ZeRO-3 partitions), on the
    main process; other processes may return an empty dict.

    When: ``kernel.get_state_dict(model)``, ``save_model``, and ``save_state`` for a model no plugin claimed; on
    every process (gathering may be a collective). Who: first answer wins; default:
    ``kernel.unwrap_model(model).state_dict()``.
    """


# --------------------------------------------------------------------------------------------------------------
# Tracking


@hookspec
def accel_init_trackers(
    kernel: KernelView, project_name: str, config: Mapping[str, Any], init_kwargs: Mapping[str, Any]
) -> None:
    """Start a run in each active tracker and record the hyper-parameters (``config``, possibly nested).

    When: ``kernel.init_trackers(project_name, config, init_kwargs)``. Who: every tracker component, each isolated:
    a tracker that raises is warned about once and skipped for every tracking hook from then on, the others go on.
    ``init_kwargs`` is the whole mapping ``{tracker name: {keyword: value}}``; take your own entry. Keep the
    backend's run object in the component's ``run`` attribute (``kernel.get_tracker(name, unwrap=True)``).
    Tracker components are called on the main process only, unless the component sets ``main_process_only =
    False``; this holds for every tracking hook. Returns nothing.
    """


@hookspec
def accel_log(kernel: KernelView, values: Mapping[str, Any], step: int | None, log_kwargs: Mapping[str, Any]) -> None:
    """Log values (numbers, and whatever else the backend understands: text, nested dicts of numbers).

    When: ``kernel.log(values, step, log_kwargs)``, only after ``init_trackers``. Who: every tracker, each
    isolated as in ``accel_init_trackers``. ``log_kwargs`` is ``{tracker name: {keyword: value}}``; take your own
    entry. Returns nothing.
    """


@hookspec
def accel_log_images(
    kernel: KernelView, values: Mapping[str, Any], step: int | None, log_kwargs: Mapping[str, Any]
) -> None:
    """Log images. ``values`` maps a name to one image or a list of images; an image is an array or tensor of shape
    H x W, H x W x 3 or H x W x 4 (channels last; uint8 in 0..255 or float in 0..1) or a PIL image.

    When: ``kernel.log_images(values, step, log_kwargs)``, only after ``init_trackers``. Who: every tracker that can
    show images, each isolated as in ``accel_init_trackers``; trackers that cannot simply do not implement it (the
    kernel warns once if no active tracker does). Returns nothing.
    """


@hookspec
def accel_log_table(
    kernel: KernelView,
    table_name: str,
    columns: list[str],
    data: list[list[Any]],
    step: int | None,
    log_kwargs: Mapping[str, Any],
) -> None:
    """Log a table: ``columns`` (names) and ``data`` (rows, each as long as ``columns``; the kernel checked).

    When: ``kernel.log_table(table_name, columns, data | dataframe, step, log_kwargs)``, only after
    ``init_trackers``. Who: every tracker that can show tables, each isolated as in ``accel_init_trackers``;
    trackers that cannot do not implement it. Returns nothing.
    """


@hookspec
def accel_end_training(kernel: KernelView) -> None:
    """The normal end of training: trackers finish their runs (flush, close files, mark the run finished); a
    strategy may wait for every process here (a barrier before its process group is destroyed), which
    ``accel_teardown`` must not do because it also runs after a failure.

    When: ``kernel.end_training()`` (trackers also at interpreter exit for a script that never called it); once.
    Trackers are called only if ``init_trackers`` was called. Who: every component, each isolated as in
    ``accel_init_trackers``. Returns nothing.
    """


# --------------------------------------------------------------------------------------------------------------
# Deprecated: still called, and pluggy warns (``warn_on_impl``, a DeprecationWarning naming the replacement) when a
# plugin implementing one is registered. Each fails from the release its entry in accel.deprecations names; delete
# its hookspec then (the entry stays, for the error and the did-you-mean).


@hookspec(firstresult=True, warn_on_impl=hook_warning("accel_wrap_model"))
def accel_wrap_model(kernel: KernelView, model: torch.nn.Module) -> torch.nn.Module | None:
    """Deprecated since 0.1.1, fails from 0.2.0: answer ``accel_prepare_training`` instead. Place a model on the
    device and wrap it for the strategy.

    When: by the kernel's default ``accel_prepare_training`` (that is, when no strategy answers it), once per model,
    before ``accel_wrap_optimizer``. Who: first answer wins; default: ``model.to(kernel.device)``. Returns the
    module the user will call.
    """


@hookspec(firstresult=True, warn_on_impl=hook_warning("accel_wrap_optimizer"))
def accel_wrap_optimizer(kernel: KernelView, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """Deprecated since 0.1.1, fails from 0.2.0: adapt optimizers in ``accel_prepare_training`` instead. Adapt an
    optimizer to the wrapped models.

    When: by the kernel's default ``accel_prepare_training``, once per optimizer, after every model of the call went
    through ``accel_wrap_model``. Who: first answer wins; default: the optimizer unchanged. Returns the optimizer.
    """
