"""Processes for the FSDP strategy: torchrun arguments, the torch.distributed environment, collectives.

Written for this plugin (the same small pattern as accel-plugin-ddp; no dependency on it). torch is imported
inside functions so the CLI can plan a launch without it.
"""

from __future__ import annotations

import os
from typing import Any

from accel import LaunchPlan
from accel.distributed import first_slurm_host, free_port, launch_with_torchrun








def launch(plan: LaunchPlan) -> int:
    """Run the workers through torchrun in this process and wait; return the exit code."""
    return launch_with_torchrun(plan, "fsdp")


def distributed_env() -> None:
    """Make sure the torch.distributed variables exist: from torchrun, translated from SLURM, or a world of one
    (the plugin was selected for a plain ``python train.py``)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return
    if "SLURM_PROCID" in env:
        env.setdefault("RANK", env["SLURM_PROCID"])
        env.setdefault("WORLD_SIZE", env.get("SLURM_NTASKS", "1"))
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
        env.setdefault("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
        env.setdefault("MASTER_ADDR", first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")))
        env.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000))
        return
    env.setdefault("RANK", "0")
    env.setdefault("WORLD_SIZE", "1")
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("LOCAL_WORLD_SIZE", "1")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(free_port()))


def restart_store(timeout: Any) -> dict[str, Any]:
    """After a torchrun restart (``--max_restarts``) the agent keeps one store for every round: give the new group
    a key prefix of its own, so restarted workers never read the dead group's addresses. Returns extra
    ``init_process_group`` arguments (none on the first round)."""
    env = os.environ
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0" or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    import torch.distributed as dist

    world = int(env["WORLD_SIZE"])
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"accel-fsdp/restart_{restart}", store), "rank": int(env["RANK"]),
            "world_size": world}


