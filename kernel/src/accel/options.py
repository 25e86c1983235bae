"""Options: the one schema behind launch flags, config-file keys, environment variables and Kernel arguments.

The kernel declares its own options in ``core_options``; every plugin adds its own through the
``accel_add_options`` hook. One ``Option`` record drives all four surfaces, so a value is validated the same
way wherever it comes from. This module does not import torch.

Why one module of this size: the schema, its validation and its four surfaces' readers are one schema, and the
kernel's own options (``core_options``) are declarations, data rather than code, kept beside the rules they follow.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accel.errors import PluginError, UsageError

TRUE_WORDS = {"1", "true", "yes", "on", "y"}
FALSE_WORDS = {"0", "false", "no", "off", "n", ""}
TYPES = ("str", "int", "float", "bool", "list", "mapping")
KERNEL = "accel"  # the name options and hook answers of the kernel itself are reported under


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Return ``"; did you mean `x`?"`` for the closest candidate, or an empty string."""
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean `{match[0]}`?" if match else ""


@dataclass(frozen=True)
class Option:
    """One setting. ``name`` is its identifier everywhere: ``--name`` on the command line, ``Kernel(name=...)``,
    ``settings[name]``. ``config_key`` is its path in the YAML file (default: ``(name,)``)."""

    name: str
    type: str = "str"
    default: Any = None
    help: str = ""
    choices: tuple[str, ...] | None = None
    refused: tuple[tuple[str, str], ...] = ()  # (value, why it is refused and what to use instead)
    config_key: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    cli: bool = True
    plugin: str = KERNEL
    handler: tuple[str, ...] = ()  # kwargs-handler fields that set it: "GradScalerKwargs.init_scale"
    #: Optional further check of the converted value: returns what is wrong (``"is not an IP address or host
    #: name"``) or None. Applied wherever the value comes from (flag, file, environment, argument, question).
    check: Callable[[Any], str | None] | None = field(default=None, compare=False)
    #: A mode setting (``mixed_precision``: ``"precision"``, ``dynamo_backend``: ``"compile"``): ``"no"`` or a mode of
    #: this kind that a plugin provides (:class:`Modes`).
    modes: Modes | None = field(default=None, compare=False)
    #: A mapping whose keys name other options with this prefix dropped (``parallelism_config``'s ``"tp_size"`` is
    #: option ``parallelism_config_tp_size``): each such key's value is checked by that option (:func:`resolve`).
    fields: str = ""

    @property
    def path(self) -> tuple[str, ...]:
        """Its keys in the config file: ``config_key``, or ``(name,)``."""
        return self.config_key or (self.name,)

    @property
    def dotted(self) -> str:
        """``path`` joined by dots (``"fsdp_config.fsdp_offload_params"``)."""
        return ".".join(self.path)

    def coerce(self, raw: Any, label: str) -> Any:
        """Convert ``raw`` (from YAML, a flag string, an env var or Python) to this option's type, or raise
        ``UsageError`` starting with ``label`` (where the bad value came from) and saying what is expected."""
        bad = label
        value: Any
        if self.type == "bool":
            if isinstance(raw, bool):
                value = raw
            elif isinstance(raw, str) and raw.strip().lower() in TRUE_WORDS | FALSE_WORDS:
                value = raw.strip().lower() in TRUE_WORDS
            else:
                raise UsageError(f"{bad} expects true or false, got {raw!r}")
        elif self.type == "int":
            if isinstance(raw, bool) or not isinstance(raw, (int, str)):
                raise UsageError(f"{bad} expects a whole number, got {raw!r}")
            try:
                value = int(raw)
            except ValueError:
                raise UsageError(f"{bad} expects a whole number, got {raw!r}") from None
        elif self.type == "float":
            if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
                raise UsageError(f"{bad} expects a number, got {raw!r}")
            try:
                value = float(raw)
            except ValueError:
                raise UsageError(f"{bad} expects a number, got {raw!r}") from None
        elif self.type == "list":
            if isinstance(raw, (str, list, tuple)):
                value = split_list([raw] if isinstance(raw, str) else raw)
            else:
                raise UsageError(f"{bad} expects a list, got {raw!r}")
        elif self.type == "mapping":
            if dataclasses.is_dataclass(raw) and not isinstance(raw, type):  # Accelerate's config objects
                raw = {f.name: getattr(raw, f.name) for f in dataclasses.fields(raw)}
            if isinstance(raw, str):
                try:
                    raw = json.loads(raw)
                except ValueError:
                    raise UsageError(f"{bad} expects a mapping (JSON object), got {raw!r}") from None
            if not isinstance(raw, Mapping):
                raise UsageError(f"{bad} expects a mapping, got {raw!r}")
            value = dict(raw)
        else:
            if raw is False and (self.modes or (self.choices and "no" in {c.lower() for c in self.choices})):
                raw = "no"  # YAML 1.1 reads an unquoted `no` (or `NO`) as False
            if raw is None or isinstance(raw, (dict, list)):
                raise UsageError(f"{bad} expects a string, got {raw!r}")
            value = str(raw)
        if self.modes is not None:
            value = self.modes.coerce(value, raw, bad)
        if self.choices is not None:
            folded = {c.lower(): c for c in self.choices}
            key = str(value).lower()
            if key not in folded:
                raise UsageError(
                    f"{bad} must be one of {', '.join(self.choices)}, got {raw!r}{did_you_mean(key, folded)}"
                )
            value = folded[key]
        for refused, why in self.refused:
            if str(value).lower() == refused.lower():
                raise UsageError(f"{bad} {value}: {why}")
        if self.minimum is not None and value < self.minimum:
            raise UsageError(f"{bad} must be at least {self.minimum:g}, got {raw!r}")
        if self.maximum is not None and value > self.maximum:
            raise UsageError(f"{bad} must be at most {self.maximum:g}, got {raw!r}")
        if self.check is not None and (problem := self.check(value)):
            raise UsageError(f"{bad} {problem}, got {raw!r}")
        return value


