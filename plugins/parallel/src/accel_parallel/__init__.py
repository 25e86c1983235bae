"""accel-plugin-parallel: the entry-point module. Cheap to import: no torch here (see ``strategy.py``).

Trains on an N-dimensional device mesh built from Accelerate's ``parallelism_config`` sizes: data-parallel
replication (``dp_replicate``), data-parallel sharding (``dp_shard``, FSDP2), context parallel (``cp``) and tensor
parallel (``tp``). It takes part when selected (``--plugin parallel``, Accelerate's ``--use_parallelism_config``,
``Kernel(plugins=["parallel"])``) or when ``Kernel(parallelism_config=...)`` is given.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accel.spi import HardwareInfo, Options, Settings, UsageError, hookimpl, nvidia_gpus, sharded

if TYPE_CHECKING:
    from accel.spi import MemoryQuery, MemoryRow, ModelSummary

NAME = "parallel"
accel_components = ["accel_parallel.strategy:ParallelStrategy"]

#: The mesh dimensions in Accelerate's order (``ParallelismConfig._get_mesh``): outermost first, tp innermost.
DIMS = ("dp_replicate", "dp_shard", "cp", "tp")
#: The prefix of the options of FSDP on the data-parallel dims (``parallelism_config_fsdp_offload_params``, ...):
#: accel-plugin-fsdp's ``fsdp_*`` options of the same names and meanings (:func:`accel.spi.sharded.declare_shard_options`).
FSDP_PREFIX = "parallelism_config_fsdp_"
#: Activation checkpointing on any mesh (tp, pp, FSDP, one process): Megatron-LM's recompute_activations.
AC_OPTION = "parallelism_config_activation_checkpointing"
#: The keys of the ``parallelism_config`` mapping this plugin reads (Accelerate's ``ParallelismConfig`` fields).
FIELDS = (
    "pp_size",
    "dp_replicate_size",
    "dp_shard_size",
    "tp_size",
    "cp_size",
    "cp_backend",
    "sp_size",
    "sp_backend",
    "tp_handler",
    "cp_handler",
    "sp_handler",
    "device_mesh",
    "pp_schedule",
    "pp_microbatches",
    "pp_split_points",
    "pp_eval_logits",
    "tp_sequence_parallel",
)
#: ``parallelism_config_pp_schedule`` values (torch.distributed.pipelining schedules, see ``accel_parallel.pipeline``).
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "zerobubble")
#: Tensor-parallel styles a plan may name (Hugging Face's names for the same ``torch.distributed.tensor.parallel``
#: styles are accepted: ``colwise_rep``, ``rowwise_rep``, ``sequence_parallel``).
TP_STYLES = (
    "colwise",
    "rowwise",
    "colwise_rep",
    "rowwise_rep",
    "colwise_gather_output",
    "embedding_rowwise",
    "sequence",
    "sequence_parallel",
)


def _sp_size_one(value: Any) -> str | None:
    return (
        None
        if value == 1
        else (
            "is sequence parallelism (DeepSpeed ALST/Ulysses), which accel-plugin-parallel "
            "does not provide; use parallelism_config_cp_size for long sequences, or "
            "parallelism_config_tp_sequence_parallel for Megatron-style sequence parallelism on tp"
        )
    )


def _distinct(value: Any) -> str | None:
    twice = sorted({str(v) for v in value if list(value).count(v) > 1})
    return f"names {', '.join(twice)} more than once (each split point starts one stage)" if twice else None


def _tp_plan(value: Any) -> str | None:
    bad = sorted(str(s) for s in value.values() if str(s) not in TP_STYLES)
    return f"names unknown tensor-parallel style(s) {', '.join(bad)} (known: {', '.join(TP_STYLES)})" if bad else None


#: Accelerate's ``megatron_lm_config`` keys (and ``--megatron_lm_*`` flags) whose meaning carries over to torch-native
#: parallelism, with the option each sets (see :func:`megatron_settings`).
MEGATRON = {
    "megatron_lm_tp_degree": "parallelism_config_tp_size",
    "megatron_lm_pp_degree": "parallelism_config_pp_size",
    "megatron_lm_num_micro_batches": "parallelism_config_pp_microbatches",
    "megatron_lm_recompute_activations": AC_OPTION,
    "megatron_lm_gradient_clipping": "",
    "megatron_lm_use_distributed_optimizer": "",
    "megatron_lm_sequence_parallelism": "parallelism_config_tp_sequence_parallel",
}


@hookimpl
def accel_add_options(options: Options) -> None:
    def size(dim: str, what: str) -> None:
        name = f"parallelism_config_{dim}_size"
        options.add(
            name,
            type="int",
            default=1,
            minimum=1,
            config_key=f"parallelism_config.{name}",
            env=(name.upper(),),
            help=what,
        )

    size(
        "dp_replicate",
        "Mesh dimension dp_replicate: processes holding full replicas of the (dp_shard-sharded) "
        "model, gradients all-reduced (HSDP with dp_shard > 1).",
    )
    size(
        "dp_shard",
        "Mesh dimension dp_shard: processes over which parameters, gradients and optimizer state are sharded (FSDP2).",
    )
    size(
        "tp",
        "Mesh dimension tp: processes that split each layer's weights (tensor parallel); they read the same batch.",
    )
    size(
        "cp",
        "Mesh dimension cp: processes that split each sequence (context parallel, CUDA only); they read the "
        "same batch.",
    )
    size(
        "pp",
        "Mesh dimension pp (outermost): processes that each run a contiguous part of the model's layers "
        "(pipeline parallel, torch.distributed.pipelining); they read the same batch.",
    )
    options.add(
        "parallelism_config_pp_schedule",
        default="1f1b",
        choices=PP_SCHEDULES,
        config_key="parallelism_config.parallelism_config_pp_schedule",
        env=("PARALLELISM_CONFIG_PP_SCHEDULE",),
        help="Pipeline schedule: gpipe, 1f1b, interleaved1f1b (two stages per process) or zerobubble "
        "(torch's ScheduleZBVZeroBubble, two stages per process).",
    )
    options.add(
        "parallelism_config_pp_microbatches",
        type="int",
        default=0,
        minimum=0,
        flags=("--pp_microbatches",),
        config_key="parallelism_config.parallelism_config_pp_microbatches",
        env=("PARALLELISM_CONFIG_PP_MICROBATCHES",),
        help="Microbatches each batch is split into by the pipeline schedule (0: the number of stages; the batch "
        "must divide by it). Megatron-LM's num_micro_batches.",
    )
    options.add(
        "parallelism_config_pp_split_points",
        type="list",
        default=[],
        check=_distinct,
        config_key="parallelism_config.parallelism_config_pp_split_points",
        env=("PARALLELISM_CONFIG_PP_SPLIT_POINTS",),
        help="Comma-separated names of the layers that start stages 1, 2, ... (e.g. model.layers.2); "
        "default: the layers split evenly by count.",
    )
    options.add(
        "parallelism_config_cp_backend",
        default="torch",
        choices=("torch",),
        config_key="parallelism_config.parallelism_config_cp_backend",
        env=("PARALLELISM_CONFIG_CP_BACKEND",),
        help="Context-parallel backend (torch's context_parallel).",
    )
    options.add(
        "parallelism_config_cp_comm_strategy",
        default="allgather",
        choices=("allgather", "alltoall"),
        config_key="parallelism_config.parallelism_config_cp_comm_strategy",
        env=("PARALLELISM_CONFIG_CP_COMM_STRATEGY",),
        help="How context-parallel attention exchanges keys and values (torch's rotate method).",
    )
    options.add(
        "parallelism_config_sp_size",
        type="int",
        default=1,
        minimum=1,
        check=_sp_size_one,
        config_key="parallelism_config.parallelism_config_sp_size",
        env=("PARALLELISM_CONFIG_SP_SIZE",),
        help="Accelerate's DeepSpeed sequence-parallel size; only 1 is accepted.",
    )
    options.add(
        "parallelism_config_sp_backend",
        default="deepspeed",
        choices=("deepspeed",),
        cli=False,
        config_key="parallelism_config.parallelism_config_sp_backend",
        help="Accelerate's sequence-parallel backend (accepted, unused: sp_size is 1).",
    )
    options.add(
        "parallelism_config_pp_eval_logits",
        type="bool",
        default=True,
        config_key="parallelism_config.parallelism_config_pp_eval_logits",
        env=("PARALLELISM_CONFIG_PP_EVAL_LOGITS",),
        help="With pp > 1, evaluation (a call under torch.no_grad() or in eval mode) also returns the logits: "
        "the last stage's output, broadcast to every process of the pipeline (batch x sequence x vocabulary "
        "values per call). false: only the loss comes back.",
    )
    options.add(
        "parallelism_config_tp_sequence_parallel",
        type="bool",
        default=False,
        config_key="parallelism_config.parallelism_config_tp_sequence_parallel",
        env=("PARALLELISM_CONFIG_TP_SEQUENCE_PARALLEL",),
        help="Megatron-style sequence parallelism on the tp dimension (needs tp_size > 1 and a Hugging Face "
        "decoder): norms and dropout between the tensor-parallel regions run on a 1/tp slice of the sequence "
        "(torch's SequenceParallel). Not Accelerate's sp_size (DeepSpeed ALST).",
    )
    options.add(
        "parallelism_config_tp_plan",
        type="mapping",
        default=None,
        check=_tp_plan,
        config_key="parallelism_config.parallelism_config_tp_plan",
        help="Tensor-parallel plan: JSON object of module-name patterns (fnmatch, e.g. 'layers.*.mlp.up_proj') "
        "to styles (colwise, rowwise, colwise_rep, rowwise_rep, embedding_rowwise, sequence). "
        "Default: the model's Hugging Face tp_plan (base_model_tp_plan and its head's).",
    )

    options.add(
        AC_OPTION,
        type="bool",
        default=False,
        config_key="parallelism_config.parallelism_config_activation_checkpointing",
        env=("PARALLELISM_CONFIG_ACTIVATION_CHECKPOINTING",),
        help="Recompute the activations of each layer in backward instead of keeping them, on any mesh (tp, pp, "
        "FSDP or one process): the layers FSDP would wrap (parallelism_config_fsdp_auto_wrap_policy; by default "
        "the model's _no_split_modules). Megatron-LM's recompute_activations.",
    )

    def fsdp(name: str, **kw: Any) -> None:
        options.add(name, config_key=f"parallelism_config.{name}", env=(name.upper(),), **kw)

    sharded.declare_shard_options(fsdp, FSDP_PREFIX)

    def megatron(name: str, **kw: Any) -> None:
        options.add(name, config_key=f"megatron_lm_config.{name}", env=(name.upper(),), **kw)

    megatron("megatron_lm_tp_degree", type="int", default=1, minimum=1, help="Megatron-LM's tp_degree: sets tp.")
    megatron("megatron_lm_pp_degree", type="int", default=1, minimum=1, help="Megatron-LM's pp_degree: sets pp.")
    megatron(
        "megatron_lm_num_micro_batches",
        type="int",
        default=None,
        minimum=1,
        help="Megatron-LM's num_micro_batches (1 or more): sets parallelism_config_pp_microbatches.",
    )
    megatron(
        "megatron_lm_recompute_activations",
        type="bool",
        default=False,
        help="Megatron-LM's recompute_activations: sets parallelism_config_activation_checkpointing.",
    )
    megatron(
        "megatron_lm_gradient_clipping",
        type="float",
        default=0.0,
        minimum=0.0,
        help="Megatron-LM's gradient_clipping: clip by the global norm before each optimizer step (0: off).",
    )
    megatron(
        "megatron_lm_use_distributed_optimizer",
        type="bool",
        default=False,
        help="Megatron-LM's distributed optimizer: the data-parallel processes shard optimizer state (FSDP2 on "
        "dp_shard, which the remaining processes always form here); accepted.",
    )
    megatron(
        "megatron_lm_sequence_parallelism",
        type="bool",
        default=False,
        help="Megatron-LM's sequence_parallelism: sets parallelism_config_tp_sequence_parallel (ignored with "
        "tp_degree 1, as Megatron-LM does).",
    )
    options.add(
        "parallelism_config",
        type="mapping",
        default=None,
        cli=False,
        config_key="parallelism_config.parallelism_config_object",
        fields="parallelism_config_",  # each field is checked by its parallelism_config_<field> option
        help="Kernel argument: Accelerate's ParallelismConfig (or a dict of its fields); its sizes win over "
        "the parallelism_config_* flags and file keys.",
    )


@hookimpl
def accel_detect_hardware(env: Mapping[str, str]) -> HardwareInfo | None:
    return nvidia_gpus(env)


@hookimpl
def accel_estimate_memory(model: ModelSummary, query: MemoryQuery) -> list[MemoryRow]:
    """Rows of ``accel estimate-memory`` for each mesh shape (arithmetic only, see ``accel_parallel.memory``)."""
    from accel_parallel.memory import rows

    return rows(model, query)


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """The mesh sizes, in :data:`DIMS` order, and what each rank's coordinates are. ``pp`` (pipeline stages) is the
    outermost dimension when > 1 (torchtitan's order). No torch needed."""

    sizes: tuple[int, int, int, int]  # dp_replicate, dp_shard, cp, tp
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_split_points: tuple[str, ...] = ()
    sequence_parallel: bool = False

    @property
    def dims(self) -> tuple[str, ...]:
        """The mesh dimension names, outermost first (``pp`` only when > 1)."""
        return (("pp",) if self.pp > 1 else ()) + DIMS

    @property
    def shape(self) -> tuple[int, ...]:
        return ((self.pp,) if self.pp > 1 else ()) + self.sizes

    @property
    def world(self) -> int:
        out = 1
        for s in self.shape:
            out *= s
        return out

    def size(self, dim: str) -> int:
        return self.pp if dim == "pp" else self.sizes[DIMS.index(dim)]

    @property
    def dp_size(self) -> int:
        return self.size("dp_replicate") * self.size("dp_shard")

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` along each dimension (row-major, as ``init_device_mesh`` lays ranks out)."""
        out: dict[str, int] = {}
        for dim, s in reversed(list(zip(self.dims, self.shape, strict=True))):
            out[dim] = rank % s
            rank //= s
        return {d: out[d] for d in self.dims}

    def dp_index(self, rank: int) -> int:
        """Which data shard ``rank`` reads: its position on the data-parallel dims (dp_replicate x dp_shard)."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.size("dp_shard") + c["dp_shard"]

    def groups(self, dim: str) -> list[list[int]]:
        """The ranks that form each group along ``dim`` (they differ only in their ``dim`` coordinate)."""
        found: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world):
            c = self.coords(rank)
            found.setdefault(tuple(v for d, v in c.items() if d != dim), []).append(rank)
        return list(found.values())

    def describe(self) -> list[str]:
        """Lines for ``accel launch --dry-run``: every dimension with its size and groups, the pipeline stages and
        the data shards."""
        lines = [
            "mesh: "
            + " x ".join(f"{d}={s}" for d, s in zip(self.dims, self.shape, strict=True))
            + f" ({self.world} processes)"
        ]
        for dim in self.dims:
            if self.size(dim) > 1:
                lines.append(
                    f"  {dim} groups: " + " ".join("[" + ",".join(map(str, g)) + "]" for g in self.groups(dim))
                )
        if self.sequence_parallel:
            lines.append("  tp: sequence parallel (norms and dropout on 1/tp of each sequence)")
        if self.pp > 1:
            lines += self.describe_stages()
        shards: dict[int, list[int]] = {}
        for rank in range(self.world):
            shards.setdefault(self.dp_index(rank), []).append(rank)
        lines.append(
            f"  data shards ({self.dp_size}): "
            + " ".join(f"{i}:[" + ",".join(map(str, r)) + "]" for i, r in sorted(shards.items()))
        )
        return lines

    def describe_stages(self) -> list[str]:
        """One line per pipeline stage: its layers (split points, or an even split by count made at prepare) and
        the ranks that run it."""
        from accel_parallel.pipeline import stage_ids, stages_per_rank

        n = self.pp * stages_per_rank(self.pp_schedule)
        points = list(self.pp_split_points)
        lines = [f"  pipeline: {n} stages, schedule {self.pp_schedule}"]
        for stage in range(n):
            ranks = [
                r for r in range(self.world) if stage in stage_ids(self.coords(r)["pp"], self.pp, self.pp_schedule)
            ]
            if points:
                start = "the first layer" if stage == 0 else points[stage - 1]
                end = f"before {points[stage]}" if stage < len(points) else "to the last layer"
                layers = f"layers from {start} {end}"
            else:
                layers = f"layers part {stage + 1}/{n} by count"
            lines.append(f"    stage {stage}: {layers}; ranks [" + ",".join(map(str, ranks)) + "]")
        return lines


def megatron_given(settings: Settings) -> list[str]:
    """The ``megatron_lm_*`` options set (flags, file, environment)."""
    return [k for k in MEGATRON if settings.sources.get(k, "default") != "default"]


def megatron_settings(settings: Settings) -> dict[str, Any]:
    """The ``parallelism_config_*`` values a ``megatron_lm_config`` sets: tp and pp from its degrees, the
    remaining processes as dp_shard (Megatron's data parallel; FSDP2 shards it), microbatches, activation
    recomputation. Empty without megatron_lm settings."""
    if not megatron_given(settings):
        return {}
    tp, pp = int(settings["megatron_lm_tp_degree"]), int(settings["megatron_lm_pp_degree"])
    world = int(settings.world_size)
    if world % (tp * pp):
        raise UsageError(
            f"megatron_lm_config tp_degree={tp} x pp_degree={pp} does not divide the {world} process(es); "
            f"use a multiple of {tp * pp} processes (--num_processes)"
        )
    out: dict[str, Any] = {
        "parallelism_config_tp_size": tp,
        "parallelism_config_pp_size": pp,
        "parallelism_config_dp_shard_size": world // (tp * pp),
    }
    if settings["megatron_lm_num_micro_batches"]:
        out["parallelism_config_pp_microbatches"] = int(settings["megatron_lm_num_micro_batches"])
    if settings["megatron_lm_recompute_activations"]:
        out[AC_OPTION] = True
    if settings["megatron_lm_sequence_parallelism"] and tp > 1:
        out["parallelism_config_tp_sequence_parallel"] = True
    return out


def megatron_notice(settings: Settings) -> str:
    """The one line saying what a ``megatron_lm_config`` became, or an empty string."""
    mega = megatron_settings(settings)
    if not mega:
        return ""
    shown = ", ".join(f"{k.removeprefix('parallelism_config_')}={v}" for k, v in mega.items())
    clip = settings["megatron_lm_gradient_clipping"]
    return (
        "megatron_lm_config runs on torch-native parallelism (accel-plugin-parallel, not the Megatron-LM library): "
        + shown
        + (f", gradient clipping at {clip}" if clip else "")
    )


def _field(obj: Mapping[str, Any], name: str) -> Any:
    value = obj.get(name)
    return obj.get(f"parallelism_config_{name}") if value is None else value


def mesh_plan(settings: Settings) -> MeshPlan:
    """The mesh sizes: ``Kernel(parallelism_config=...)`` (Accelerate's object or a dict) wins for the sizes it
    holds; the rest come from the ``parallelism_config_*`` options (flags, file, environment)."""
    given: Mapping[str, Any] = settings.get("parallelism_config") or {}
    unknown = sorted(k for k in given if k not in FIELDS and k.removeprefix("parallelism_config_") not in FIELDS)
    if unknown:
        raise UsageError(
            f"Kernel(parallelism_config=...) has unknown field(s) {', '.join(unknown)}; known: {', '.join(FIELDS[:6])}"
        )
    # each field was checked by its parallelism_config_<field> option (Option.fields), as its flag would be
    mega = megatron_settings(settings)
    sizes = []
    for dim in DIMS:
        value = _field(given, f"{dim}_size")
        if value is None:
            value = mega.get(f"parallelism_config_{dim}_size", settings[f"parallelism_config_{dim}_size"])
        sizes.append(int(value))
    pp = _field(given, "pp_size")
    pp = int(mega.get("parallelism_config_pp_size", settings["parallelism_config_pp_size"]) if pp is None else pp)
    schedule = str(_field(given, "pp_schedule") or settings["parallelism_config_pp_schedule"])
    points = _field(given, "pp_split_points") or settings["parallelism_config_pp_split_points"] or ()
    check_split_points(points, pp, schedule)
    seq = _field(given, "tp_sequence_parallel")
    if seq is None:
        seq = mega.get("parallelism_config_tp_sequence_parallel", settings["parallelism_config_tp_sequence_parallel"])
    if seq and sizes[3] == 1:
        raise UsageError(
            "parallelism_config_tp_sequence_parallel is set, but tp_size is 1: sequence parallelism shards the "
            "activations between tensor-parallel regions; set parallelism_config_tp_size > 1 or drop it"
        )
    return MeshPlan((sizes[0], sizes[1], sizes[2], sizes[3]), pp, schedule, tuple(str(p) for p in points), bool(seq))


def check_split_points(points: Any, pp: int, schedule: str) -> None:
    """Refuse split points (names of the layers that start stages 1, 2, ...) that do not give one per stage
    boundary."""
    from accel_parallel.pipeline import stages_per_rank

    n = pp * stages_per_rank(schedule)
    if points and n > 1 and len(points) != n - 1:
        raise UsageError(
            f"parallelism_config_pp_split_points gives {len(points)} split point(s) ({', '.join(map(str, points))}), "
            f"but pp_size={pp} with schedule {schedule} has {n} stages: give {n - 1} layer name(s), comma-separated"
        )


def check_plan(plan: MeshPlan, world: int, where: str, machines: int = 1) -> None:
    if plan.world != world:
        spread = f" (num_machines {machines})" if machines > 1 else ""  # the setting that multiplied the processes
        raise UsageError(
            f"{where}: parallelism_config sizes {'pp=' + str(plan.pp) + ' x ' if plan.pp > 1 else ''}"
            f"dp_replicate={plan.sizes[0]} x dp_shard={plan.sizes[1]} "
            f"x cp={plan.sizes[2]} x tp={plan.sizes[3]} = {plan.world}, but the run has {world} "
            f"process(es){spread}; make the product equal the number of processes (--num_processes {plan.world})"
        )


def cp_refusal(settings: Settings, cuda: bool) -> str | None:
    """Why context parallelism cannot run here, or None. torch's ``context_parallel`` rewrites scaled dot-product
    attention into ring attention built on CUDA-only SDPA kernels (flash / memory-efficient / cuDNN)."""
    if settings["cpu"] or not cuda:
        return (
            "parallelism_config_cp_size > 1 needs CUDA: torch's context_parallel shards scaled dot-product "
            'attention only for its CUDA kernels; on the CPU torch fails with "NotImplementedError: Operator '
            "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy "
            'registered."; set parallelism_config_cp_size 1 or run on CUDA GPUs'
        )
    return None


def _given(settings: Settings) -> bool:
    keys = [f"parallelism_config_{d}_size" for d in ("pp", *DIMS)] + ["parallelism_config"]
    return any(settings.sources.get(k, "default") != "default" for k in keys)


@hookimpl
def accel_activate(settings: Settings) -> object | None:
    given = _given(settings)
    mega = megatron_given(settings)
    if not settings.is_selected(NAME):
        if mega and settings.selected:
            raise UsageError(
                f"megatron_lm_config ({', '.join(mega)}) is set, but {', '.join(settings.selected)} is selected; "
                "accel runs Megatron-LM settings on accel-plugin-parallel: use distributed_type: MEGATRON_LM "
                "(or --use_megatron_lm, or --plugin parallel)"
            )
        if mega:
            pass  # a megatron_lm_config asks for it: take part
        elif settings.sources.get("parallelism_config", "default") != "default":
            pass  # Kernel(parallelism_config=...) is Accelerate's way to ask for it: take part
        elif given and settings.selected:
            raise UsageError(
                f"parallelism_config sizes are set, but {', '.join(settings.selected)} is selected; "
                "N-D parallelism needs --plugin parallel (or --use_parallelism_config), which applies "
                "FSDP2 itself on the data-parallel dims"
            )
        elif given and any(
            settings.sources.get(f"parallelism_config_{d}_size") in ("flag", "argument") for d in ("pp", *DIMS)
        ):
            raise UsageError(
                "parallelism_config sizes given, but plugin 'parallel' is not selected; add "
                "--plugin parallel (or --use_parallelism_config, or Kernel(plugins=['parallel']))"
            )
        else:
            return None
    plan = mesh_plan(settings)
    mapped = megatron_settings(settings)
    if mapped:  # what megatron_lm_config sets, as if given as parallelism_config_* options
        settings = dataclasses.replace(
            settings,
            values={**settings.values, **mapped},
            sources={**settings.sources, **{k: "megatron_lm_config" for k in mapped}},
        )
    where = "accel launch" if settings.phase == "launch" else "Kernel()"
    check_plan(plan, settings.world_size, where, int(settings.get("num_machines") or 1))
    if plan.size("cp") > 1:
        why = cp_refusal(settings, nvidia_gpus(settings.env) is not None)
        if why:
            raise UsageError(why)
    fsdp_given = sorted(
        n for n in settings.values if n.startswith(FSDP_PREFIX) and settings.sources.get(n, "default") != "default"
    )
    if fsdp_given and plan.size("dp_replicate") * plan.size("dp_shard") * plan.size("cp") == 1:
        raise UsageError(
            f"{', '.join(fsdp_given)} set, but the mesh has no data-parallel dimension for FSDP to shard over "
            f"(dp_replicate, dp_shard and cp are 1); set parallelism_config_dp_shard_size > 1 or drop them"
        )
    if settings.mixed_precision not in ("no", "bf16"):
        raise UsageError(
            f"mixed_precision={settings.mixed_precision} is not supported with --plugin parallel; use "
            "bf16 (FSDP's MixedPrecisionPolicy) or no"
        )
    from accel_parallel.strategy import ParallelStrategy

    strategy = ParallelStrategy(settings, plan)
    # Kernel(parallelism_config=...) asks for this strategy as --plugin parallel would, on any launcher
    strategy.requested = settings.sources.get("parallelism_config", "default") != "default"
    return strategy


#: Load only a model (and its optimizer) from a checkpoint that ``save_state`` wrote with ``--plugin parallel``, on
#: any mesh (any sizes, any number of processes, one included): ``load_sharded(kernel, directory, model=...,
#: optimizer=..., model_key="model", optimizer_key="optimizer")``, on every process after ``prepare`` (see
#: :func:`accel.spi.sharded.load_sharded`).
load_sharded = functools.partial(sharded.load_sharded, plugin=NAME)


def context_parallel(
    kernel: Any,
    buffers: list[Any] | None = None,
    buffer_seq_dims: list[int] | None = None,
    no_restore_buffers: set[Any] | None = None,
) -> Any:
    """Accelerate's ``maybe_context_parallel``: the context in which the forward and backward of one batch run with
    their sequence split over the ``cp`` dimension. ``buffers`` (input ids, labels, position ids...) are split in
    place along ``buffer_seq_dims`` and restored on exit (except ``no_restore_buffers``); scaled dot-product
    attention inside becomes ring attention. Without context parallelism (cp size 1, or another strategy) it is
    a no-op context, so one script runs either way."""
    import contextlib

    from accel_parallel.strategy import ParallelStrategy

    comp = next((c for c in kernel.components if isinstance(c, ParallelStrategy)), None)
    if comp is None or comp.plan.size("cp") == 1:
        return contextlib.nullcontext()
    return comp.context_parallel(buffers or [], buffer_seq_dims or [], no_restore_buffers or set())
