"""``accelerate.utils.modeling``: tensors and device maps. The device-map planning is accel-plugin-bigmodel's;
the helpers libraries call on single tensors are here."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from accel_bigmodel.modeling import compute_module_sizes, convert_file_size_to_int, get_max_memory
from accel_bigmodel.modeling import get_max_layer_size as _max_layer_size


def get_max_layer_size(
    modules: list[tuple[str, Any]], module_sizes: Mapping[str, int], no_split_module_classes: list[str]
) -> tuple[int, list[str]]:
    return _max_layer_size(modules, module_sizes, no_split_module_classes)


def clean_device_map(device_map: dict[str, Any], module_name: str = "") -> dict[str, Any]:
    """Merge the entries under ``module_name`` that all go to one device into a single entry (recursively)."""
    prefix = "" if module_name == "" else f"{module_name}."
    values = [v for k, v in device_map.items() if k.startswith(prefix)]
    if module_name != "" and len(set(map(str, values))) == 1 and len(values) > 1:
        for key in [k for k in device_map if k.startswith(prefix)]:
            del device_map[key]
        device_map[module_name] = values[0]
    children = {k[len(prefix) :].split(".")[0] for k in device_map if k.startswith(prefix) and len(k) > len(prefix)}
    for child in sorted(children):
        if f"{prefix}{child}" not in device_map or len(children) > 1:
            clean_device_map(device_map, module_name=f"{prefix}{child}")
    return device_map


def set_module_tensor_to_device(
    module: nn.Module,
    tensor_name: str,
    device: int | str | torch.device,
    value: torch.Tensor | None = None,
    dtype: str | torch.dtype | None = None,
    fp16_statistics: torch.Tensor | None = None,
    tied_params_map: dict[int, dict[torch.device, torch.Tensor]] | None = None,
    non_blocking: bool = False,
    clear_cache: bool = True,
) -> None:
    """Put ``value`` (or the current tensor) on ``device`` as ``module``'s parameter or buffer ``tensor_name``."""
    if "." in tensor_name:
        path, tensor_name = tensor_name.rsplit(".", 1)
        module = module.get_submodule(path)
    if tensor_name not in module._parameters and tensor_name not in module._buffers:
        raise ValueError(f"{module.__class__.__name__} has no parameter or buffer named {tensor_name!r}")
    is_buffer = tensor_name in module._buffers
    old = module._buffers[tensor_name] if is_buffer else module._parameters[tensor_name]
    if old is None:
        raise ValueError(f"{module.__class__.__name__}.{tensor_name} is None")
    if old.device == torch.device("meta") and value is None and str(device) != "meta":
        raise ValueError(f"{tensor_name} is on the meta device: pass its value to put it on {device}")
    new = old if value is None else value
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    if dtype is not None and new.is_floating_point():
        new = new.to(dtype)
    elif value is not None and old.is_floating_point() and new.is_floating_point():
        new = new.to(old.dtype)
    new = new.to(device, non_blocking=non_blocking)
    if is_buffer:
        module._buffers[tensor_name] = new
    else:
        grad = old.requires_grad and (new.is_floating_point() or new.is_complex())
        module._parameters[tensor_name] = nn.Parameter(new, requires_grad=grad)


def named_module_tensors(
    module: nn.Module, include_buffers: bool = True, recurse: bool = False, remove_non_persistent: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        skip = set()
        if remove_non_persistent:
            skip = {n for n, m in module.named_modules() for n in getattr(m, "_non_persistent_buffers_set", ())}
        for name, buffer in module.named_buffers(recurse=recurse):
            if name.split(".")[-1] not in skip:
                yield name, buffer


def find_tied_parameters(model: nn.Module, **kwargs: Any) -> list[list[str]]:
    """Groups of parameter names that share one tensor."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [sorted(names) for names in groups.values() if len(names) > 1]


def check_tied_parameters_on_same_device(tied_params: list[list[str]], device_map: Mapping[str, Any]) -> None:
    import warnings

    for group in tied_params:
        devices = {str(_device_of(name, device_map)) for name in group}
        if len(devices) > 1:
            warnings.warn(f"tied parameters {group} are on different devices: {sorted(devices)}", stacklevel=2)


def _device_of(name: str, device_map: Mapping[str, Any]) -> Any:
    while name and name not in device_map:
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return device_map.get(name, device_map.get(""))


def check_device_map(model: nn.Module, device_map: Mapping[str, Any]) -> None:
    names = [n for n, _ in model.state_dict().items()]
    missing = [n for n in names if _device_of(n, device_map) is None]
    if missing:
        raise ValueError(f"the device_map does not place: {', '.join(missing[:5])}")


def offload_weight(
    weight: torch.Tensor, weight_name: str, offload_folder: str, index: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write ``weight`` as a raw memory-mapped file ``<weight_name>.dat`` in ``offload_folder`` and note it in
    ``index`` (Accelerate's offload format, read back by ``load_offloaded_weights``)."""
    import numpy as np

    dtype = None
    if weight.dtype == torch.bfloat16:
        weight, dtype = weight.view(torch.int16), "bfloat16"
    array = weight.cpu().numpy()
    path = os.path.join(offload_folder, f"{weight_name}.dat")
    if index is not None:
        index[weight_name] = {"dtype": dtype or str(array.dtype), "shape": list(array.shape)}
    if array.ndim == 0:
        array = array[None]
    memory = np.memmap(path, dtype=array.dtype, mode="w+", shape=array.shape)
    memory[:] = array[:]
    memory.flush()
    return index if index is not None else {}


def save_offload_index(index: dict[str, Any], offload_folder: str) -> None:
    if not index:
        return
    path = os.path.join(offload_folder, "index.json")
    current = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            current = json.load(f)
    current.update(index)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(current, f, indent=2)


def load_offloaded_weights(model: nn.Module, index: Mapping[str, Any], offload_folder: str) -> None:
    """Load the weights ``offload_weight`` wrote back into ``model`` (on the CPU)."""
    import numpy as np

    for name, info in index.items():
        shape = tuple(info["shape"]) or (1,)
        dtype = "int16" if info["dtype"] == "bfloat16" else info["dtype"]
        array = np.memmap(os.path.join(offload_folder, f"{name}.dat"), dtype=dtype, shape=shape, mode="r")
        tensor = torch.from_numpy(np.array(array))
        if info["dtype"] == "bfloat16":
            tensor = tensor.view(torch.bfloat16)
        if not info["shape"]:
            tensor = tensor[0]
        set_module_tensor_to_device(model, name, "cpu", value=tensor)


def offload_state_dict(save_dir: str | os.PathLike[str], state_dict: Mapping[str, torch.Tensor]) -> None:
    """Write every tensor of ``state_dict`` with :func:`offload_weight` and its ``index.json`` into ``save_dir``."""
    os.makedirs(save_dir, exist_ok=True)
    index: dict[str, Any] = {}
    for name, tensor in state_dict.items():
        index = offload_weight(tensor, name, os.fspath(save_dir), index=index)
    save_offload_index(index, os.fspath(save_dir))


def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs: Any = None) -> Any:
    import contextlib

    return contextlib.nullcontext()


__all__ = [
    "check_device_map",
    "check_tied_parameters_on_same_device",
    "clean_device_map",
    "compute_module_sizes",
    "convert_file_size_to_int",
    "find_tied_parameters",
    "get_max_layer_size",
    "get_max_memory",
    "get_mixed_precision_context_manager",
    "load_offloaded_weights",
    "named_module_tensors",
    "offload_state_dict",
    "offload_weight",
    "save_offload_index",
    "set_module_tensor_to_device",
]
