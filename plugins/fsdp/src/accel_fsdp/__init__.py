"""accel-plugin-fsdp: the entry-point module. Cheap to import: no torch here (see ``strategy.py``).

The plugin takes part only when it is selected: ``accel launch --plugin fsdp``, ``Kernel(plugins=["fsdp"])`` or
Accelerate's ``distributed_type: FSDP`` in a config file.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accel.spi import HardwareInfo, Options, Question, Settings, UsageError, hookimpl, nvidia_gpus, sharded
from accel.spi.sharded import WRAP_POLICIES

if TYPE_CHECKING:
    from accel.spi import MemoryQuery, MemoryRow, ModelSummary

NAME = "fsdp"
accel_components = ["accel_fsdp.strategy:FSDPStrategy"]

STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


@hookimpl
def accel_add_options(options: Options) -> None:
    def add(name: str, **kw: object) -> None:
        options.add(name, config_key=f"fsdp_config.{name}", **kw)  # type: ignore[arg-type]

    add(
        "fsdp_version",
        type="int",
        default=2,
        minimum=1,
        maximum=2,
        help="FSDP API version; this plugin implements FSDP2 (torch fully_shard), so only 2 is accepted.",
    )
    sharded.declare_shard_options(add, "fsdp_")
    add(
        "fsdp_state_dict_type",
        default="SHARDED_STATE_DICT",
        choices=STATE_DICT_TYPES,
        help="How save_state writes models and optimizers: sharded (torch.distributed.checkpoint, one file per "
        "rank, loadable on any number of ranks) or full (gathered on the main process).",
    )
    add(
        "fsdp_cpu_ram_efficient_loading",
        type="bool",
        default=False,
        help="Only the main process needs real weights; the others may build the model on the meta device. "
        "The weights are broadcast from the main process after sharding.",
    )
    add(
        "fsdp_sharding_strategy",
        default="FULL_SHARD",
        choices=SHARDING_STRATEGIES,
        help="FSDP1 name, translated: FULL_SHARD = reshard after forward, SHARD_GRAD_OP = keep gathered; "
        "others are not supported.",
    )
    for name, what in (
        ("fsdp_backward_prefetch", "str"),
        ("fsdp_forward_prefetch", "bool"),
        ("fsdp_use_orig_params", "bool"),
        ("fsdp_sync_module_states", "bool"),
    ):
        add(
            name,
            type=what,
            default=None,
            cli=False,
            help="FSDP1 setting, accepted in config files and ignored (FSDP2 has no such knob).",
        )


@hookimpl
def accel_config_questions(answers: Mapping[str, Any]) -> list[Question] | None:
    """Accelerate's FSDP questions (its FSDP2 branch) for ``accel config``, when FSDP was chosen."""
    if answers.get("distributed_type") != "FSDP":
        return None
    qs = [
        Question(
            "fsdp_reshard_after_forward",
            "Do you want to reshard the parameters after the forward pass "
            "(less memory, one more all-gather in backward)?",
            kind="confirm",
            default=True,
        ),
        Question(
            "fsdp_offload_params",
            "Do you want to offload parameters and gradients to CPU?",
            kind="confirm",
            default=False,
        ),
        Question(
            "fsdp_auto_wrap_policy",
            "What should be your auto wrap policy?",
            kind="select",
            choices=WRAP_POLICIES,
            default="TRANSFORMER_BASED_WRAP",
        ),
    ]
    policy = answers.get("fsdp_auto_wrap_policy")
    if policy == "TRANSFORMER_BASED_WRAP":
        qs.append(
            Question(
                "fsdp_transformer_layer_cls_to_wrap",
                "Specify the comma-separated list of transformer "
                "layer class names (case-sensitive) to wrap, e.g. BertLayer, GPTJBlock, T5Block:",
                kind="text",
                default="",
                help="Leave empty to use the model's _no_split_modules.",
            )
        )
    elif policy == "SIZE_BASED_WRAP":
        qs.append(
            Question(
                "fsdp_min_num_params",
                "What should be your FSDP's minimum number of parameters for default auto wrapping?",
                kind="int",
                default=100_000_000,
            )
        )
    if policy is not None:
        qs += [
            Question(
                "fsdp_state_dict_type",
                "What should be your FSDP's state dict type?",
                kind="select",
                choices=STATE_DICT_TYPES,
                default="SHARDED_STATE_DICT",
            ),
            Question(
                "fsdp_cpu_ram_efficient_loading",
                "Do you want to enable CPU RAM efficient model loading "
                "(only the main process holds the weights until they are sharded)?",
                kind="confirm",
                default=False,
            ),
            Question(
                "fsdp_activation_checkpointing",
                "Do you want to enable FSDP activation checkpointing?",
                kind="confirm",
                default=False,
            ),
        ]
    return qs


