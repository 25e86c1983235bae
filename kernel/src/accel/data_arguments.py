"""``Kernel``'s dataloader and accumulation arguments, with Accelerate's names and meaning: the dataclasses
(:class:`DataLoaderConfiguration`, :class:`GradientAccumulationPlugin`), their checks, the settings a Kernel resolves
from them, and the Kernel's part that reads them back (:class:`DataArguments`).

What accel does not have of Accelerate's ``Accelerator`` is not listed here: a plugin answers
``accel_explain_name`` with the line saying what to use (accel-accelerate's ``accelerate-names``).

This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Protocol, cast

from accel.errors import UsageError

if TYPE_CHECKING:
    from accel.options import Settings
    from accel.project import ProjectConfiguration

#: ``scheduler_steps``: how often a prepared scheduler steps (see :class:`accel.kernel.PreparedScheduler`).
SCHEDULER_RULES = ("accelerate", "per_optimizer_step")


@dataclass
class DataLoaderConfiguration:
    """Accelerate's ``DataLoaderConfiguration``, for ``Kernel(dataloader_config=...)``.

    - ``split_batches``: each process takes its slice of every batch (the batch size is the global one and must
      divide by the number of processes); the scheduler then steps once per optimizer step.
    - ``dispatch_batches``: ``None``/``False`` only; every process reads its own shard (``True`` is refused).
    - ``even_batches``: complete the last batches with samples from the start (default), or give processes that ran
      out empty batches.
    - ``use_seedable_sampler``: accepted; prepared dataloaders always shuffle with a sampler seeded identically on
      every process.
    - ``data_seed``: that sampler's seed (default: drawn from torch's generator on process 0).
    - ``non_blocking``: batches are moved to the device with ``non_blocking=True``.
    - ``use_stateful_dataloader``: accepted; prepared dataloaders always have ``state_dict``/``load_state_dict``
      and ``save_state`` records their position.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        for name in (
            "split_batches",
            "even_batches",
            "use_seedable_sampler",
            "non_blocking",
            "use_stateful_dataloader",
        ):
            check_bool(f"DataLoaderConfiguration({name}=...)", getattr(self, name))
        if self.dispatch_batches is not None:
            check_bool("DataLoaderConfiguration(dispatch_batches=...)", self.dispatch_batches)
        if self.dispatch_batches:
            raise UsageError(
                "dispatch_batches=True is not supported: every process reads its own shard of the "
                "dataloader; leave dispatch_batches unset (an IterableDataset is sharded too)"
            )
        if self.data_seed is not None and (isinstance(self.data_seed, bool) or not isinstance(self.data_seed, int)):
            raise UsageError(
                f"DataLoaderConfiguration(data_seed=...) expects a whole number or None, got {self.data_seed!r}"
            )


@dataclass
class GradientAccumulationPlugin:
    """Accelerate's ``GradientAccumulationPlugin``, for ``Kernel(gradient_accumulation_plugin=...)``.

    ``num_steps`` is ``gradient_accumulation_steps``; ``adjust_scheduler`` (default True) counts the accumulation
    steps in the scheduler's ``_step_count`` as Accelerate does (it only changes when ``OneCycleLR`` stops).
    ``sync_with_dataloader=False`` and ``sync_each_batch=True`` are refused: the kernel always syncs on the last
    batch of an epoch and skips the all-reduce on accumulation steps."""

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        for name in ("adjust_scheduler", "sync_with_dataloader", "sync_each_batch"):
            check_bool(f"GradientAccumulationPlugin({name}=...)", getattr(self, name))
        if self.num_steps is not None and (
            isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int) or self.num_steps < 1
        ):
            raise UsageError(
                f"GradientAccumulationPlugin(num_steps=...) expects a whole number >= 1, got {self.num_steps!r}"
            )
        if not self.sync_with_dataloader:
            raise UsageError(
                "GradientAccumulationPlugin(sync_with_dataloader=False) is not supported: gradients "
                "always sync on the last batch of an epoch"
            )
        if self.sync_each_batch:
            raise UsageError(
                "GradientAccumulationPlugin(sync_each_batch=True) is not supported: use "
                "gradient_accumulation_steps=1 to synchronise every batch"
            )


def check_bool(label: str, value: Any) -> bool:
    """``value`` if it is a bool, else a UsageError naming ``label`` (``"no"`` or ``1`` are not booleans here)."""
    if not isinstance(value, bool):
        raise UsageError(f"{label} expects True or False, got {value!r}")
    return value


