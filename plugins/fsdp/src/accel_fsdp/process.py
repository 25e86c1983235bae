"""Processes for the FSDP strategy: torchrun arguments, the torch.distributed environment, collectives.

Written for this plugin (the same small pattern as accel-plugin-ddp; no dependency on it). torch is imported
inside functions so the CLI can plan a launch without it.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
from typing import TYPE_CHECKING, Any

from accel import LaunchPlan, Settings, UsageError

if TYPE_CHECKING:
    import torch


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist such as ``node[03-05,7],gpu1``."""
    head = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    match = re.match(r"^(.*?)\[([^\]]+)\](.*)$", head)
    if not match:
        return head
    prefix, ranges, suffix = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def torchrun_args(settings: Settings, command: list[str]) -> list[str]:
    """The ``torch.distributed.run`` arguments for these settings."""
    nnodes = settings["num_machines"]
    total = settings["num_processes"]
    if total % nnodes:
        raise UsageError(f"--num_processes {total} is not a multiple of --num_machines {nnodes}; "
                         "num_processes counts processes over all machines")
    ip, port, backend = settings["main_process_ip"], settings["main_process_port"], settings["rdzv_backend"]
    args = [f"--nnodes={nnodes}", f"--nproc_per_node={total // nnodes}",
            f"--max_restarts={settings['max_restarts']}", f"--monitor_interval={settings['monitor_interval']:g}"]
    if backend == "static":
        if nnodes == 1:
            ip = ip or "127.0.0.1"
            port = port or free_port()
        args += [f"--node_rank={settings['machine_rank']}", f"--master_addr={ip}", f"--master_port={port or 29500}"]
    else:
        args += [f"--rdzv_backend={backend}", f"--rdzv_endpoint={ip or '127.0.0.1'}:{port or 29500}",
                 f"--rdzv_id={settings.get('rdzv_id') or 'accel'}"]
    # "--" ends torchrun's own options: without it argparse reads the script's options as abbreviations of
    # torchrun's (a script's --start would be taken for --start-method).
    if command[:1] == ["-m"]:
        return [*args, "-m", "--", *command[1:]]
    return [*args, "--", *command]


def launch(plan: LaunchPlan) -> int:
    """Run the workers through torchrun in this process and wait; return the exit code."""
    args = torchrun_args(plan.settings, plan.command)
    env = plan.env
    gpu_ids = plan.settings.get("gpu_ids")
    if gpu_ids and str(gpu_ids).lower() != "all":
        env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids)
    threads = plan.settings.get("num_cpu_threads_per_process")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if plan.dry_run:
        print(f"launcher: fsdp (torchrun): {plan.python} -m torch.distributed.run {shlex.join(args)}")
        return 0
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if not plan.python:
        args = ["--no-python", *args]
    os.environ.clear()
    os.environ.update(env)  # the workers inherit this process's environment
    try:
        run(parse_args(args))
    except ChildFailedError as exc:
        codes = [f.exitcode for f in exc.failures.values() if f.exitcode]
        return codes[0] if codes and codes[0] > 0 else 1
    return 0


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


class TorchDistributed:
    """Collectives over the default torch.distributed process group."""

    def __init__(self, world_size: int):
        import torch.distributed as dist

        self.dist = dist
        self.world_size = world_size

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        import torch

        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.dist.all_gather(out, tensor)
        return out

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        ops = {"sum": self.dist.ReduceOp.SUM, "max": self.dist.ReduceOp.MAX}
        self.dist.all_reduce(tensor, op=ops[op])
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self.dist.broadcast(tensor, src)
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self.dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj]
        self.dist.broadcast_object_list(box, src)
        return box[0]

    def barrier(self) -> None:
        self.dist.barrier()
