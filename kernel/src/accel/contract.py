"""Records passed through the hooks. Plain dataclasses and protocols; importing this module does not import torch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import pluggy
    import torch

    from accel.options import Settings

#: Roles of which at most one component may be active. Other roles (``"tracker"``, ``"observer"``, ...) may repeat.
EXCLUSIVE_ROLES = ("strategy", "compiler", "precision")


class Component:
    """Base class for the runtime objects a plugin returns from ``accel_activate``.

    Subclass it, set the class attributes, and decorate methods with ``@accel.hookimpl`` to answer runtime hooks.

    - ``role``: ``"strategy"`` (places/wraps the model, owns the processes and the device), ``"compiler"``,
      ``"precision"`` (at most one active of each), or any other word (``"tracker"``) for roles that may repeat.
      Hooks are asked in role order: strategy, compiler, precision, the rest, then the kernel's defaults.
    - ``provides``: capabilities it realises, checked against what the settings ask for: ``"distributed"`` (more
      than one process), ``"precision:<mode>"`` (``mixed_precision=<mode>``: ``bf16``, ``fp16``, ``fp8`` or a mode
      of its own), ``"compile:<backend>"`` (``dynamo_backend=<backend>``) or ``"compile"`` (every backend
      ``torch.compile`` has), ``"sharding"``, ``"tracker:<name>"``. Read at discovery from the classes listed in
      ``accel_components``: ``mixed_precision``/``dynamo_backend`` accept the modes installed plugins declare there.
      A mode declared by name is its declarer's: for ``dynamo_backend=x``, plugins declaring only ``"compile"`` are
      not asked ``accel_activate`` while an installed plugin declares ``"compile:x"`` (unless selected).
    - ``name`` is filled in by the kernel with the plugin's name.
    - ``requested``: set it (on the instance) when the settings ask for this component by themselves, as
      ``--plugin NAME`` would: a ``Kernel(...)`` argument only this plugin reads (``parallelism_config``). Where
      several plugins want an exclusive role, one that is requested wins over those that only default into it
      (the ``ddp`` strategy of any run of several processes); two requested or selected ones are an error.
    """

    role: str = "observer"
    provides: frozenset[str] = frozenset()
    name: str = ""
    requested: bool = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name or '?'} role={self.role}>"


@dataclass(frozen=True)
class HardwareInfo:
    """What ``accel_detect_hardware`` reports. The kernel uses the answer with the highest ``priority``."""

    name: str  # "cpu", "cuda", "xla", ...
    device_count: int = 1  # devices of that kind here (the process count `accel launch --multi_gpu` starts)
    priority: int = 0  # the highest answer wins; the kernel's CPU answer has 0
    details: Mapping[str, str] = field(default_factory=dict)  # facts `accel env` shows ({"cores": "8"})


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the run.

    ``data_parallel_index``/``data_parallel_size``: which data shard this process reads, of how many, when that
    differs from its process index/count (processes of one tensor- or context-parallel group read the same batches);
    ``None`` means the same as the process index/count."""

    process_index: int = 0  # rank over all machines
    num_processes: int = 1  # processes over all machines
    local_process_index: int = 0  # rank on this machine
    local_num_processes: int = 1  # processes on this machine
    data_parallel_index: int | None = None  # the data shard this process reads (None: process_index)
    data_parallel_size: int | None = None  # how many data shards (None: num_processes)

    @property
    def is_main_process(self) -> bool:
        """Whether this is process 0 of the run."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """Whether this is process 0 of this machine."""
        return self.local_process_index == 0


@dataclass
class LaunchPlan:
    """What ``accel launch`` hands to ``accel_launch``. ``env`` is the full environment for the workers (a launcher
    may add to it); ``command`` is the worker command after the interpreter (``[script, *args]`` or
    ``["-m", module, *args]``)."""

    settings: Settings  # the resolved settings (phase "launch"), launch settings included
    command: list[str]
    env: dict[str, str]
    python: str  # the workers' interpreter; "" for --no_python (command[0] is an executable)
    dry_run: bool = False  # print the exact command, start nothing, return 0
    verbose: bool = False  # a dry run lists every setting (not only those off their defaults) and the hook table


#: Launch settings with the values that ask a launcher for nothing. An ``accel_launch`` answer carries out or refuses
#: each one a run sets to anything else: never ignores it (docs/plugin-api.md).
LAUNCH_UNSET: Mapping[str, tuple[Any, ...]] = {
    "num_machines": (1,),
    "machine_rank": (0,),
    "main_process_ip": (None, ""),
    "rdzv_backend": ("static",),
    "rdzv_conf": (None, ""),
    "gpu_ids": (None, "", "all"),
    "max_restarts": (0,),
    "num_cpu_threads_per_process": (None,),
    "enable_cpu_affinity": (False,),
    "tee": (None, "", "0"),
    "log_dir": (None, ""),
    "role": ("default",),
}


def unhonoured_launch_settings(settings: Settings, names: Sequence[str]) -> list[str]:
    """``"name=value"`` for each of ``names`` (settings of :data:`LAUNCH_UNSET` a launcher does not carry out) that
    the run sets to something, in the order of ``names``: what that launcher must refuse, in one line."""
    return [f"{n}={settings.get(n)!r}" for n in names if settings.get(n, LAUNCH_UNSET[n][0]) not in LAUNCH_UNSET[n]]


#: ``ItemRecord.format`` of items written with torch.distributed.checkpoint (a sharding strategy's models and
#: optimizers, :mod:`accel.spi.sharded`): any run can read them, whatever its process count.
DCP_FORMAT = "torch.distributed.checkpoint"


@dataclass(frozen=True)
class ItemRecord:
    """How one checkpoint item was written: recorded in the checkpoint's manifest and used to load it back."""

    plugin: str  # the plugin that wrote it and must load it (set by the kernel)
    format: str  # the writer's name for its format ("torch-dcp", "safetensors")
    files: Sequence[str] = ()  # paths relative to the checkpoint directory; a directory covers all below it
    version: str = ""  # the plugin's version (set by the kernel)
    extra: Mapping[str, Any] = field(default_factory=dict)  # JSON facts the loader needs ({"zero_stage": 3})


