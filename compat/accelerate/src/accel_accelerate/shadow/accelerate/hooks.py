"""``accelerate.hooks``: hooks around a module's forward (``ModelHook``, ``add_hook_to_module``). Device alignment and
offloading hooks (``AlignDevicesHook``, ``CpuOffload``) are accel-plugin-bigmodel's job: ``dispatch_model`` and
``load_checkpoint_and_dispatch`` attach its own."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from accel.errors import UsageError


class ModelHook:
    """Runs ``pre_forward`` and ``post_forward`` around the forward of the module it is added to."""

    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        return module


class SequentialHook(ModelHook):
    """Several hooks, run in order."""

    def __init__(self, *hooks: ModelHook) -> None:
        self.hooks = list(hooks)

    def init_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Wrap ``module.forward`` with ``hook`` (replacing a hook added before, or after it with ``append=True``)."""
    old = getattr(module, "_hf_hook", None)
    if append and old is not None:
        module = remove_hook_from_module(module)
        hook = SequentialHook(old, hook)
    elif old is not None:
        module = remove_hook_from_module(module)
    original = module.forward
    module = hook.init_hook(module)
    target: Any = module  # the hook's attributes live on the module, as in Accelerate
    target._old_forward = original
    target._hf_hook = hook

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = target._hf_hook.pre_forward(target, *args, **kwargs)
        if target._hf_hook.no_grad:
            import torch

            with torch.no_grad():
                output = target._old_forward(*args, **kwargs)
        else:
            output = target._old_forward(*args, **kwargs)
        return target._hf_hook.post_forward(target, output)

    target.forward = forward
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Take off the hook ``add_hook_to_module`` added (from every submodule with ``recurse=True``)."""
    target: Any = module
    hook = getattr(target, "_hf_hook", None)
    if hook is not None:
        hook.detach_hook(module)
        del target._hf_hook
    if hasattr(target, "_old_forward"):
        target.forward = target._old_forward
        del target._old_forward
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Take off the hooks of every submodule (and of ``module``)."""
    remove_hook_from_module(module, recurse=True)


class _BigModelHook(ModelHook):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise UsageError(
            f"accelerate.hooks.{type(self).__name__} is not provided by accel-accelerate: place and offload a model "
            "with dispatch_model / load_checkpoint_and_dispatch (accel-plugin-bigmodel), which attach their own hooks"
        )


class AlignDevicesHook(_BigModelHook):
    pass


class CpuOffload(_BigModelHook):
    pass


class UserCpuOffloadHook(_BigModelHook):
    pass


__all__ = [
    "AlignDevicesHook",
    "CpuOffload",
    "ModelHook",
    "SequentialHook",
    "UserCpuOffloadHook",
    "add_hook_to_module",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
]