@hookimpl
def accel_detect_hardware(env: Mapping[str, str]) -> HardwareInfo | None:
    return nvidia_gpus(env)


def check_settings(settings: Settings) -> None:
    """Refuse settings this plugin cannot honour, with one clear line (exit 2 from the CLI)."""
    if settings["fsdp_version"] != 2:
        raise UsageError(
            f"fsdp_version {settings['fsdp_version']} (FSDP1) is not supported: accel-plugin-fsdp "
            "implements FSDP2 (torch fully_shard); set fsdp_version: 2 or drop the key"
        )
    strategy = settings["fsdp_sharding_strategy"]
    if strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"):
        raise UsageError(
            f"fsdp_sharding_strategy {strategy} is not supported by FSDP2 here; use FULL_SHARD or "
            "SHARD_GRAD_OP, or fsdp_reshard_after_forward true/false"
        )
    if settings.mixed_precision not in ("no", "bf16"):
        raise UsageError(
            f"mixed_precision={settings.mixed_precision} is not supported with --plugin fsdp; "
            "use bf16 (realised by FSDP's MixedPrecisionPolicy) or no"
        )


def reshard_after_forward(settings: Settings) -> bool:
    """``fsdp_reshard_after_forward``, or the FSDP1 ``fsdp_sharding_strategy`` when only that was given."""
    if (
        settings.sources.get("fsdp_reshard_after_forward", "default") == "default"
        and settings.sources.get("fsdp_sharding_strategy", "default") != "default"
    ):
        return settings["fsdp_sharding_strategy"] == "FULL_SHARD"
    return bool(settings["fsdp_reshard_after_forward"])


@hookimpl
def accel_activate(settings: Settings) -> object | None:
    if not settings.is_selected(NAME):
        given = sorted(
            n for n in settings.values if n.startswith("fsdp_") and settings.sources.get(n) in ("flag", "argument")
        )
        if given:
            raise UsageError(
                f"FSDP option(s) {', '.join('--' + g for g in given)} given, but FSDP is not selected; "
                "add --plugin fsdp (or --use_fsdp, or Kernel(plugins=['fsdp']))"
            )
        return None
    check_settings(settings)
    from accel_fsdp.strategy import FSDPStrategy

    return FSDPStrategy(settings)


#: Load only a model (and its optimizer) from a checkpoint that ``save_state`` wrote with ``--plugin fsdp``, on any
#: number of processes: ``load_sharded(kernel, directory, model=..., optimizer=..., model_key="model",
#: optimizer_key="optimizer")``, on every process after ``prepare`` (see :func:`accel.spi.sharded.load_sharded`).
load_sharded = functools.partial(sharded.load_sharded, plugin=NAME)


@hookimpl
def accel_estimate_memory(model: ModelSummary, query: MemoryQuery) -> list[MemoryRow]:
    """Rows of ``accel estimate-memory`` for this strategy (arithmetic only, see ``accel_fsdp.memory``)."""
    from accel_fsdp.memory import rows

    return rows(model, query)
