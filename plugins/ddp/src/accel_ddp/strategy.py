"""The DDP strategy component. torch is imported inside methods so the CLI can list and launch without it."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Mapping

from accel import Component, LaunchPlan, Settings, Topology, UsageError, hookimpl

if TYPE_CHECKING:
    import torch

    from accel.kernel import Kernel


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist such as ``node[03-05,7],gpu1`` (no scontrol needed)."""
    head = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    match = re.match(r"^(.*?)\[([^\]]+)\](.*)$", head)
    if not match:
        return head
    prefix, ranges, suffix = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def torchrun_args(settings: Settings, command: list[str], no_python: bool = False) -> list[str]:
    """The exact ``torch.distributed.run`` arguments for these settings. ``command`` is what follows the
    interpreter (``[script, *args]`` or ``["-m", module, *args]``); ``no_python`` runs ``command[0]`` as an
    executable."""
    nnodes = settings["num_machines"]
    total = settings["num_processes"]
    if total % nnodes:
        raise UsageError(f"--num_processes {total} is not a multiple of --num_machines {nnodes}; "
                         "num_processes counts processes over all machines")
    rank = settings["machine_rank"]
    backend = settings["rdzv_backend"]
    ip = settings["main_process_ip"]
    port = settings["main_process_port"]
    args = [f"--nnodes={nnodes}", f"--nproc_per_node={total // nnodes}",
            f"--max_restarts={settings['max_restarts']}", f"--monitor_interval={settings['monitor_interval']:g}"]
    if backend == "static":
        if nnodes == 1:
            ip = ip or "127.0.0.1"
            port = port or free_port()
        args += [f"--node_rank={rank}", f"--master_addr={ip}", f"--master_port={port or 29500}"]
    else:
        args += [f"--rdzv_backend={backend}", f"--rdzv_endpoint={ip or '127.0.0.1'}:{port or 29500}",
                 f"--rdzv_id={settings.get('rdzv_id') or 'accel'}"]
    if no_python:
        args.append("--no-python")
    return args + command


class TorchDistributed:
    """Collectives over a torch.distributed process group."""

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


class DDPStrategy(Component):
    """Answers for a data-parallel run: process group, topology, device, DDP wrapping, no_sync, torchrun launch."""

    role = "strategy"
    provides = frozenset({"distributed"})

    def __init__(self, settings: Settings):
        self.settings = settings
        self.owns_process_group = False

    # ---- launching ----------------------------------------------------------------------------------------

    @hookimpl
    def accel_launch(self, plan: LaunchPlan) -> int:
        args = torchrun_args(plan.settings, plan.command, no_python=not plan.python)
        env = plan.env
        gpu_ids = plan.settings.get("gpu_ids")
        if gpu_ids and str(gpu_ids).lower() != "all":
            env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids)
        threads = plan.settings.get("num_cpu_threads_per_process")
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        if plan.dry_run:
            print(f"launcher: ddp (torchrun): {plan.python} -m torch.distributed.run {shlex.join(args)}")
            return 0
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run

        os.environ.clear()
        os.environ.update(env)  # workers inherit this process's environment
        try:
            run(parse_args(args))
        except ChildFailedError as exc:
            codes = [f.exitcode for f in exc.failures.values() if f.exitcode]
            return codes[0] if codes and codes[0] > 0 else 1
        return 0

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
            self._init_process_group(backend)
            self.owns_process_group = True

    def _init_process_group(self, backend: str) -> None:
        import torch.distributed as dist

        timeout = timedelta(seconds=self.settings["ddp_timeout"])
        device_id = self.device if self.device.type != "cpu" else None
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        if attempt and self.settings["rdzv_backend"] == "static":
            # torchrun's static rendezvous keeps one TCPStore for every attempt, so after a restart a worker can
            # read the addresses its peers published in the failed attempt (connection refused, or a hang). Give
            # each attempt its own keys. (c10d rendezvous starts a fresh store per round and needs no prefix.)
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            store = dist.PrefixStore(f"accel/attempt_{attempt}", store)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                    device_id=device_id)
        else:
            dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id)

    @hookimpl
    def accel_topology(self, kernel: Kernel) -> Topology:
        import torch.distributed as dist

        return Topology(dist.get_rank(), dist.get_world_size(), self.local_rank, self.local_world)

    @hookimpl
    def accel_device(self, kernel: Kernel) -> torch.device:
        return self.device

    @hookimpl
    def accel_collectives(self, kernel: Kernel) -> TorchDistributed:
        return TorchDistributed(kernel.topology.num_processes)

    @hookimpl
    def accel_end_training(self, kernel: Kernel) -> None:
        """A normal end on every process: wait until all processes got here, so none tears down its process group
        while another one still talks to it."""
        import torch.distributed as dist

        if self.owns_process_group and dist.is_initialized():
            dist.barrier()

    @hookimpl
    def accel_teardown(self, kernel: Kernel) -> None:
        import time

        import torch.distributed as dist

        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            # gloo's worker threads drop finished work (which holds Python tensors) after the caller was woken up;
            # if that happens while the interpreter finalises, the thread cannot take the GIL and the process
            # aborts ("terminate called without an active exception"). Let go of the GIL for a moment.
            time.sleep(0.05)

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
