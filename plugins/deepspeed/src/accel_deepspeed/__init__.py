"""accel-plugin-deepspeed: the entry-point module. Cheap to import: no torch or deepspeed here (see ``strategy.py``).

Activates when selected: ``accel launch --plugin deepspeed``, ``Kernel(plugins=["deepspeed"])`` or Accelerate's
``distributed_type: DEEPSPEED``. Its options are Accelerate's ``deepspeed_config`` keys (and flags).
"""

from __future__ import annotations

from accel import Options, Settings, UsageError, hookimpl

NAME = "deepspeed"
accel_components = ["accel_deepspeed.strategy:DeepSpeedStrategy"]

LAUNCHERS = ("standard", "pdsh", "openmpi", "mvapich", "slurm")
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
    add("zero_stage", type="int", minimum=0, maximum=3,
        help="ZeRO stage 0-3 (default 2 without a JSON file).")
    add("offload_optimizer_device", choices=DEVICES, help="Offload optimizer states (ZeRO 1-3): none, cpu or nvme.")
    add("offload_param_device", choices=DEVICES, help="Offload parameters (ZeRO-3 only): none, cpu or nvme.")
    add("offload_optimizer_nvme_path", help="Directory for optimizer states offloaded to NVMe.")
    add("offload_param_nvme_path", help="Directory for parameters offloaded to NVMe.")
    add("deepspeed_gradient_accumulation_steps", type="int", minimum=1,
        help="DeepSpeed's gradient_accumulation_steps; must equal the Kernel's (handed to it when only set here).")
    add("gradient_clipping", type="float", minimum=0, help="Clip gradients to this global norm in the engine.")
    add("zero3_save_16bit_model", type="bool",
        help="save_model/get_state_dict give the 16-bit training weights instead of gathered fp32 master weights.")
    add("zero3_init_flag", type="bool", default=False,
        help="ZeRO-3: build models partitioned (deepspeed.zero.Init) inside kernel.model_init_context().")
    add("deepspeed_moe_layer_cls_names", type="list",
        help="ZeRO-3: class names of MoE layers kept whole (leaf modules).")
    add("deepspeed_multinode_launcher", choices=LAUNCHERS, default="standard",
        help="How to start several machines: standard (torchrun on each machine) or DeepSpeed's runner "
             "with pdsh, openmpi, mvapich or slurm.")
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
        raise UsageError(f"DeepSpeed option(s) {', '.join('--' + g for g in given)} given, but DeepSpeed is not "
                         "selected; add --plugin deepspeed (or Kernel(plugins=['deepspeed']))")
    return None
