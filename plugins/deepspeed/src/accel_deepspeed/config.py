"""The DeepSpeed config of a run: a JSON file and/or accel options, with ``"auto"`` filled from the Kernel.

Precedence and agreement rules (one place, no torch import):

- Start from the JSON file (``deepspeed_config_file``) or from ``{}``.
- Each accel option that is set (``--zero_stage``, ``deepspeed_config.offload_optimizer_device``, ...) goes to
  its place in the config. Where the file already holds a value other than ``"auto"`` and it differs, that is an
  error: the two would silently disagree otherwise.
- Values the Kernel owns are filled where the config says ``"auto"`` or nothing, and must agree where it gives
  a number: ``gradient_accumulation_steps`` (the Kernel's), ``train_micro_batch_size_per_gpu`` (the batch size
  of the training DataLoader), ``train_batch_size`` (micro x accumulation x processes), ``bf16``/``fp16``
  (the Kernel's ``mixed_precision``). A disagreement is a :class:`accel.UsageError` naming both values.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from accel.spi import Settings, UsageError
from accel_deepspeed import CONFIG_KEYS

AUTO = "auto"

#: accel option -> path in the DeepSpeed config.
OPTION_PATHS: dict[str, tuple[str, ...]] = {
    "zero_stage": ("zero_optimization", "stage"),
    "offload_optimizer_device": ("zero_optimization", "offload_optimizer", "device"),
    "offload_optimizer_nvme_path": ("zero_optimization", "offload_optimizer", "nvme_path"),
    "offload_param_device": ("zero_optimization", "offload_param", "device"),
    "offload_param_nvme_path": ("zero_optimization", "offload_param", "nvme_path"),
    "deepspeed_gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "gradient_clipping": ("gradient_clipping",),
    "zero3_save_16bit_model": ("zero_optimization", "stage3_gather_16bit_weights_on_model_save"),
}

#: ZeRO-3 bucket sizes that Accelerate/transformers templates set to "auto": derived from the model's hidden size
#: when it has one (``model.config.hidden_size``), otherwise left to DeepSpeed's defaults.
HIDDEN_SIZE_KEYS = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def _get(config: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = config
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def _set(config: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = config
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def read_json(path: str) -> dict[str, Any]:
    """The parsed DeepSpeed JSON file, or a UsageError in one line."""
    if not os.path.isfile(path):
        raise UsageError(f"DeepSpeed config file {path!r} does not exist (deepspeed_config_file)")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except ValueError as exc:
        raise UsageError(f"DeepSpeed config file {path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"DeepSpeed config file {path}: expected a JSON object at the top level")
    return data


@dataclass(frozen=True)
class KernelFacts:
    """What the Kernel knows that the DeepSpeed config must agree with."""

    gradient_accumulation_steps: int
    mixed_precision: str  # no | fp16 | bf16 | fp8
    world_size: int
    micro_batch_size: int | None = None  # None: not known (no DataLoader in the prepare() call)
    hidden_size: int | None = None


def base_config(settings: Settings) -> tuple[dict[str, Any], str]:
    """The JSON file merged with the accel options that are set, before the Kernel's values are filled in.
    Returns (config, where the values came from, for messages)."""
    path = settings.get("deepspeed_config_file")
    config: dict[str, Any] = copy.deepcopy(read_json(path)) if path else {}
    where = f"DeepSpeed config file {path}" if path else "DeepSpeed config"
    for name, cfg_path in OPTION_PATHS.items():
        value = settings.get(name)
        if value is None:
            continue
        present = _get(config, cfg_path)
        if present is not None and present != AUTO and present != value:
            raise UsageError(
                f"{where} sets {'.'.join(cfg_path)}={present!r} but --{name} (deepspeed_config."
                f'{CONFIG_KEYS[name]}) is {value!r}; keep one of them, or write "auto" in the file'
            )
        _set(config, cfg_path, value)
    if not path:
        zero = config.setdefault("zero_optimization", {})
        zero.setdefault("stage", 2)  # Accelerate's default without a file
    stage = _get(config, ("zero_optimization", "stage"))
    if stage is not None and stage != AUTO and (type(stage) is not int or stage not in (0, 1, 2, 3)):
        raise UsageError(f'{where}: zero_optimization.stage is {stage!r}; write a number 0, 1, 2 or 3 (or "auto")')
    return config, where


def stage_of(config: Mapping[str, Any]) -> int:
    stage = _get(config, ("zero_optimization", "stage"))
    return int(stage) if stage not in (None, AUTO) else 0


def explicit_precision(config: Mapping[str, Any]) -> str | None:
    """ "bf16"/"fp16" when the config enables one explicitly (``true``), else None."""
    for name in ("bf16", "fp16"):
        if _get(config, (name, "enabled")) is True:
            return name
    return None


def explicit_accumulation(config: Mapping[str, Any]) -> int | None:
    value = config.get("gradient_accumulation_steps")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def placeholder_micro(config: Mapping[str, Any]) -> int | None:
    """A micro-batch size to check a config with when no DataLoader is known (at launch, for frozen models):
    ``None`` when the config determines it itself, else 1."""
    fixed = isinstance(config.get("train_micro_batch_size_per_gpu"), int) or isinstance(
        config.get("train_batch_size"), int
    )
    return None if fixed else 1


def fill(config: dict[str, Any], facts: KernelFacts, where: str) -> dict[str, Any]:
    """Fill the Kernel-owned and ``"auto"`` values in place and check agreement. Returns ``config``."""
    gas = facts.gradient_accumulation_steps

    def agree(key: str, kernel_value: Any, what: str) -> Any:
        present = config.get(key)
        if present in (None, AUTO):
            config[key] = kernel_value
        elif present != kernel_value:
            raise UsageError(
                f"{where}: {key} is {present!r} but {what} is {kernel_value!r}; set the same value in "
                f'both places, or "auto" in the DeepSpeed config'
            )
        return config[key]

    agree("gradient_accumulation_steps", gas, "the Kernel's gradient_accumulation_steps")
    micro = config.get("train_micro_batch_size_per_gpu")
    if facts.micro_batch_size is not None:
        micro = agree(
            "train_micro_batch_size_per_gpu", facts.micro_batch_size, "the batch size of the training DataLoader"
        )
    elif micro in (None, AUTO):
        total = config.get("train_batch_size")
        if isinstance(total, int) and total % (gas * facts.world_size) == 0:
            micro = config["train_micro_batch_size_per_gpu"] = total // (gas * facts.world_size)
        else:
            raise UsageError(
                "DeepSpeed needs the per-process batch size: pass the training DataLoader to the same "
                "prepare() call as the model and optimizer, or set train_micro_batch_size_per_gpu in "
                "the DeepSpeed config"
            )
    agree(
        "train_batch_size",
        int(micro) * gas * facts.world_size,
        f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x processes ({micro} x {gas} x "
        f"{facts.world_size})",
    )

    if facts.mixed_precision == "fp8":
        raise UsageError("mixed_precision fp8 is not supported by the DeepSpeed plugin; use bf16 or fp16")
    for name in ("bf16", "fp16"):
        wanted = facts.mixed_precision == name
        section = config.get(name)
        if section is None or section == AUTO:
            section = config[name] = {}
        if not isinstance(section, dict):
            raise UsageError(f'{where}: {name} must be an object like {{"enabled": true}}')
        enabled = section.get("enabled", AUTO)
        if enabled != AUTO and bool(enabled) != wanted:
            raise UsageError(
                f"{where}: {name}.enabled is {str(enabled).lower()} but the Kernel's mixed_precision is "
                f"{facts.mixed_precision!r}; set mixed_precision={name if enabled else 'no'} (or "
                f'--mixed_precision), or "auto" in the DeepSpeed config'
            )
        section["enabled"] = wanted
    if config.get("gradient_clipping") in (None, AUTO):
        config["gradient_clipping"] = 0.0

    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        for key, derive in HIDDEN_SIZE_KEYS.items():
            if zero.get(key) == AUTO:
                if facts.hidden_size:
                    zero[key] = derive(facts.hidden_size)
                else:
                    del zero[key]  # DeepSpeed's default
        offload = _get(zero, ("offload_param", "device"))
        if offload not in (None, "none") and stage_of(config) != 3:
            raise UsageError(
                f"{where}: offload_param_device={offload} needs ZeRO stage 3 (stage is {stage_of(config)})"
            )
    # A client torch optimizer with offloaded optimizer states: run it on the CPU partitions as it is (no
    # DeepSpeedCPUAdam build); set "zero_force_ds_cpu_optimizer": true in the file to require DeepSpeed's.
    config.setdefault("zero_force_ds_cpu_optimizer", False)
    config.setdefault("zero_allow_untested_optimizer", True)  # any torch optimizer the script brings (SGD, ...)
    config.setdefault("steps_per_print", 2**31 - 1)  # accel's trackers log; keep DeepSpeed's periodic prints off
    # The optimizer/scheduler sections' "auto" values come from DummyOptim/DummyScheduler at prepare()
    # (fill_sections); they are not known at launch.
    left = [p for p in _autos(config) if p.split(".")[0] not in SECTIONS]
    if left:
        raise UsageError(f'{where}: cannot fill "auto" for {", ".join(left)}; give values there')
    return config


#: Sections of a DeepSpeed config that build the optimizer/scheduler inside the engine (with DummyOptim/
#: DummyScheduler in the script).
SECTIONS = ("optimizer", "scheduler")


def fill_sections(config: dict[str, Any], values: Mapping[str, Mapping[str, Any]], where: str) -> dict[str, Any]:
    """Fill the ``"auto"`` entries of ``config[section]["params"]`` from ``values[section]`` (what the script's
    DummyOptim/DummyScheduler give); an "auto" left over is a UsageError. Returns ``config``."""
    for section in SECTIONS:
        params = _get(config, (section, "params"))
        if not isinstance(params, dict):
            continue
        for key, value in params.items():
            if value == AUTO and values.get(section, {}).get(key) is not None:
                params[key] = values[section][key]
    left = [p for p in _autos(config) if p.split(".")[0] in SECTIONS]
    if left:
        raise UsageError(f'{where}: cannot fill "auto" for {", ".join(left)}; give values there')
    return config


def _autos(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _autos(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if node == AUTO else []
