"""``accelerate.utils``: every name of Accelerate's that accel has, found on first use: the façade's own modules
first (the table below), then ``accel.utils`` (operations, random, memory, the kwargs handlers, and the names the
installed plugins export: accel-plugin-bigmodel's device maps, accel-plugin-deepspeed's ``DummyOptim``, ...)."""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {
    "accelerate.utils.dataclasses": (
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
    ),
    "accelerate.utils.deepspeed": (
        "HfDeepSpeedConfig",
        "DeepSpeedEngineWrapper",
        "DeepSpeedOptimizerWrapper",
        "DeepSpeedSchedulerWrapper",
    ),
    "accelerate.utils.fsdp_utils": (
        "save_fsdp_model",
        "load_fsdp_model",
        "save_fsdp_optimizer",
        "load_fsdp_optimizer",
        "merge_fsdp_weights",
        "enable_fsdp_ram_efficient_loading",
        "disable_fsdp_ram_efficient_loading",
        "get_fsdp2_grad_scaler",
    ),
    "accelerate.utils.memory": ("clear_device_cache",),
    "accelerate.utils.modeling": (
        "clean_device_map",
        "set_module_tensor_to_device",
        "offload_weight",
        "load_offloaded_weights",
        "save_offload_index",
        "get_max_layer_size",
        "convert_file_size_to_int",
        "find_tied_parameters",
        "check_tied_parameters_on_same_device",
        "named_module_tensors",
        "check_device_map",
        "get_mixed_precision_context_manager",
    ),
    "accelerate.utils.other": (
        "extract_model_from_parallel",
        "wait_for_everyone",
        "save",
        "write_basic_config",
        "is_port_in_use",
        "merge_dicts",
        "get_pretty_name",
        "convert_bytes",
        "check_os_kernel",
        "is_compiled_module",
        "has_compiled_regions",
    ),
    "accelerate.utils.imports": (
        "is_fp8_available",
        "is_deepspeed_available",
        "is_torch_xla_available",
        "is_peft_available",
        "is_rich_available",
        "is_tensorboard_available",
        "is_wandb_available",
        "is_mlflow_available",
        "is_bf16_available",
        "is_npu_available",
        "is_xpu_available",
        "is_mlu_available",
        "is_musa_available",
        "is_hpu_available",
        "is_sdaa_available",
        "is_cuda_available",
        "is_mps_available",
        "is_transformers_available",
        "is_datasets_available",
        "is_torchao_available",
        "is_transformer_engine_available",
        "is_msamp_available",
        "is_megatron_lm_available",
        "is_bnb_available",
        "is_4bit_bnb_available",
        "is_8bit_bnb_available",
        "is_torch_version",
        "is_ipex_available",
        "is_lomo_available",
        "is_schedulefree_available",
        "is_pandas_available",
        "is_timm_available",
        "is_triton_available",
        "is_torchvision_available",
        "is_comet_ml_available",
        "is_aim_available",
        "is_clearml_available",
        "is_dvclive_available",
        "is_swanlab_available",
        "is_trackio_available",
        "is_torchdata_stateful_dataloader_available",
    ),
    "accelerate.utils.constants": (
        "FSDP_AUTO_WRAP_POLICY",
        "FSDP_SHARDING_STRATEGY",
        "FSDP_BACKWARD_PREFETCH",
        "FSDP_STATE_DICT_TYPE",
        "SAFE_WEIGHTS_NAME",
        "WEIGHTS_NAME",
        "MODEL_NAME",
        "OPTIMIZER_NAME",
        "SCHEDULER_NAME",
        "SAMPLER_NAME",
        "RNG_STATE_NAME",
        "SAFE_WEIGHTS_INDEX_NAME",
        "WEIGHTS_INDEX_NAME",
    ),
    "accelerate.utils.versions": ("compare_versions", "is_torch_version"),
    "accelerate.utils.environment": ("str_to_bool", "parse_flag_from_env", "patch_environment", "get_int_from_env"),
    "accelerate.utils.operations": ("broadcast_object_list", "gather_object", "recursively_apply", "concatenate"),
}
_TABLE = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name in _TABLE:
        return getattr(importlib.import_module(_TABLE[name]), name)
    import accel.utils

    try:
        return getattr(accel.utils, name)
    except AttributeError:
        raise AttributeError(f"module 'accelerate.utils' has no attribute {name!r} (accel-accelerate)") from None
