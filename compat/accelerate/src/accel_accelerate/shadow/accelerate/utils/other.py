"""``accelerate.utils.other``: small helpers (unwrapping a model, saving on the main process, ...)."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch


def is_compiled_module(module: Any) -> bool:
    return hasattr(torch, "_dynamo") and isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def has_compiled_regions(module: Any) -> bool:
    return any(is_compiled_module(m) for m in module.modules()) if isinstance(module, torch.nn.Module) else False


def extract_model_from_parallel(
    model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True, recursive: bool = False
) -> Any:
    """The user's module inside a prepared model: the process's Kernel unwraps it when it prepared it, else the
    DDP/DataParallel/compile wrappers are taken off."""
    from accel.kernel import active_kernel

    kernel = active_kernel()
    if kernel is not None:
        return kernel.unwrap_model(model, keep_torch_compile=keep_torch_compile)
    compiled = is_compiled_module(model)
    inner = model._orig_mod if compiled else model
    while isinstance(inner, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
        inner = inner.module
    if compiled and keep_torch_compile:
        model._orig_mod = inner
        return model
    return inner


def wait_for_everyone() -> None:
    from accelerate.state import PartialState

    PartialState().wait_for_everyone()


def save(obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    from accelerate.state import PartialState

    state = PartialState()
    if state.is_main_process or (save_on_each_node and state.is_local_main_process):
        if safe_serialization:
            from safetensors.torch import save_file

            save_file(obj, f, metadata={"format": "pt"})
        else:
            torch.save(obj, f)


def is_port_in_use(port: int | None = None) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("localhost", port or 29500)) == 0


def merge_dicts(source: dict[str, Any], destination: dict[str, Any]) -> dict[str, Any]:
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def get_pretty_name(obj: Any) -> str:
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return str(getattr(obj, "__qualname__", getattr(obj, "__name__", obj)))


def convert_bytes(size: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def check_os_kernel() -> None:
    """Accelerate warns about old Linux kernels; accel does not."""


def write_basic_config(mixed_precision: str = "no", save_location: str | None = None) -> Any:
    """Write accel's default config file (``accel config default``)."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "accel.commands.cli", "config", "default", "--mixed_precision", mixed_precision]
    if save_location:
        command += ["--config_file", os.fspath(save_location)]
    return subprocess.run(command, check=True).returncode == 0


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a PEFT model (peft's ``PeftModel``), without importing peft where it is not imported."""
    import sys

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)