def split_list(items: Iterable[Any]) -> list[Any]:
    """The entries of a list option: each string entry split at its commas (``--flag a,b`` and a repeated
    ``--flag a --flag b`` are both ``[a, b]``), stripped, empty ones dropped; other entries kept as they are."""
    out: list[Any] = []
    for item in items:
        out.extend((p.strip() for p in item.split(",") if p.strip()) if isinstance(item, str) else [item])
    return out


#: How a mode appears among the modes of a capability declared without one (``"compile"``: every backend).
ANY = "any"


def modes_of(provides: Iterable[str], kind: str) -> list[str]:
    """The modes of capability ``kind`` among ``provides``, sorted: ``["bf16", "fp16"]`` for
    ``{"precision:fp16", "precision:bf16"}``; :data:`ANY` for ``kind`` itself (``"compile"``: every mode)."""
    return sorted(ANY if cap == kind else cap.partition(":")[2] for cap in provides if cap.partition(":")[0] == kind)


@dataclass(frozen=True)
class Modes:
    """The values of a mode setting: ``"no"`` or a mode of capability ``kind`` (``precision:<mode>``) that some plugin
    provides. Plugins declare modes in their component classes' ``provides`` (read at discovery);
    ``"compile"`` without a mode means every backend ``torch.compile`` has.

    ``declared``: what the component classes of each installed plugin provide (name -> capabilities; nothing for
    one that is disabled or failed), or ``None``
    where plugins were not loaded (any value passes; the Kernel that runs checks it). A value is accepted when an
    installed plugin declares it, a published plugin (``known_plugins.json``) provides it (the run then says which
    package to install), or an installed plugin provides every mode of ``kind``."""

    kind: str
    declared: Mapping[str, frozenset[str]] | None = None

    def installed(self) -> dict[str, list[str]]:
        """Installed plugin -> its modes of this kind, sorted (plugins with none left out)."""
        return {name: modes for name, caps in (self.declared or {}).items() if (modes := modes_of(caps, self.kind))}

    def published(self) -> dict[str, list[str]]:
        """Distribution of each published plugin that is not installed -> its modes (what installing it adds)."""
        known = known_plugins()
        return {
            info["distribution"]: modes
            for name, info in known["plugins"].items()
            if name not in (self.declared or {}) and (modes := modes_of(info["provides"], self.kind))
        }

    def known(self) -> list[str]:
        """Every mode named, once each: those of ``known_plugins.json``'s ``modes`` (in menu order; for
        ``compile``, backends ``compile`` covers), those installed plugins declare, those published plugins
        provide."""
        known = known_plugins()
        named = list(known["modes"].get(self.kind, []))
        named += [m for modes in self.installed().values() for m in modes]
        named += [m for info in known["plugins"].values() for m in modes_of(info["provides"], self.kind)]
        return list(dict.fromkeys(m for m in named if m != ANY))

    def coerce(self, value: str, raw: Any, label: str) -> str:
        """``value`` if accepted, or a UsageError starting with ``label`` naming the installed providers and their
        modes and the packages that would add more. The spelling is folded to the declared one (``"BF16"`` ->
        ``"bf16"``), except where a plugin provides every mode of this kind (``compile``: accel-plugin-dynamo,
        which reads Accelerate's ``INDUCTOR`` itself): there only the modes installed plugins name are folded."""
        key = value.lower()
        installed = self.installed()
        spelling = {"no": "no", **{m.lower(): m for m in self.known()}}
        named = {m.lower() for modes in installed.values() for m in modes}
        every = any(ANY in modes for modes in installed.values())  # an installed plugin checks any value itself
        owned = every or any(self.kind in info["provides"] for info in known_plugins()["plugins"].values())
        if key in spelling and (not owned or key in named):
            return spelling[key]
        if key.strip() and (key in spelling or self.declared is None or every):
            return value
        providers = "; ".join(f"{name}: {', '.join(modes)}" for name, modes in installed.items())
        more = ", ".join(f"{dist} ({', '.join(modes)})" for dist, modes in self.published().items())
        raise UsageError(
            f"{label} must be no or a {self.kind} mode a plugin provides, got {raw!r} (installed providers: "
            f"{providers or 'none'}{'; more with pip install ' + more if more else ''}){did_you_mean(key, spelling)}"
        )


