"""accel-plugin-deepspeed: the entry-point module. Cheap to import: no torch or deepspeed here (see ``strategy.py``).

Activates when selected: ``accel launch --plugin deepspeed``, ``Kernel(plugins=["deepspeed"])`` or Accelerate's
``distributed_type: DEEPSPEED``. Its options are Accelerate's ``deepspeed_config`` keys (and flags).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accel.spi import Options, Question, Settings, UsageError, hookimpl

if TYPE_CHECKING:
    from accel.spi import MemoryQuery, MemoryRow, ModelSummary

NAME = "deepspeed"
accel_components = ["accel_deepspeed.strategy:DeepSpeedStrategy"]
__all__ = ["DummyOptim", "DummyScheduler"]


def __getattr__(name: str) -> Any:
    if name in __all__:  # Accelerate's stand-ins for a config file's optimizer/scheduler (they import torch)
        from accel_deepspeed import dummy

        return getattr(dummy, name)
    raise AttributeError(f"module 'accel_deepspeed' has no attribute {name!r}")


LAUNCHERS = ("standard", "pdsh", "openmpi", "mvapich", "mpich", "slurm", "nossh")
DEVICES = ("none", "cpu", "nvme")

#: Options of this plugin (the names of ``accel launch`` flags and Kernel arguments); each one's config key is
#: ``deepspeed_config.<key>``, as in Accelerate's YAML.
CONFIG_KEYS = {
    "deepspeed_config_file": "deepspeed_config_file",
    "zero_stage": "zero_stage",
    "offload_optimizer_device": "offload_optimizer_device",
    "offload_param_device": "offload_param_device",
    "offload_optimizer_nvme_path": "offload_optimizer_nvme_path",
    "offload_param_nvme_path": "offload_param_nvme_path",
    "deepspeed_gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero3_save_16bit_model": "zero3_save_16bit_model",
    "zero3_init_flag": "zero3_init_flag",
    "deepspeed_moe_layer_cls_names": "deepspeed_moe_layer_cls_names",
    "deepspeed_multinode_launcher": "deepspeed_multinode_launcher",
    "deepspeed_hostfile": "deepspeed_hostfile",
    "deepspeed_inclusion_filter": "deepspeed_inclusion_filter",
    "deepspeed_exclusion_filter": "deepspeed_exclusion_filter",
}


@hookimpl
def accel_add_options(options: Options) -> None:
    def add(name: str, **kwargs: object) -> None:
        options.add(name, config_key=f"deepspeed_config.{CONFIG_KEYS[name]}", **kwargs)  # type: ignore[arg-type]

    add("deepspeed_config_file", help="DeepSpeed JSON config; 'auto' values are filled from accel's settings.")
    add("zero_stage", type="int", minimum=0, maximum=3, help="ZeRO stage 0-3 (default 2 without a JSON file).")
    add("offload_optimizer_device", choices=DEVICES, help="Offload optimizer states (ZeRO 1-3): none, cpu or nvme.")
    add("offload_param_device", choices=DEVICES, help="Offload parameters (ZeRO-3 only): none, cpu or nvme.")
    add("offload_optimizer_nvme_path", help="Directory for optimizer states offloaded to NVMe.")
    add("offload_param_nvme_path", help="Directory for parameters offloaded to NVMe.")
    add(
        "deepspeed_gradient_accumulation_steps",
        type="int",
        minimum=1,
        help="DeepSpeed's gradient_accumulation_steps; must equal the Kernel's (handed to it when only set here).",
    )
    add("gradient_clipping", type="float", minimum=0, help="Clip gradients to this global norm in the engine.")
    add(
        "zero3_save_16bit_model",
        type="bool",
        help="save_model/get_state_dict give the 16-bit training weights instead of gathered fp32 master weights.",
    )
    add(
        "zero3_init_flag",
        type="bool",
        default=False,
        help="ZeRO-3: build models partitioned (deepspeed.zero.Init) inside kernel.model_init_context().",
    )
    add(
        "deepspeed_moe_layer_cls_names",
        type="list",
        help="ZeRO-3: class names of MoE layers kept whole (leaf modules).",
    )
    add(
        "deepspeed_multinode_launcher",
        choices=LAUNCHERS,
        default="standard",
        help="How to start several machines: standard (torchrun on each machine) or DeepSpeed's runner "
        "with pdsh, openmpi, mvapich, mpich or slurm (started once), or nossh (started on each machine).",
    )
    add("deepspeed_hostfile", help="MPI-style hostfile ('host slots=N' lines) for the DeepSpeed runner.")
    add("deepspeed_inclusion_filter", help="DeepSpeed runner --include, e.g. 'worker-0:0,1@worker-1'.")
    add("deepspeed_exclusion_filter", help="DeepSpeed runner --exclude, e.g. 'worker-1:0'.")


def explicit_options(settings: Settings) -> list[str]:
    """This plugin's options the user set on the command line or as Kernel arguments (not in a config file)."""
    return [name for name in CONFIG_KEYS if settings.sources.get(name) in ("flag", "argument")]


