"""The DDP strategy component. torch is imported inside methods so the CLI can list and launch without it."""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Mapping

from accel import LaunchPlan, Settings, hookimpl
from accel.distributed import (
    ProcessGroupComponent,
    first_slurm_host,
    free_port,
    launch_with_torchrun,
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
        """The torch.distributed variables, from torchrun or translated from SLURM."""
        env = os.environ
        if "RANK" in env and "WORLD_SIZE" in env:
            return env
        if "SLURM_PROCID" in env:
            os.environ.setdefault("RANK", env["SLURM_PROCID"])
            os.environ.setdefault("WORLD_SIZE", env.get("SLURM_NTASKS", "1"))
            os.environ.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
            os.environ.setdefault("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
            os.environ.setdefault("MASTER_ADDR", first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")))
            os.environ.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000))
            return os.environ
        # Selected explicitly but started as a plain `python script.py`: a world of one.
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        return os.environ

    def _use_accelerator(self) -> bool:
        import torch

        acc = getattr(torch, "accelerator", None)
        return not self.settings["cpu"] and acc is not None and acc.is_available()

    @hookimpl
    def accel_setup(self, kernel: Kernel) -> None:
        import torch
        import torch.distributed as dist

        env = self._env()
        self.local_rank = int(env.get("LOCAL_RANK", 0))
        self.local_world = int(env.get("LOCAL_WORLD_SIZE", 1))
        if self._use_accelerator():
            acc = torch.accelerator.current_accelerator()
            self.device = torch.device(acc.type, self.local_rank % torch.accelerator.device_count())
            torch.accelerator.set_device_index(self.device.index)
        else:
            self.device = torch.device("cpu")
        if not dist.is_initialized():
            backend = self.settings["ddp_backend"]
            if backend == "auto":
                backend = dist.get_default_backend_for_device(self.device)
            timeout = timedelta(seconds=self.settings["ddp_timeout"])
            dist.init_process_group(backend=backend, timeout=timeout,
                                    device_id=self.device if self.device.type != "cpu" else None,
                                    **self._restart_store(env, timeout))
            self.owns_process_group = True

    @staticmethod
    def _restart_store(env: Mapping[str, str], timeout: timedelta) -> dict[str, Any]:
        """After a torchrun restart (``--max_restarts``): the agent keeps one store for every round, so the new
        group's keys must not meet the dead group's (restarted workers would read stale addresses and fail to
        connect). Returns ``init_process_group`` arguments with a store prefixed by the restart count."""
        restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        if restart == "0" or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return {}
        import torch.distributed as dist

        world = int(env["WORLD_SIZE"])
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout)
        return {"store": dist.PrefixStore(f"accel/restart_{restart}", store), "rank": int(env["RANK"]),
                "world_size": world}






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