def check_device_placement(label: str, value: Any) -> None:
    """A UsageError unless ``value`` is True (``device_placement=False`` is not supported)."""
    check_bool(label, value)
    if not value:
        raise UsageError(
            f"{label.replace('...', 'False')} is not supported: models are placed by the strategy plugin; "
            "pass prepare(dataloader, device_placement=False) for dataloaders whose batches you move"
        )


def check_rng_types(label: str, rng_types: Any) -> None:
    """A UsageError unless ``rng_types`` names only ``"generator"`` (names or Accelerate's ``RNGType``)."""
    kinds = [str(getattr(kind, "value", kind)) for kind in ([rng_types] if isinstance(rng_types, str) else rng_types)]
    other = [kind for kind in kinds if kind != "generator"]
    if other:
        raise UsageError(
            f"{label.replace('...', repr(kinds))} is not supported: accel does not synchronise the "
            f"{', '.join(other)} random generator(s) at each epoch; prepared dataloaders share the "
            "sampler's seed on their own (rng_types=['generator']). Seed every process with "
            "accel.utils.set_seed(seed)"
        )


@dataclass(frozen=True)
class DataSettings:
    """The dataloader settings a Kernel resolved from its arguments."""

    split_batches: bool = False
    even_batches: bool = True
    data_seed: int | None = None
    non_blocking: bool = False
    adjust_scheduler: bool = True


def resolve_data_settings(
    *,
    split_batches: bool | None,
    even_batches: bool | None,
    dataloader_config: DataLoaderConfiguration | None,
    rng_types: Sequence[Any] | None,
    device_placement: bool,
    dispatch_batches: bool | None,
    use_seedable_sampler: bool | None,
    gradient_accumulation_plugin: GradientAccumulationPlugin | None,
    gradient_accumulation_steps: int | None,
) -> tuple[DataSettings, int | None]:
    """Check Accelerate's dataloader and accumulation arguments of ``Kernel(...)`` and merge them. Returns the
    settings and the ``gradient_accumulation_steps`` to use (None: from the options). Raises one UsageError line."""
    check_device_placement("Kernel(device_placement=...)", device_placement)
    if dataloader_config is None:
        config = DataLoaderConfiguration()
    elif isinstance(dataloader_config, DataLoaderConfiguration):
        config = dataloader_config
    else:
        raise UsageError(
            f"Kernel(dataloader_config=...) expects an accel.DataLoaderConfiguration, got "
            f"{type(dataloader_config).__name__}"
        )
    given = {
        "split_batches": split_batches,
        "even_batches": even_batches,
        "dispatch_batches": dispatch_batches,
        "use_seedable_sampler": use_seedable_sampler,
    }
    values = {f.name: getattr(config, f.name) for f in fields(config)}
    for name, value in given.items():
        if value is None:
            continue
        check_bool(f"Kernel({name}=...)", value)
        if dataloader_config is not None and value != values[name]:
            raise UsageError(
                f"Kernel({name}={value!r}) disagrees with dataloader_config.{name}={values[name]!r}; "
                "give it in one place"
            )
        values[name] = value
    config = DataLoaderConfiguration(**values)  # validates the direct arguments like the dataclass's own
    if rng_types is not None:
        check_rng_types("Kernel(rng_types=...)", rng_types)
    steps = gradient_accumulation_steps
    adjust = True
    if gradient_accumulation_plugin is not None:
        if not isinstance(gradient_accumulation_plugin, GradientAccumulationPlugin):
            raise UsageError(
                f"Kernel(gradient_accumulation_plugin=...) expects an accel.GradientAccumulationPlugin, "
                f"got {type(gradient_accumulation_plugin).__name__}"
            )
        if steps is not None:
            raise UsageError("pass gradient_accumulation_steps or gradient_accumulation_plugin, not both")
        steps = gradient_accumulation_plugin.num_steps
        adjust = gradient_accumulation_plugin.adjust_scheduler
    settings = DataSettings(
        split_batches=config.split_batches,
        even_batches=config.even_batches,
        data_seed=config.data_seed,
        non_blocking=config.non_blocking,
        adjust_scheduler=adjust,
    )
    return settings, steps


class ArgumentsKernel(Protocol):
    """What :class:`DataArguments` reads and sets of its Kernel."""

    _data: DataSettings
    even_batches: bool
    project_configuration: ProjectConfiguration
    settings: Settings