#: Kinds of :class:`Question`: a menu (arrow keys), yes/no, free text, a whole number, a number, a file path.
QUESTION_KINDS = ("select", "confirm", "text", "int", "float", "path")


@dataclass(frozen=True)
class Question:
    """One question of ``accel config``, returned by ``accel_config_questions``.

    - ``key``: the name of an option (declared in ``accel_add_options`` by this plugin, another plugin or the
      kernel). The answer is checked and converted by that option (so a bad answer is asked again) and written to
      the config file at the option's ``config_key`` (``my_config.stage``). With ``store=False`` the key
      is only a name in ``answers`` that steers later questions (``"my_use_json"``) and is not written.
    - ``prompt``: the sentence shown. ``kind``: one of ``QUESTION_KINDS``. ``choices``: the values of a ``select``
      (shown as they are, or through ``titles``, same length). ``default``: pre-selected value (``None``: the
      option's default). ``help``: one extra line shown under the prompt.
    """

    key: str
    prompt: str
    kind: str = "text"
    choices: tuple[str, ...] = ()
    default: Any = None
    titles: tuple[str, ...] = ()
    help: str = ""
    store: bool = True


class Collectives(Protocol):
    """Communication between the processes of the run. ``accel_collectives`` returns one; the Kernel builds
    ``gather``, ``reduce``, ``broadcast`` ... on top of it. Every method is called by every process."""

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Tensors of equal shape from every process, in process order."""

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Reduce in place over processes; ``op`` is ``"sum"`` or ``"max"``. Returns ``tensor``."""

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Copy ``tensor`` of process ``src`` into every process's ``tensor``, in place. Returns it."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Picklable objects from every process, in process order (for small metadata only)."""

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """``obj`` of process ``src``, returned on every process."""

    def barrier(self) -> None:
        """Wait until every process got here."""


class KernelView(Protocol):
    """What a runtime hook may read or call on the kernel it is handed: the whole plugin-facing surface of
    :class:`accel.Kernel`. Hooks are typed against this Protocol, not against ``Kernel`` (whose other public members
    are the training script's API: a plugin does not call them from a hook, because hooks run inside them).

    ``topology``, ``device`` and ``collectives`` exist once ``accel_setup``, ``accel_topology``, ``accel_device`` and
    ``accel_collectives`` were answered: do not read them in ``accel_setup``."""

    settings: Settings  # the same Settings the component got in accel_activate
    topology: Topology  # where this process sits in the run (the answer to accel_topology)
    device: torch.device  # this process's device (the answer to accel_device)
    collectives: Collectives  # communication between the processes (the answer to accel_collectives)

    @property
    def components(self) -> list[Component]:
        """The active plugin components, in the order hooks ask them."""

    @property
    def hook(self) -> pluggy.HookRelay:
        """pluggy's hook relay: how a component calls the hooks its plugin added (``accel_hookspecs``),
        ``kernel.hook.accel_<plugin>_<what>(kernel=kernel, ...)``."""

    @property
    def mixed_precision(self) -> str:
        """The ``mixed_precision`` setting (``"no"`` or a mode a plugin provides)."""

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""

    @property
    def project_dir(self) -> str | None:
        """Where checkpoints and logs go (``None``: not set)."""

    @property
    def logging_dir(self) -> str | None:
        """Where trackers write their logs: ``ProjectConfiguration(logging_dir=...)``, else ``project_dir``
        (``None``: neither is set)."""

    @property
    def num_processes(self) -> int:
        """Processes of the run, over all machines."""

    @property
    def process_index(self) -> int:
        """This process's rank, 0 .. ``num_processes - 1``."""

    @property
    def is_main_process(self) -> bool:
        """Whether this is process 0 of the run."""

    @property
    def sync_gradients(self) -> bool:
        """Whether the current step synchronises gradients and steps the optimizer."""

    def unwrap_model(self, model: torch.nn.Module, keep_torch_compile: bool = True) -> torch.nn.Module:
        """The module the script passed to ``prepare`` for this prepared model."""

    def scale_for_accumulation(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss / gradient_accumulation_steps`` (for plugins answering ``accel_backward``)."""
