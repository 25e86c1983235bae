"""The DDP strategy component. torch is imported inside methods so the CLI can list and launch without it."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from accel.spi import (
    LaunchPlan,
    ProcessGroupComponent,
    Settings,
    UsageError,
    hookimpl,
    launch_with_torchrun,
    local_device,
    restart_store_args,
    torchrun_env,
)

if TYPE_CHECKING:
    import torch

    from accel.spi import KernelView


def batched_power_sgd_works() -> bool:
    """Whether torch's batched PowerSGD hook can run: in torch 2.13 it orthogonalizes a 2-D matrix, which
    ``_orthogonalize`` (batched, 3-D only) refuses with a bare AssertionError."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    try:
        powerSGD_hook._orthogonalize(torch.ones(2, 1))
    except AssertionError:
        return False
    return True


def register_comm_hook(model: Any, hook: str, wrapper: str, state_option: Mapping[str, Any]) -> None:
    """Register the DDP communication hook ``hook`` (``no``, ``fp16``, ``bf16``, ``power_sgd``,
    ``batched_power_sgd``), wrapped by ``wrapper`` (``no``, ``fp16``, ``bf16``), on a DistributedDataParallel model;
    PowerSGD hooks get a ``PowerSGDState`` built from ``state_option``. As Accelerate: a wrapper without a hook
    does nothing."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hooks: dict[str, Any] = {
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": default_hooks.bf16_compress_hook,
        "power_sgd": powerSGD_hook.powerSGD_hook,
        "batched_power_sgd": powerSGD_hook.batched_powerSGD_hook,
    }
    wrappers: dict[str, Any] = {
        "fp16": default_hooks.fp16_compress_wrapper,
        "bf16": default_hooks.bf16_compress_wrapper,
    }
    if hook == "no":
        return
    if hook == "batched_power_sgd" and not batched_power_sgd_works():
        raise UsageError(
            "ddp_comm_hook=batched_power_sgd cannot be used with this torch: its batched_powerSGD_hook "
            "fails at the first compressed step (AssertionError in powerSGD_hook._orthogonalize, which "
            "it hands a 2-D matrix); use power_sgd"
        )
    if hook not in ("power_sgd", "batched_power_sgd") and state_option:
        raise UsageError(f"ddp_comm_state_option is for the PowerSGD hooks; ddp_comm_hook is {hook!r}: remove it")
    function = hooks[hook]
    if wrapper != "no":
        function = wrappers[wrapper](function)
    state: Any = None
    if hook in ("power_sgd", "batched_power_sgd"):
        try:
            state = powerSGD_hook.PowerSGDState(None, **dict(state_option))
        except TypeError as exc:
            raise UsageError(f"ddp_comm_state_option: {exc} (see torch's PowerSGDState for the names)") from None
    try:
        model.register_comm_hook(state=state, hook=function)
    except TypeError as exc:  # torch refuses a hook this backend cannot run (bf16 needs NCCL 2.10+ or XCCL)
        what = f"ddp_comm_hook={hook}" + (f" with ddp_comm_wrapper={wrapper}" if wrapper != "no" else "")
        raise UsageError(f"{what} cannot be used here: {exc}; choose another hook") from None


class DDPStrategy(ProcessGroupComponent):
    """Answers for a data-parallel run: process group, topology, device, DDP wrapping, no_sync, torchrun launch."""

    role = "strategy"
    provides = frozenset({"distributed", "local_sgd"})

    def __init__(self, settings: Settings):
        self.settings = settings
        self.owns_process_group = False

    # ---- launching ----------------------------------------------------------------------------------------

    @hookimpl
    def accel_launch(self, plan: LaunchPlan) -> int:
        return launch_with_torchrun(plan, "ddp")

    # ---- process start-up ---------------------------------------------------------------------------------

    def _env(self) -> Mapping[str, str]:
        """The torch.distributed variables: from torchrun, translated from SLURM, or a world of one."""
        torchrun_env(os.environ)
        return os.environ

    @hookimpl
    def accel_setup(self, kernel: KernelView) -> None:
        import torch.distributed as dist

        env = self._env()
        self.local_rank = int(env.get("LOCAL_RANK", 0))
        self.local_world = int(env.get("LOCAL_WORLD_SIZE", 1))
        self.device = local_device(self.local_rank, self.settings["cpu"])
        if not dist.is_initialized():
            backend = self.settings["ddp_backend"]
            if backend == "auto":
                backend = dist.get_default_backend_for_device(self.device)
            timeout = timedelta(seconds=self.settings["ddp_timeout"])
            dist.init_process_group(
                backend=backend,
                timeout=timeout,
                device_id=self.device if self.device.type != "cpu" else None,
                **restart_store_args(env, timeout, "accel"),
            )
            self.owns_process_group = True

    # ---- models -------------------------------------------------------------------------------------------

    @hookimpl
    def accel_prepare_training(
        self, kernel: KernelView, models: list[Any], optimizers: list[Any], schedulers: list[Any]
    ) -> tuple[list[Any], list[Any], list[Any]]:
        return [self.wrap_model(m) for m in models], list(optimizers), list(schedulers)

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model on this process's device, wrapped in DistributedDataParallel when it has trainable parameters."""
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(self.device)
        if not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to synchronise (an evaluation-only model)
        s = self.settings
        # broadcast_buffers is passed only when turned off: torch >= 2.13 warns (FutureWarning) whenever it is given,
        # and True is what DistributedDataParallel does without it
        buffers: dict[str, Any] = {} if s["ddp_broadcast_buffers"] else {"broadcast_buffers": False}
        ddp = DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type != "cpu" else None,
            find_unused_parameters=s["ddp_find_unused_parameters"],
            bucket_cap_mb=s["ddp_bucket_cap_mb"],
            gradient_as_bucket_view=s["ddp_gradient_as_bucket_view"],
            static_graph=s["ddp_static_graph"],
            **buffers,
        )
        register_comm_hook(ddp, s["ddp_comm_hook"], s["ddp_comm_wrapper"], s["ddp_comm_state_option"])
        return ddp

    @hookimpl
    def accel_no_sync(
        self, kernel: KernelView, model: torch.nn.Module
    ) -> contextlib.AbstractContextManager[Any] | None:
        # called on every accumulation micro-step: the class from a cache (a `from torch.nn.parallel import` here
        # would run importlib's from-list handling each time)
        return model.no_sync() if isinstance(model, _ddp_class()) else None

    @hookimpl
    def accel_sync_in_backward(
        self, kernel: KernelView, model: torch.nn.Module
    ) -> contextlib.AbstractContextManager[Any] | None:
        from torch.nn.parallel import DistributedDataParallel

        return _synced_backward(model) if isinstance(model, DistributedDataParallel) else None


@functools.cache
def _ddp_class() -> type[torch.nn.parallel.DistributedDataParallel]:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


@contextlib.contextmanager
def _synced_backward(model: torch.nn.parallel.DistributedDataParallel) -> Iterator[None]:
    """DDP decides in the forward whether the backward all-reduces; a forward under ``no_sync`` decided not to. Set
    the flags back and prepare the reducer, so the backward inside all-reduces (Accelerate's
    ``trigger_sync_in_backward``); the flags are restored after."""
    backward, forward = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = backward, forward
