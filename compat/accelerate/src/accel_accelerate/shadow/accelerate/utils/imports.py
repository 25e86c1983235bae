"""``accelerate.utils.imports``: whether optional packages and devices are there (``is_*_available``)."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from typing import Any


@functools.cache
def _found(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def is_torch_version(operation: str, version: str) -> bool:
    from accelerate.utils.versions import compare_versions

    return compare_versions("torch", operation, version)


def _package(name: str) -> Any:
    def check(*args: Any, **kwargs: Any) -> bool:
        return _found(name)

    check.__name__ = f"is_{name}_available"
    return check


def _device(kind: str) -> Any:
    def check(*args: Any, **kwargs: Any) -> bool:
        import torch

        module = getattr(torch, kind, None)
        return bool(module is not None and getattr(module, "is_available", lambda: False)())

    return check


is_deepspeed_available = _package("deepspeed")
is_peft_available = _package("peft")
is_rich_available = _package("rich")
is_tensorboard_available = _package("tensorboard")
is_wandb_available = _package("wandb")
is_mlflow_available = _package("mlflow")
is_transformers_available = _package("transformers")
is_datasets_available = _package("datasets")
is_torchao_available = _package("torchao")
is_transformer_engine_available = _package("transformer_engine")
is_msamp_available = _package("msamp")
is_megatron_lm_available = _package("megatron")
is_bnb_available = _package("bitsandbytes")
is_ipex_available = _package("intel_extension_for_pytorch")
is_lomo_available = _package("lomo_optim")
is_schedulefree_available = _package("schedulefree")
is_pandas_available = _package("pandas")
is_pytest_available = _package("pytest")
is_timm_available = _package("timm")
is_triton_available = _package("triton")
is_torchvision_available = _package("torchvision")
is_comet_ml_available = _package("comet_ml")
is_aim_available = _package("aim")
is_clearml_available = _package("clearml")
is_dvclive_available = _package("dvclive")
is_swanlab_available = _package("swanlab")
is_trackio_available = _package("trackio")
is_torchdata_stateful_dataloader_available = _package("torchdata")
is_cuda_available = _device("cuda")
is_xpu_available = _device("xpu")
is_mlu_available = _device("mlu")
is_musa_available = _device("musa")
is_sdaa_available = _device("sdaa")
is_npu_available = _device("npu")
is_hpu_available = _device("hpu")


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    return _found("torch_xla")


def is_mps_available(min_version: str = "1.12") -> bool:
    import torch

    return bool(torch.backends.mps.is_available())


def is_4bit_bnb_available() -> bool:
    return _found("bitsandbytes")


def is_8bit_bnb_available() -> bool:
    return _found("bitsandbytes")


def is_fp8_available() -> bool:
    """Whether an fp8 backend is installed (accel-plugin-amp's fp8 runs on torchao)."""
    return _found("torchao") or _found("transformer_engine") or _found("msamp")


def is_rocm_available() -> bool:
    import torch

    return torch.version.hip is not None and torch.cuda.is_available()


def is_fp16_available() -> bool:
    """Whether fp16 is supported: everywhere but Habana's first Gaudi (as in Accelerate)."""
    return True


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    import torch

    return bool(torch.cuda.is_bf16_supported()) if torch.cuda.is_available() else True