class DataArguments:
    """A Kernel's part that reads back what ``Kernel(...)`` resolved of these arguments, under Accelerate's names
    (its ``_arguments``; the Kernel offers each public member under the same name)."""

    dispatch_batches = False  # every process reads its own shard
    use_seedable_sampler = True  # shuffling always uses a sampler seeded identically on every process
    use_stateful_dataloader = True  # prepared dataloaders always have state_dict/load_state_dict

    def __init__(self, kernel: ArgumentsKernel) -> None:
        self.kernel = kernel

    @property
    def split_batches(self) -> bool:
        return self.kernel._data.split_batches

    @property
    def non_blocking(self) -> bool:
        return self.kernel._data.non_blocking

    @property
    def dataloader_config(self) -> DataLoaderConfiguration:
        data = self.kernel._data
        return DataLoaderConfiguration(
            split_batches=data.split_batches,
            even_batches=self.kernel.even_batches,
            use_seedable_sampler=True,
            data_seed=data.data_seed,
            non_blocking=data.non_blocking,
            use_stateful_dataloader=True,
        )

    @dataloader_config.setter
    def dataloader_config(self, value: DataLoaderConfiguration) -> None:
        """As in Accelerate: dataloaders prepared from now on follow the new configuration."""
        if not isinstance(value, DataLoaderConfiguration):
            raise UsageError(
                f"kernel.dataloader_config expects an accel.DataLoaderConfiguration, got {type(value).__name__}"
            )
        value.__post_init__()  # fields may have been changed since it was made
        self.kernel._data = replace(
            self.kernel._data,
            split_batches=value.split_batches,
            even_batches=value.even_batches,
            data_seed=value.data_seed,
            non_blocking=value.non_blocking,
        )
        self.kernel.even_batches = value.even_batches

    @property
    def device_placement(self) -> bool:
        """Always True: models and batches are placed on the run's device (``False`` is refused)."""
        return True

    @device_placement.setter
    def device_placement(self, value: bool) -> None:
        check_device_placement("kernel.device_placement = ...", value)

    @property
    def rng_types(self) -> tuple[str, ...]:
        """``("generator",)``: prepared dataloaders share the sampler's seed (other types are refused)."""
        return ("generator",)

    @rng_types.setter
    def rng_types(self, value: Sequence[Any]) -> None:
        check_rng_types("kernel.rng_types = ...", value)

    @property
    def logging_dir(self) -> str | None:
        return self.kernel.project_configuration.logging_dir

    @property
    def project_dir(self) -> str | None:
        """The ``project_dir`` setting: where checkpoints and logs go (``None``: not set)."""
        return self.kernel.settings["project_dir"]


def explain_member(kernel: Any, name: str) -> str | None:
    """``accel_explain_name(kind="member")`` for a public ``name`` of a Kernel, asked once per name and Kernel (None
    before the plugins are loaded): the line a plugin gives for another library's name."""
    if name.startswith("_"):
        return None
    state = kernel.__dict__
    plugins, explained = state.get("plugins"), state.get("_explained")
    if plugins is None:
        return None
    if explained is None:
        explained = state["_explained"] = {}
    if name not in explained:
        explained[name] = plugins.pm.hook.accel_explain_name(kind="member", name=name)
    return cast("str | None", explained[name])


def missing_member(kernel: Any, name: str) -> AttributeError:
    """The error for reading a member a Kernel does not have: a plugin's line for it (another library's name), the
    line of a Kernel unpickled in another process, else Python's."""
    message = explain_member(kernel, name)
    detached = kernel.__dict__.get("_detached")
    if detached is not None and not message:
        message = (
            f"kernel.{name}: this Kernel was unpickled in another process than the one that created it (pid "
            f"{detached}); it knows the run's facts (process_index, num_processes, device, is_main_process) but "
            "runs no collectives, hooks or checkpoints; use the Kernel of the training process"
        )
    return AttributeError(message or f"{type(kernel).__name__!r} object has no attribute {name!r}")


def assign_member(kernel: Any, name: str, value: Any) -> None:
    """``Kernel.__setattr__``: assigning a member Kernel does not have that a plugin explains (Accelerate's
    ``kernel.scaler = ...``) raises the same line as reading it, instead of adding an attribute nothing reads."""
    if name not in kernel.__dict__ and not hasattr(type(kernel), name) and explain_member(kernel, name):
        raise missing_member(kernel, name)
    object.__setattr__(kernel, name, value)