@hookimpl
def accel_activate(settings: Settings) -> object | None:
    if settings.is_selected(NAME):
        from accel_deepspeed.strategy import DeepSpeedStrategy

        return DeepSpeedStrategy(settings)
    given = explicit_options(settings)
    if given:
        raise UsageError(
            f"DeepSpeed option(s) {', '.join('--' + g for g in given)} given, but DeepSpeed is not "
            "selected; add --plugin deepspeed (or Kernel(plugins=['deepspeed']))"
        )
    return None


@hookimpl
def accel_config_questions(answers: Mapping[str, Any]) -> list[Question] | None:
    """Accelerate's DeepSpeed questions of ``accel config``, when the machine section chose DeepSpeed."""
    if answers.get("distributed_type") != "DEEPSPEED":
        return None
    qs = [
        Question(
            "deepspeed_use_json",
            "Do you want to specify a json file to a DeepSpeed config?",
            kind="confirm",
            default=False,
            store=False,
        )
    ]
    if answers.get("deepspeed_use_json"):
        qs.append(
            Question(
                "deepspeed_config_file",
                "Please enter the path to the json DeepSpeed config file:",
                kind="path",
                default="ds_config.json",
                help='"auto" values in it are filled from accel\'s settings',
            )
        )
    elif "deepspeed_use_json" in answers:
        qs.append(
            Question(
                "zero_stage",
                "What should be your DeepSpeed's ZeRO optimization stage?",
                kind="select",
                choices=("0", "1", "2", "3"),
                default="2",
            )
        )
        stage = answers.get("zero_stage")
        if stage is not None:
            if stage >= 1:
                qs.append(
                    Question(
                        "offload_optimizer_device", "Where to offload optimizer states?", kind="select", default="none"
                    )
                )
            if stage == 3:
                qs.append(
                    Question("offload_param_device", "Where to offload parameters?", kind="select", default="none")
                )
            for device, path in (
                ("offload_optimizer_device", "offload_optimizer_nvme_path"),
                ("offload_param_device", "offload_param_nvme_path"),
            ):
                if answers.get(device) == "nvme":
                    qs.append(
                        Question(path, f"Nvme path for {device.split('_')[1]} offload?", kind="path", default="/nvme")
                    )
            qs.append(
                Question(
                    "deepspeed_gradient_accumulation_steps",
                    "How many gradient accumulation steps you're passing in your script?",
                    kind="int",
                    default=1,
                )
            )
            qs.append(
                Question(
                    "deepspeed_use_clipping",
                    "Do you want to use gradient clipping?",
                    kind="confirm",
                    default=False,
                    store=False,
                )
            )
            if answers.get("deepspeed_use_clipping"):
                qs.append(
                    Question("gradient_clipping", "What is the gradient clipping value?", kind="float", default=1.0)
                )
            if stage == 3:
                qs.append(
                    Question(
                        "zero3_save_16bit_model",
                        "Do you want to save 16-bit model weights when using ZeRO Stage-3?",
                        kind="confirm",
                        default=False,
                    )
                )
    if answers.get("deepspeed_use_json") or answers.get("zero_stage") == 3:
        qs.append(
            Question(
                "zero3_init_flag",
                "Do you want to enable `deepspeed.zero.Init` when using ZeRO Stage-3 for constructing massive models?",
                kind="confirm",
                default=False,
                help="build models inside `with kernel.model_init_context():`",
            )
        )
    if int(answers.get("num_machines", 1)) > 1:
        qs.append(
            Question(
                "deepspeed_multinode_launcher",
                "Which Type of launcher do you want to use?",
                kind="select",
                default="standard",
            )
        )
        if answers.get("deepspeed_multinode_launcher") not in (None, "standard"):
            qs.append(
                Question(
                    "deepspeed_hostfile",
                    "DeepSpeed configures multi-node compute resources with "
                    "hostfile. Please specify the location of hostfile:",
                    kind="path",
                    default="hostfile",
                )
            )
            qs.append(
                Question(
                    "deepspeed_filter",
                    "Do you want to specify exclusion or inclusion filter?",
                    kind="select",
                    choices=("none", "exclusion", "inclusion"),
                    default="none",
                    store=False,
                )
            )
            kind = answers.get("deepspeed_filter")
            if kind in ("exclusion", "inclusion"):
                qs.append(Question(f"deepspeed_{kind}_filter", f"DeepSpeed {kind} filter string:", kind="text"))
    return qs


@hookimpl
def accel_estimate_memory(model: ModelSummary, query: MemoryQuery) -> list[MemoryRow]:
    """Rows of ``accel estimate-memory`` for this strategy (arithmetic only, see ``accel_deepspeed.memory``)."""
    from accel_deepspeed.memory import rows

    return rows(model, query)
