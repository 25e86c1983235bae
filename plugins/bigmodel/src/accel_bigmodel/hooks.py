"""Just-in-time weights: forward hooks that put a module's offloaded tensors on its execution device before its
forward and release them after, and hooks that move inputs to the device a module runs on.

Offloaded tensors live in an :class:`OffloadStore`: in CPU memory (offloaded from an accelerator) or in safetensors
files (``"disk"``: the checkpoint's own file when the dtype is unchanged, else a converted copy in
``offload_folder``). Between forwards the module holds a meta tensor of the right shape and dtype in their place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class DiskTensor:
    """A tensor read from a safetensors file at each use."""

    file: str
    key: str
    dtype: torch.dtype  # the dtype it is used in (the file holds it in this dtype)


class OffloadStore:
    """Offloaded tensors by full name: CPU tensors and :class:`DiskTensor` references."""

    def __init__(self) -> None:
        self.cpu: dict[str, torch.Tensor] = {}
        self.disk: dict[str, DiskTensor] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.cpu or name in self.disk

    def __len__(self) -> int:
        return len(self.cpu) + len(self.disk)

    def load(self, names: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        """The named tensors on ``device``; each disk file is opened once. On the CPU, a disk tensor is a view of
        the file's memory map (nothing is copied; the pages are released with the tensor)."""
        out: dict[str, torch.Tensor] = {}
        by_file: dict[str, list[str]] = {}
        for name in names:
            if name in self.cpu:
                out[name] = self.cpu[name].to(device, non_blocking=True)
            else:
                by_file.setdefault(self.disk[name].file, []).append(name)
        from accel_bigmodel.loading import safetensors_file  # here: loading imports this module

        for file, members in by_file.items():
            with safetensors_file(file) as fh:
                for name in members:
                    out[name] = fh.get_tensor(self.disk[name].key).to(device)
        return out

    def write_index(self, folder: str | os.PathLike[str]) -> None:
        """``index.json`` in the offload folder: where each disk tensor is read from (for inspection)."""
        index = {
            name: {"safetensors_file": t.file, "weight_name": t.key, "dtype": str(t.dtype).replace("torch.", "")}
            for name, t in self.disk.items()
        }
        with open(os.path.join(folder, "index.json"), "w") as fh:
            json.dump(index, fh, indent=1)


def set_tensor(
    module: nn.Module, local: str, tensor: torch.Tensor, is_param: bool, requires_grad: bool = False
) -> None:
    """Put ``tensor`` in ``module`` under ``local`` (its own name, no dots), as a parameter or a buffer."""
    if is_param:
        grad = tensor.is_floating_point() or tensor.is_complex()
        module._parameters[local] = nn.Parameter(tensor, requires_grad=grad and requires_grad)
    else:
        module._buffers[local] = tensor


class OffloadHook:
    """Loads one module's offloaded own tensors before its forward and puts meta tensors back after it (also when
    the forward raises)."""

    def __init__(self, module: nn.Module, names: Mapping[str, str], store: OffloadStore, device: torch.device) -> None:
        self.names = dict(names)  # local name -> full name
        self.store = store
        self.device = device
        self.params = {local for local in self.names if local in module._parameters}
        self.empty = {
            local: (module._parameters[local] if local in self.params else module._buffers[local])
            for local in self.names
        }
        self.depth = 0  # a module may call itself (or be shared): load once, release at the outermost exit

    def pre(self, module: nn.Module, args: Any) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        tensors = self.store.load(list(self.names.values()), self.device)
        for local, full in self.names.items():
            set_tensor(module, local, tensors[full], local in self.params)

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        for local in self.names:
            empty = self.empty[local]
            if local in self.params:
                module._parameters[local] = empty  # type: ignore[assignment]
            else:
                module._buffers[local] = empty


def send_to_device(obj: Any, device: torch.device) -> Any:
    """Tensors in (nested) tuples, lists and mappings moved to ``device``; other values unchanged."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True) if obj.device != device else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(send_to_device(v, device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(send_to_device(v, device) for v in obj)
    if isinstance(obj, Mapping):
        moved = {k: send_to_device(v, device) for k, v in obj.items()}
        try:
            return type(obj)(moved)  # type: ignore[call-arg]
        except TypeError:
            return moved
    return obj


def first_device(obj: Any) -> torch.device | None:
    if isinstance(obj, torch.Tensor):
        return obj.device
    values = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple)) else ()
    for value in values:
        found = first_device(value)
        if found is not None:
            return found
    return None


def inputs_to(device: torch.device) -> Callable[..., tuple[Any, Any]]:
    """A forward pre-hook (``with_kwargs=True``) moving a module's inputs to ``device``."""

    def hook(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return send_to_device(args, device), send_to_device(kwargs, device)

    return hook


def attach_io_same_device(model: nn.Module) -> list[Any]:
    """Outputs of ``model`` come back on the device its first input tensor was on."""
    seen: list[torch.device | None] = []

    def pre(module: nn.Module, args: Any, kwargs: Any) -> None:
        seen.append(first_device((args, kwargs)))

    def post(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        device = seen.pop() if seen else None
        return send_to_device(output, device) if device is not None else output

    return [
        model.register_forward_pre_hook(pre, with_kwargs=True, prepend=True),
        model.register_forward_hook(post, with_kwargs=True, always_call=True),
    ]


def remove_hooks(model: nn.Module) -> None:
    """Remove the hooks :func:`accel_bigmodel.dispatch_model` attached (offloaded tensors stay on meta)."""
    for handle in getattr(model, "_accel_bigmodel_hooks", []):
        handle.remove()
    model._accel_bigmodel_hooks = []  # type: ignore[assignment]
