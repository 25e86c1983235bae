"""The DDP strategy component. torch is imported inside methods so the CLI can list and launch without it."""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Mapping

from accel import LaunchPlan, Settings, hookimpl
from accel.distributed import (
    ProcessGroupComponent,
    launch_with_torchrun,
    local_device,
    restart_store_args,
    torchrun_env,
)

if TYPE_CHECKING:
    import torch

    from accel.kernel import Kernel









class DDPStrategy(ProcessGroupComponent):
    """Answers for a data-parallel run: process group, topology, device, DDP wrapping, no_sync, torchrun launch."""

    role = "strategy"
    provides = frozenset({"distributed"})

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
    def accel_setup(self, kernel: Kernel) -> None:
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
            dist.init_process_group(backend=backend, timeout=timeout,
                                    device_id=self.device if self.device.type != "cpu" else None,
                                    **restart_store_args(env, timeout, "accel"))
            self.owns_process_group = True

    # ---- models -------------------------------------------------------------------------------------------

    @hookimpl
    def accel_wrap_model(self, kernel: Kernel, model: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(self.device)
        if not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to synchronise (an evaluation-only model)
        return DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type != "cpu" else None,
            find_unused_parameters=self.settings["ddp_find_unused_parameters"],
            bucket_cap_mb=self.settings["ddp_bucket_cap_mb"],
        )

    @hookimpl
    def accel_no_sync(self, kernel: Kernel, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any] | None:
        from torch.nn.parallel import DistributedDataParallel

        return model.no_sync() if isinstance(model, DistributedDataParallel) else None
