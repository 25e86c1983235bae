"""``accelerate.utils.dataclasses``: Accelerate's configuration classes. Those accel has are accel's own objects
(``DataLoaderConfiguration``, ``GradientAccumulationPlugin``, ``ProjectConfiguration``, ``DistributedType``, the
kwargs handlers); the plugin objects (``DeepSpeedPlugin``, ``FullyShardedDataParallelPlugin``,
``TorchDynamoPlugin``) keep Accelerate's fields and turn into the options of accel's plugins (``options_of``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from accel.data_arguments import DataLoaderConfiguration, GradientAccumulationPlugin
from accel.project import ProjectConfiguration
from accel.utils.dataclasses import DistributedType
from accel.utils.handlers import (
    AORecipeKwargs,
    AutocastKwargs,
    FP8RecipeKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    TERecipeKwargs,
)


class _StrEnum(str, enum.Enum):
    def __str__(self) -> str:
        return str(self.value)


class PrecisionType(_StrEnum):
    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class DynamoBackend(_StrEnum):
    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    IPEX = "IPEX"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"


class ComputeEnvironment(_StrEnum):
    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class SageMakerDistributedType(_StrEnum):
    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class LoggerType(_StrEnum):
    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    TRACKIO = "trackio"


class RNGType(_StrEnum):
    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    GENERATOR = "generator"


class CustomDtype(enum.Enum):
    """Dtypes torch lacks, for memory estimates (Accelerate's)."""

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"


class DDPCommunicationHookType(_StrEnum):
    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


def _set(options: dict[str, Any], name: str, value: Any) -> None:
    if value is not None:
        options[name] = value


@dataclass
class TorchDynamoPlugin:
    """Accelerate's ``TorchDynamoPlugin``: becomes ``dynamo_backend`` and accel-plugin-dynamo's options."""

    backend: Any = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    @staticmethod
    def options_of(plugin: TorchDynamoPlugin) -> dict[str, Any]:
        backend = str(getattr(plugin.backend, "value", plugin.backend) or "no").lower()
        if backend == "no" or plugin.disable:
            return {}
        options: dict[str, Any] = {"dynamo_backend": backend}
        _set(options, "dynamo_mode", plugin.mode)
        _set(options, "dynamo_use_fullgraph", plugin.fullgraph)
        _set(options, "dynamo_use_dynamic", plugin.dynamic)
        _set(options, "dynamo_use_regional_compilation", plugin.use_regional_compilation)
        return options

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class FullyShardedDataParallelPlugin:
    """Accelerate's ``FullyShardedDataParallelPlugin``: selects accel-plugin-fsdp (FSDP2) with these settings."""

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Any = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: Any = None
    min_num_params: int | None = None
    ignored_params: Any = None
    extras: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def options_of(plugin: FullyShardedDataParallelPlugin) -> dict[str, Any]:
        options: dict[str, Any] = {}
        reshard = plugin.reshard_after_forward
        if isinstance(reshard, str):
            reshard = reshard.upper() not in ("NO_SHARD", "SHARD_GRAD_OP", "FALSE")
        _set(options, "fsdp_reshard_after_forward", reshard)
        offload = plugin.cpu_offload
        _set(
            options,
            "fsdp_offload_params",
            None if offload is None else bool(getattr(offload, "offload_params", offload)),
        )
        policy = plugin.auto_wrap_policy
        if isinstance(policy, str):
            _set(options, "fsdp_auto_wrap_policy", policy.upper())
        names = plugin.transformer_cls_names_to_wrap
        if isinstance(names, list | tuple):
            names = ",".join(names)
        _set(options, "fsdp_transformer_layer_cls_to_wrap", names)
        _set(options, "fsdp_min_num_params", plugin.min_num_params)
        kind = plugin.state_dict_type
        _set(options, "fsdp_state_dict_type", None if kind is None else str(getattr(kind, "name", kind)).upper())
        _set(options, "fsdp_activation_checkpointing", plugin.activation_checkpointing)
        _set(options, "fsdp_cpu_ram_efficient_loading", plugin.cpu_ram_efficient_loading)
        return options

    @classmethod
    def of_kernel(cls, kernel: Any) -> FullyShardedDataParallelPlugin:
        """The settings of a Kernel's fsdp plugin, under Accelerate's names."""
        settings = kernel.settings
        return cls(
            fsdp_version=2,
            reshard_after_forward=settings.get("fsdp_reshard_after_forward"),
            state_dict_type=settings.get("fsdp_state_dict_type"),
            activation_checkpointing=bool(settings.get("fsdp_activation_checkpointing")),
            cpu_ram_efficient_loading=settings.get("fsdp_cpu_ram_efficient_loading"),
        )


#: ``DeepSpeedPlugin`` fields read from its configuration where it sets them (Accelerate's mapping)
_DEEPSPEED_FIELDS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}