class Options:
    """The registry plugins fill in ``accel_add_options``. Names are unique across the kernel and all plugins."""

    def __init__(self, declared: Mapping[str, frozenset[str]] | None = None) -> None:
        self._by_name: dict[str, Option] = {}
        self.current_plugin = KERNEL
        #: what each installed plugin's component classes provide (``None``: plugins not loaded): :class:`Modes`
        self.declared = declared

    def add(
        self,
        name: str,
        *,
        type: str = "str",
        default: Any = None,
        help: str = "",
        choices: Iterable[str] | None = None,
        refused: Mapping[str, str] | None = None,
        config_key: str | tuple[str, ...] | None = None,
        flags: Iterable[str] = (),
        env: Iterable[str] = (),
        minimum: float | None = None,
        maximum: float | None = None,
        cli: bool = True,
        handler: str | Iterable[str] = (),
        check: Callable[[Any], str | None] | None = None,
        modes: str = "",
        fields: str = "",
    ) -> None:
        """Declare an option. ``config_key`` is a dotted path (``"fsdp_config.fsdp_offload_params"``) or a tuple;
        ``flags`` adds extra spellings (``"-n"``); ``env`` lists environment variables read, first found wins;
        ``handler`` names the kwargs-handler fields that set it (``"GradScalerKwargs.init_scale"``, see
        :mod:`accel.utils.handlers`); ``refused`` maps values that are
        recognised but not supported to the one line saying what to use instead; ``modes`` makes it a mode
        setting of that capability kind (``"precision"``: ``"no"`` or a mode some plugin provides, :class:`Modes`);
        ``fields`` (a mapping option) makes each key ``k`` of its value checked by option ``<fields>k``."""
        if type not in TYPES:
            raise PluginError(f"plugin {self.current_plugin!r} declares option {name!r} with unknown type {type!r}")
        if name in self._by_name:
            other = self._by_name[name].plugin
            raise PluginError(f"option `{name}` is declared by both {other!r} and {self.current_plugin!r}")
        path = tuple(config_key.split(".")) if isinstance(config_key, str) else tuple(config_key or ())
        self._by_name[name] = Option(
            name=name,
            type=type,
            default=default,
            help=help,
            choices=tuple(choices) if choices is not None else None,
            refused=tuple((refused or {}).items()),
            config_key=path,
            flags=tuple(flags),
            env=tuple(env),
            minimum=minimum,
            maximum=maximum,
            cli=cli,
            plugin=self.current_plugin,
            handler=(handler,) if isinstance(handler, str) else tuple(handler),
            check=check,
            modes=Modes(modes, self.declared) if modes else None,
            fields=fields,
        )

    def remove_plugin(self, plugin: str) -> None:
        """Forget every option ``plugin`` declared (a plugin that failed while declaring them is left out)."""
        self._by_name = {name: opt for name, opt in self._by_name.items() if opt.plugin != plugin}

    def __iter__(self):
        return iter(self._by_name.values())

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Option:
        return self._by_name[name]

    def by_path(self) -> dict[tuple[str, ...], Option]:
        return {opt.path: opt for opt in self._by_name.values()}

    def defaults(self) -> dict[str, Any]:
        return {opt.name: opt.default for opt in self._by_name.values()}

    def coerce_fields(self, opt: Option, value: Any, label: str) -> Any:
        """``value`` of mapping option ``opt`` with each key that names an option (see ``Option.fields``) converted
        and checked by that option, so a field is refused as its own flag would be; other keys are left as they
        are. A UsageError names the key (``Kernel(parallelism_config={'pp_microbatches': ...})``)."""
        if not opt.fields or not isinstance(value, Mapping):
            return value
        out = dict(value)
        for key, raw in value.items():
            name = key if str(key).startswith(opt.fields) else f"{opt.fields}{key}"
            where = f"{label[:-4]}{{{key!r}: ...}})" if label.endswith("=...)") else f"{label} field {key!r}"
            if raw is not None and name in self._by_name:
                out[key] = self._by_name[name].coerce(raw, where)
        return out


