"""Built-in plugin ``accel``: the kernel's own answers to the hooks of a run with one process, one device, no
plugin needed (data sharding, the checkpoint writer and the memory estimate are built-in plugins of their own,
:mod:`accel.builtin`).

Registered before any installed plugin with ``trylast=True``, so every hook has an answer and any plugin's answer
comes first. torch is imported inside the functions: the CLI registers this module too and must stay torch-free.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accel.contract import HardwareInfo, LaunchPlan, Topology
from accel.hookspecs import hookimpl

if TYPE_CHECKING:
    import torch

    from accel.contract import KernelView


@hookimpl(trylast=True)
def accel_detect_hardware(env: Mapping[str, str]) -> HardwareInfo:
    return HardwareInfo(name="cpu", device_count=1, priority=0, details={"cores": str(os.cpu_count() or 1)})


@hookimpl(trylast=True)
def accel_launch(plan: LaunchPlan) -> int:
    cmd = [plan.python, *plan.command]
    if plan.dry_run:
        print("launcher: accel (one process): " + " ".join(cmd))
        return 0
    from accel.processes import run_process

    return run_process(cmd, plan.env, "the process")


@hookimpl(trylast=True)
def accel_topology(kernel: KernelView) -> Topology:
    return Topology()


@hookimpl(trylast=True)
def accel_device(kernel: KernelView) -> torch.device:
    import torch

    if not kernel.settings["cpu"]:
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and accelerator.is_available():
            dev = accelerator.current_accelerator()
            return torch.device(dev.type, accelerator.current_device_index())
    return torch.device("cpu")


class SingleProcess:
    """Collectives of a run with one process: everything is the identity."""

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return obj

    def barrier(self) -> None:
        return None


@hookimpl(trylast=True)
def accel_collectives(kernel: KernelView) -> SingleProcess:
    return SingleProcess()


@hookimpl(trylast=True)
def accel_model_init_context(kernel: KernelView) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


@hookimpl(trylast=True)
def accel_prepare_training(
    kernel: KernelView, models: list[Any], optimizers: list[Any], schedulers: list[Any]
) -> tuple[list[Any], list[Any], list[Any]]:
    # A strategy written for 0.1.0 answers the deprecated accel_wrap_model/accel_wrap_optimizer instead (they stay
    # hooks until their removal, accel.deprecations); with nobody answering them this is the plain placement.
    hook = kernel.hook
    placed, adapted = [], []
    for model in models:
        answer = hook.accel_wrap_model(kernel=kernel, model=model)
        placed.append(model.to(kernel.device) if answer is None else answer)
    for optimizer in optimizers:
        answer = hook.accel_wrap_optimizer(kernel=kernel, optimizer=optimizer)
        adapted.append(optimizer if answer is None else answer)
    return placed, adapted, list(schedulers)


@hookimpl(trylast=True)
def accel_backward(kernel: KernelView, loss: torch.Tensor, backward_kwargs: dict[str, Any]) -> bool:
    # When only this implementation answers (HotHooks.plain_backward), Kernel.backward makes this call itself.
    kernel.scale_for_accumulation(loss).backward(**backward_kwargs)
    return True


@hookimpl(trylast=True)
def accel_optimizer_step(kernel: KernelView, optimizer: torch.optim.Optimizer) -> bool:
    optimizer.step()
    return True


@hookimpl(trylast=True)
def accel_zero_grad(kernel: KernelView, optimizer: torch.optim.Optimizer, set_to_none: bool) -> bool:
    optimizer.zero_grad(set_to_none=set_to_none)
    return True


@hookimpl(trylast=True)
def accel_no_sync(kernel: KernelView, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


@hookimpl(trylast=True)
def accel_sync_in_backward(kernel: KernelView, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


@hookimpl(trylast=True)
def accel_clip_grad_norm(
    kernel: KernelView, parameters: list[torch.nn.Parameter], max_norm: float, norm_type: float
) -> torch.Tensor:
    # When only this implementation answers (HotHooks.plain_clip), Kernel.clip_grad_norm_ makes this call itself.
    import torch

    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)


@hookimpl(trylast=True)
def accel_model_state_dict(kernel: KernelView, model: torch.nn.Module) -> dict[str, Any]:
    return kernel.unwrap_model(model).state_dict()