@dataclass
class DeepSpeedPlugin:
    """Accelerate's ``DeepSpeedPlugin``: selects accel-plugin-deepspeed with these settings. ``hf_ds_config`` (a
    dict, a JSON file or an ``HfDeepSpeedConfig``) is the DeepSpeed configuration, its ``auto`` values filled by
    accel. As in Accelerate, ``deepspeed_config`` is that configuration (the dict libraries edit before ``prepare``:
    transformers' ``Trainer`` fills its ``auto`` values there), and the fields the configuration sets
    (``zero_stage``, ``gradient_accumulation_steps``, the offload devices, ...) are read from it."""

    hf_ds_config: Any = None
    gradient_accumulation_steps: Any = None
    gradient_clipping: Any = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None
    enable_msamp: bool = False
    msamp_opt_level: str | None = None

    def __post_init__(self) -> None:
        from accelerate.utils.deepspeed import HfDeepSpeedConfig

        self._config_file: str | None = None  # the JSON file given, which accel-plugin-deepspeed reads itself
        self._written: str | None = None  # else the file this process writes deepspeed_config into
        config = self.hf_ds_config
        if config is None:
            self.deepspeed_config: dict[str, Any] = {}
            return
        if isinstance(config, str):
            self._config_file = config
            try:
                config = HfDeepSpeedConfig(config)
            except ValueError:  # no such file, or not JSON: accel-plugin-deepspeed says which, in one line
                self.deepspeed_config = {}
                return
        if not isinstance(config, HfDeepSpeedConfig):
            config = HfDeepSpeedConfig(config)
        self.hf_ds_config = config
        self.deepspeed_config = config.config
        for name, path in _DEEPSPEED_FIELDS.items():
            value = config.get_value(path)
            if value is not None and value != "auto" and getattr(self, name) is None:
                setattr(self, name, value)

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        from accelerate.utils.deepspeed import HfDeepSpeedConfig

        return HfDeepSpeedConfig(self.deepspeed_config).get_value(ds_key_long, default)

    def is_auto(self, ds_key_long: str) -> bool:
        return bool(self.get_value(ds_key_long) == "auto")

    @staticmethod
    def options_of(plugin: DeepSpeedPlugin) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if plugin._config_file is not None:
            options["deepspeed_config_file"] = plugin._config_file
        elif plugin.hf_ds_config is not None:  # accel-plugin-deepspeed reads a file: this process writes one
            import atexit
            import os
            import tempfile

            handle, path = tempfile.mkstemp(suffix=".json", prefix="accel-deepspeed-")
            os.close(handle)
            atexit.register(os.remove, path)
            plugin._written = options["deepspeed_config_file"] = path
            plugin.write_config()
        _set(options, "zero_stage", plugin.zero_stage)
        _set(options, "offload_optimizer_device", plugin.offload_optimizer_device)
        _set(options, "offload_param_device", plugin.offload_param_device)
        _set(options, "offload_optimizer_nvme_path", plugin.offload_optimizer_nvme_path)
        _set(options, "offload_param_nvme_path", plugin.offload_param_nvme_path)
        _set(options, "zero3_init_flag", plugin.zero3_init_flag)
        _set(options, "zero3_save_16bit_model", plugin.zero3_save_16bit_model)
        if isinstance(plugin.gradient_clipping, int | float) and not isinstance(plugin.gradient_clipping, bool):
            options["gradient_clipping"] = float(plugin.gradient_clipping)
        return options

    def write_config(self) -> None:
        """Write ``deepspeed_config`` as it is now into the file accel-plugin-deepspeed reads (the Accelerator does
        so again at each ``prepare``: what a library changed in it since reaches the engine, as in Accelerate)."""
        if self._written is None:
            return
        import json

        with open(self._written, "w", encoding="utf-8") as f:
            json.dump(self.deepspeed_config, f)

    @classmethod
    def of_kernel(cls, kernel: Any) -> DeepSpeedPlugin:
        settings = kernel.settings
        return cls(zero_stage=settings.get("zero_stage"), zero3_init_flag=settings.get("zero3_init_flag"))


def get_module_class_from_name(module: Any, name: str) -> Any:
    """The class called ``name`` among ``module`` and its submodules, or None."""
    if module.__class__.__name__ == name:
        return module.__class__
    for child in module.children():
        found = get_module_class_from_name(child, name)
        if found is not None:
            return found
    return None


__all__ = [
    "AORecipeKwargs",
    "AutocastKwargs",
    "ComputeEnvironment",
    "CustomDtype",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedType",
    "DynamoBackend",
    "FP8RecipeKwargs",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "PrecisionType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RNGType",
    "SageMakerDistributedType",
    "TERecipeKwargs",
    "TorchDynamoPlugin",
    "get_module_class_from_name",
]