def core_options(options: Options) -> None:
    """The kernel's own options: Accelerate's launch flags and top-level config keys that are not a backend's."""
    add = options.add
    add(
        "num_processes",
        type="int",
        default=1,
        minimum=1,
        maximum=2**18,  # 262144: far above any real job; a typo of many digits is refused in one line
        flags=("-n",),
        help="Total number of processes to run, over all machines.",
    )
    add("num_machines", type="int", default=1, minimum=1, help="Number of machines (nodes) taking part.")
    add("machine_rank", type="int", default=0, minimum=0, help="Rank of this machine, 0 .. num_machines-1.")
    add("main_process_ip", check=check_host, help="Address of the machine of rank 0 (multi-machine runs).")
    add(
        "main_process_port",
        type="int",
        minimum=0,
        maximum=65535,
        help="Port of the main process; 0 or unset picks a free one on a single machine, 29500 on several.",
    )
    add(
        "rdzv_backend",
        default="static",
        choices=("static", "c10d", "etcd", "etcd-v2"),
        help="Rendezvous backend: static (fixed ranks) or c10d (ranks by arrival order).",
    )
    add("same_network", type="bool", default=True, help="All machines are on the same local network.")
    add("max_restarts", type="int", default=0, minimum=0, help="Restart the worker group this many times on failure.")
    add("monitor_interval", type="float", default=0.1, minimum=0, help="Seconds between checks of the workers' state.")
    add(
        "cpu",
        type="bool",
        default=False,
        config_key="use_cpu",
        env=("ACCEL_USE_CPU", "ACCELERATE_USE_CPU"),
        help="Train on the CPU even when an accelerator is present.",
    )
    add("multi_gpu", type="bool", default=False, help="Accelerate's flag for several GPUs; accepted as a hint.")
    add("gpu_ids", check=check_device_ids, help="Comma-separated device ids to use on this machine, or 'all'.")
    add(
        "mixed_precision",
        default="no",
        modes="precision",
        env=("ACCEL_MIXED_PRECISION", "MIXED_PRECISION", "ACCELERATE_MIXED_PRECISION"),
        help="Mixed precision: no, or a mode a plugin provides (fp16, bf16, fp8: accel-plugin-amp; "
        "`accel plugins --json` shows what each installed plugin provides).",
    )
    add(
        "dynamo_backend",
        default="no",
        modes="compile",
        config_key="dynamo_config.dynamo_backend",
        env=("ACCEL_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_BACKEND"),
        help="torch.compile backend, or 'no' (needs a plugin that provides it: accel-plugin-dynamo provides "
        "every backend of torch.compile).",
    )
    add(
        "gradient_accumulation_steps",
        type="int",
        default=1,
        minimum=1,
        env=("ACCEL_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
        help="Micro-batches per optimizer step (the Kernel's gradient_accumulation_steps unless the script "
        "gives its own; strategies with a config of their own fill its 'auto' from it).",
    )
    add(
        "plugins",
        type="list",
        default=[],
        flags=("--plugin",),
        help="Select a plugin explicitly by the name `accel plugins` lists (repeatable).",
    )
    add("log_with", type="list", default=[], cli=False, help="Trackers to log to (Kernel argument).")
    add(
        "scheduler_steps",
        default="accelerate",
        choices=("accelerate", "per_optimizer_step"),
        env=("ACCEL_SCHEDULER_STEPS",),
        help="How often a prepared LR scheduler steps: 'accelerate' (Accelerate's rule: num_processes times per "
        "optimizer step, once with split_batches) or 'per_optimizer_step' (once per optimizer step).",
    )
    add("project_dir", cli=False, help="Directory for checkpoints and logs (Kernel argument).")
    add(
        "async_save",
        type="bool",
        default=False,
        cli=False,
        env=("ACCEL_ASYNC_SAVE",),
        help="save_state() copies the state to CPU memory and writes it in the background (Kernel argument).",
    )
    add(
        "async_save_overlap",
        type="bool",
        default=False,
        cli=False,
        env=("ACCEL_ASYNC_SAVE_OVERLAP",),
        help="An asynchronous save_state() leaves the copy of parameters and optimizer state to the background thread, "
        "during the next forward and backward; the next optimizer.step() waits for it. Do not change them in place "
        "outside optimizer.step() before then (a change is caught and fails the save, except through .data) "
        "(Kernel argument).",
    )
    add(
        "script_skips_batches",
        type="bool",
        default=False,
        cli=False,
        env=("ACCEL_SCRIPT_SKIPS_BATCHES",),
        help="The script skips the batches of a resumed epoch itself, as Accelerate's scripts do (a `continue` per "
        "batch, or skip_first_batches): save_state records where each dataloader's epoch began, not its position, "
        "and load_state restarts that epoch in the same order (Kernel argument; accel-accelerate's default).",
    )
    add(
        "save_join_timeout",
        type="float",
        default=5.0,
        minimum=0,
        cli=False,
        env=("ACCEL_SAVE_JOIN_TIMEOUT",),
        help="Seconds save_state() on the main process waits for the other processes before it saves alone "
        "(Accelerate's `if is_main_process: save_state(...)`; replicated state only).",
    )
    add(
        "reseed_workers",
        type="bool",
        default=True,
        cli=False,
        env=("ACCEL_RESEED_WORKERS",),
        help="A prepared map-style DataLoader with worker processes seeds each batch's loading from its number in "
        "the pass, so random augmentation repeats exactly after a resume; False: torch seeds each worker once, a "
        "resumed run loads the same samples but augments them differently (Kernel argument).",
    )
    add(
        "seed_samplers",
        type="bool",
        default=True,
        cli=False,
        env=("ACCEL_SEED_SAMPLERS",),
        help="On one process, a prepared DataLoader's RandomSampler without a generator becomes a "
        "SeedableRandomSampler; False keeps it, each epoch's order drawn from torch's global generator as in "
        "Accelerate (Kernel argument; accel-accelerate's default). With several processes it is always replaced: "
        "every process must draw the same order.",
    )
    # Accelerate keys accepted for compatibility; they change nothing the kernel does.
    add(
        "compute_environment",
        default="LOCAL_MACHINE",
        choices=("LOCAL_MACHINE", "AMAZON_SAGEMAKER"),
        cli=False,
        help="Accelerate's compute environment; only LOCAL_MACHINE is supported.",
    )
    add(
        "distributed_type",
        default="NO",
        cli=False,
        choices=(
            "NO",
            "MULTI_CPU",
            "MULTI_GPU",
            "MULTI_XPU",
            "MULTI_NPU",
            "MULTI_MLU",
            "MULTI_SDAA",
            "MULTI_MUSA",
            "MULTI_HPU",
            "MULTI_NEURON",
            "DEEPSPEED",
            "FSDP",
            "XLA",
            "TPU",
            "MEGATRON_LM",
        ),
        refused=known_plugins()["refused"]["distributed_type"],
        help="Accelerate's distributed type (TPU: older Accelerate's name of XLA); selects the matching plugin.",
    )
    add("main_training_function", default="main", help="Function a spawning launcher calls (XLA).")
    add(
        "debug",
        type="bool",
        default=False,
        env=("ACCEL_DEBUG_MODE", "ACCELERATE_DEBUG_MODE"),
        help="Debug mode: before each collective, check that every process makes the same call (same operation, "
        "shapes and dtypes) and raise one error naming each process's call otherwise (slower).",
    )
    add(
        "enable_cpu_affinity",
        type="bool",
        default=False,
        help="Bind each process to the CPUs of its GPU's NUMA node (torchrun --numa-binding=node; needs numactl). "
        "Without a GPU there is nothing to bind: a notice says so.",
    )
    add(
        "num_cpu_threads_per_process",
        type="int",
        minimum=1,
        help="OMP_NUM_THREADS for each process (default: yours, else 1 with several processes per machine).",
    )
    # torchrun's own launch settings, passed through (Accelerate's flags of the same names).
    add(
        "tee",
        flags=("-t",),
        help="Also write these processes' streams to files under --log_dir: 0 none, 1 stdout, 2 stderr, 3 both, "
        "or per local rank as '0:3,1:2' (torchrun's --tee; 3 when --log_dir is given alone).",
    )
    add(
        "log_dir",
        help="Directory for each process's output (torchrun's --log_dir): "
        "<log_dir>/<run>/attempt_<n>/<local_rank>/stdout.log and stderr.log.",
    )
    add("role", default="default", help="Name of the worker role (torchrun's --role).")
    add("rdzv_conf", help="Extra rendezvous settings, 'key1=value1,key2=value2' (torchrun's --rdzv_conf).")


def check_host(value: str) -> str | None:
    """None for an IPv4/IPv6 address or a host name (RFC 1123 labels), else what is wrong. Empty means not set."""
    import ipaddress

    text = value.strip()
    if not text:
        return None
    try:
        ipaddress.ip_address(text)
        return None
    except ValueError:
        pass
    label = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
    if len(text) <= 253 and all(label.fullmatch(part) for part in text.rstrip(".").split(".")):
        return None
    return "must be an IP address (10.0.0.7) or a host name (node-1.example.com)"


def check_device_ids(value: str) -> str | None:
    """None for ``all`` or a comma-separated list of distinct device numbers (``0,1``), else what is wrong."""
    text = value.strip()
    if not text or text.lower() == "all":
        return None
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        return "must be 'all' or device numbers separated by commas (0,1,3)"
    if len(set(map(int, parts))) != len(parts):
        return "lists a device twice"
    return None


# ---------------------------------------------------------------------------------------------------------------
# Known plugins (install hints, capabilities, config keys): a data table, not code paths.


def known_plugins() -> dict[str, Any]:
    with open(Path(__file__).with_name("known_plugins.json"), encoding="utf-8") as fh:
        return json.load(fh)


def install_hint(name: str) -> str:
    info = known_plugins()["plugins"].get(name)
    return f"pip install {info['distribution']}" if info else ""


def known_capabilities() -> list[str]:
    """Every capability some published plugin provides (for did-you-mean hints)."""
    return sorted({c for info in known_plugins()["plugins"].values() for c in info["provides"]})


def provides(capabilities: Iterable[str], capability: str) -> bool:
    """Whether ``capabilities`` include ``capability``, or its kind without a mode (``"compile"`` provides
    ``"compile:inductor"``: every backend)."""
    caps = set(capabilities)
    return capability in caps or (":" in capability and capability.partition(":")[0] in caps)


def providers_of(capability: str) -> list[str]:
    """Names of published plugins that provide a capability (for error messages)."""
    return [n for n, info in known_plugins()["plugins"].items() if provides(info["provides"], capability)]


# ---------------------------------------------------------------------------------------------------------------
# Resolution


def unread_accelerate_variables(env: Mapping[str, str], options: Iterable[Option]) -> str:
    """One notice naming the ``ACCELERATE_*`` variables of ``env`` that no declared option reads (with what to use
    instead), or an empty string. ``ACCELERATE_USE_X=false`` asks for nothing and is left out."""
    read = {var for opt in options for var in opt.env}
    select = known_plugins()["accelerate_launch_flags"]["select"]
    named = []
    for var in sorted(env):
        if not var.startswith("ACCELERATE_") or var in read:
            continue
        flag = var[len("ACCELERATE_") :].lower()
        if flag.startswith("use_") and env[var].strip().lower() in ("", "0", "false", "no", "off"):
            continue
        plugin = select.get(flag)
        named.append(f"{var} (use --plugin {plugin} or Kernel(plugins=[{plugin!r}]))" if plugin else var)
    if not named:
        return ""
    return (
        f"accel does not read {', '.join(named)}; its settings are `accel launch` flags, Kernel arguments or "
        "ACCEL_* variables (`accel launch --help`)"
    )


def int_env(env: Mapping[str, str], var: str, default: int) -> int:
    """A whole number from environment variable ``var`` (``default`` when unset or empty), or a UsageError naming
    the variable and its value (``WORLD_SIZE=two``)."""
    raw = env.get(var) or ""
    if not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(
            f"environment variable {var} must be a whole number, got {raw!r}; unset it (launchers set "
            "it) or set it to a number"
        ) from None


def env_value(opt: Option, env: Mapping[str, str]) -> tuple[Any, str] | None:
    for var in opt.env:
        if var in env and env[var] != "":
            return opt.coerce(env[var], f"environment variable {var}"), var
    return None


def resolve(
    options: Options,
    *,
    flags: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    launched: Mapping[str, Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """Merge every source into one value per option and record where each came from.

    Precedence, highest first: Kernel arguments, flags, values handed over by ``accel launch`` (``ACCEL_CONFIG``),
    environment variables, the config file, defaults."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    env = os.environ if env is None else env
    for opt in options:
        value, source, label = opt.default, "default", ""
        if config and opt.name in config:
            value, source, label = config[opt.name], "file", f"config key {opt.dotted}"
        found = env_value(opt, env)
        if found is not None:
            value, source, label = found[0], f"env {found[1]}", f"environment variable {found[1]}"
        if launched and opt.name in launched:
            value, source, label = opt.coerce(launched[opt.name], "ACCEL_CONFIG"), "launch", "ACCEL_CONFIG"
        if flags and flags.get(opt.name) is not None:
            value, source, label = opt.coerce(flags[opt.name], f"`--{opt.name}`"), "flag", f"`--{opt.name}`"
        if kwargs and kwargs.get(opt.name) is not None:
            label = f"Kernel({opt.name}=...)"
            value, source = opt.coerce(kwargs[opt.name], label), "argument"
        if label:
            value = options.coerce_fields(opt, value, label)
        values[opt.name] = value
        sources[opt.name] = source
    return values, sources


@dataclass(frozen=True)
class Settings:
    """The resolved settings a plugin sees in ``accel_activate``.

    ``values`` holds every declared option; ``world_size`` is the number of processes of the run (planned, when
    called by ``accel launch``; actual, inside a worker); ``phase`` is ``"launch"`` or ``"run"``."""

    values: Mapping[str, Any]  # option name -> converted value, for every declared option
    sources: Mapping[str, str] = field(default_factory=dict)  # option name -> where it came from ("flag", "file", ...)
    world_size: int = 1
    phase: str = "run"
    env: Mapping[str, str] = field(default_factory=dict)  # the environment the settings were resolved in

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def get(self, name: str, default: Any = None) -> Any:
        """``values.get(name, default)``: for an option a plugin that may be absent declares."""
        return self.values.get(name, default)

    @property
    def selected(self) -> tuple[str, ...]:
        """Plugins the user chose explicitly (``--plugin``, ``Kernel(plugins=...)``, Accelerate's distributed_type)."""
        names = list(self.values.get("plugins") or [])
        implied = known_plugins()["distributed_type"].get(str(self.values.get("distributed_type", "NO")))
        if implied and not names:
            names.append(implied)
        return tuple(names)

    def is_selected(self, name: str) -> bool:
        """Whether plugin ``name`` is among ``selected``."""
        return name in self.selected

    @property
    def mixed_precision(self) -> str:
        """The ``mixed_precision`` setting (``"no"`` when absent)."""
        return str(self.values.get("mixed_precision", "no"))
