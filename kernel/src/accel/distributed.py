"""Helpers for strategy plugins that own a torch.distributed process group (DDP, FSDP, DeepSpeed, ...)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import sys
import time
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from accel.contract import Component, LaunchPlan, Topology
from accel.errors import UsageError
from accel.hookspecs import hookimpl
from accel.options import Settings

if TYPE_CHECKING:
    import torch

    from accel.contract import KernelView


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for a single-machine rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class TorchDistributed:
    """:class:`accel.contract.Collectives` over the default torch.distributed process group (any backend)."""

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


def barrier_if_initialized() -> None:
    """Wait for every process of the default group, if there is one. For ``accel_end_training`` (a normal end):
    no process then destroys its group while another one still talks to it. Never call it from
    ``accel_teardown``, which also runs after a failure, when the other processes may never arrive."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def destroy_process_group() -> None:
    """Destroy the default process group, giving its worker threads a moment before and after to let go of
    finished work.

    gloo's worker threads drop finished work (which holds Python tensors, so they take the GIL) after the caller
    was woken up. If that happens while the interpreter finalises, the thread cannot take the GIL and the process
    aborts with "terminate called without an active exception" (seen about once in ten runs under load): hence the
    pause after. Before torch 2.8 (pytorch#154976) the group's destructor joins those threads *holding* the GIL, so
    a thread still dropping the last collective's work waits for the GIL forever and the process hangs in
    ``destroy_process_group`` (torch 2.7.0: 1 launch in ~7 of a 2-process gather + ``end_training``): hence the pause
    before, with the GIL released, in which they finish; from torch 2.8 on the destructor joins them with the GIL
    released, and that pause is left out (it was 0.05 s of every launched process's exit)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if destructor_holds_the_gil():
            time.sleep(0.05)
        dist.destroy_process_group()
        time.sleep(0.05)


def destructor_holds_the_gil() -> bool:
    """Whether this torch's process group destructor joins its worker threads holding the GIL (before torch 2.8,
    pytorch#154976)."""
    import torch

    return tuple(int(part) for part in re.findall(r"\d+", str(torch.__version__))[:2]) < (2, 8)


def torchrun_args(
    settings: Settings,
    command: list[str],
    no_python: bool = False,
    with_launcher: bool = False,
    python: str = "",
    log_dir: str | None = None,
    records: str | None = None,
) -> list[str]:
    """The exact ``torch.distributed.run`` arguments for these settings. ``command`` is what follows the
    interpreter (``[script, *args]`` or ``["-m", module, *args]``); ``no_python`` runs ``command[0]`` as an
    executable. With ``with_launcher`` each worker starts through the parent-death prelude of
    :mod:`accel.processes` (``python`` is the interpreter of the workers), so it dies with the launcher.
    ``log_dir`` is the log directory when the settings have none; ``records``, where torchrun keeps its run's
    records (each process's error file) when there is no log directory (its default is a new folder in the temp
    directory that it never removes)."""
    nnodes = settings["num_machines"]
    total = settings["num_processes"]
    if total % nnodes:
        raise UsageError(
            f"--num_processes {total} is not a multiple of --num_machines {nnodes}; "
            "num_processes counts processes over all machines"
        )
    rank = settings["machine_rank"]
    backend = settings["rdzv_backend"]
    ip = settings["main_process_ip"]
    port = settings["main_process_port"]
    args = [
        f"--nnodes={nnodes}",
        f"--nproc_per_node={total // nnodes}",
        f"--max_restarts={settings['max_restarts']}",
        f"--monitor_interval={settings['monitor_interval']:g}",
    ]
    if backend == "static":
        if nnodes == 1:
            ip = ip or "127.0.0.1"
            port = port or free_port()
        args += [f"--node_rank={rank}", f"--master_addr={ip}", f"--master_port={port or 29500}"]
    else:
        args += [
            f"--rdzv_backend={backend}",
            f"--rdzv_endpoint={ip or '127.0.0.1'}:{port or 29500}",
            f"--rdzv_id={settings.get('rdzv_id') or 'accel'}",
        ]
    if settings.get("rdzv_conf"):
        args.append(f"--rdzv_conf={settings['rdzv_conf']}")
    if settings.get("role") not in (None, "", "default"):
        args.append(f"--role={settings['role']}")
    log_dir, tee = settings.get("log_dir") or log_dir, settings.get("tee")
    if log_dir:
        args.append(f"--log_dir={log_dir}")
        tee = tee or "3"  # a log directory without --tee: each process's output in its files *and* on the console
    elif records:
        args.append(f"--log_dir={records}")  # without --tee: the output stays on the console only
    if tee and tee != "0":
        args.append(f"--tee={tee}")
    if settings.get("enable_cpu_affinity"):
        args.append("--numa-binding=node")
    if with_launcher:
        from accel.processes import elastic_signals, with_parent_death

        # accel stops the workers itself on SIGINT/SIGTERM/SIGHUP (torch's agent would forward SIGINT to them)
        if signals := elastic_signals():
            args.append(f"--signals_to_handle={signals}")
        worker = command if no_python else [python or sys.executable, "-u", *command]
        return [*args, "--no-python", "--", *with_parent_death(worker, python or sys.executable)]
    if no_python:
        args.append("--no-python")
    # "--" ends torchrun's own options: without it a script option such as --start would be read as an
    # abbreviation of torchrun's --start-method.
    if command[:1] == ["-m"]:
        return [*args, "-m", "--", *command[1:]]
    return [*args, "--", *command]


def omp_threads(env: MutableMapping[str, str], settings: Settings) -> None:
    """``OMP_NUM_THREADS`` for the workers: ``--num_cpu_threads_per_process``, else the caller's, else 1 when
    several processes share this machine (torchrun's and Accelerate's default; torchrun would otherwise print a
    four-line banner saying it chose 1)."""
    threads = settings.get("num_cpu_threads_per_process")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    elif "OMP_NUM_THREADS" not in env and settings["num_processes"] // settings["num_machines"] > 1:
        env["OMP_NUM_THREADS"] = "1"


def rank_log(log_dir: str, local_rank: int) -> str | None:
    """The newest ``stderr.log`` torchrun wrote for ``local_rank`` under ``log_dir``
    (``<log_dir>/<run>/attempt_<n>/<local_rank>/stderr.log``), or ``None``."""
    from pathlib import Path

    found = sorted(Path(log_dir).glob(f"*/attempt_*/{local_rank}/stderr.log"), key=lambda p: p.stat().st_mtime)
    return str(found[-1]) if found else None


def failure_line(
    exc: Any, settings: Settings, log_dir: str | None, noted: Mapping[int, float] | None = None
) -> tuple[str, int]:
    """One line for torch's ``ChildFailedError`` (which process failed first, how, where its output is) and the exit
    code to return. ``noted``: when an exception ended each worker, by rank (:func:`accel.processes.failure_times`).
    torch's own timestamps have whole seconds only, and they are the time its agent *saw* the exit: two exits seen
    in one poll can get different seconds when the poll crosses a second. So a noted time is used in place of
    torch's, and torch's only for a process with none. Within one second: a process ended by SIGTERM (torchrun's
    agent stops the others that way) comes last; one with no noted time ended without a Python exception
    (``sys.exit``, a crash, another signal) and comes before those noted; ties keep torch's order."""
    noted = noted or {}

    def order(item: tuple[int, Any]) -> tuple[int, bool, float]:
        rank, failure = item
        at = noted.get(rank)
        second = int(at) if at is not None else failure.timestamp
        return second, failure.exitcode == -signal.SIGTERM, float("-inf") if at is None else at

    failures = sorted(exc.failures.items(), key=order)
    rank, first = failures[0]
    code = first.exitcode if first.exitcode and first.exitcode > 0 else (128 - first.exitcode if first.exitcode else 1)
    how = (
        f"was killed by {signal_name(-first.exitcode)}"
        if first.exitcode and first.exitcode < 0
        else f"exited with code {first.exitcode}"
    )
    others = f" ({len(failures) - 1} more failed after it)" if len(failures) > 1 else ""
    where = rank_log(log_dir, first.local_rank) if log_dir else None
    output = (
        f"its output: {where}" if where else "its output is above; --log_dir DIR keeps each process's output in a file"
    )
    return f"accel: process {rank} of {settings['num_processes']} {how}{others}; {output}", code


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def launch_with_torchrun(plan: LaunchPlan, name: str) -> int:
    """Answer ``accel_launch`` with ``torch.distributed.run`` (torchrun) in this process and wait; return the exit
    code. ``name`` is the plugin, for the ``--dry-run`` line. Used by the strategy plugins that run torchrun.

    Workers die with this process (parent-death signal); SIGINT/SIGTERM/SIGHUP stop them with SIGTERM and end
    the launch with one line and ``128 + signal`` (see :mod:`accel.processes`); a failed worker gives one line
    naming it and its log file. Nothing is left in the temp directory but the log files a user asked for: the
    launch's own folder (the failure times, and torchrun's run records when there is no log directory, which
    torchrun would leave there on every run) is removed when it ends."""
    if plan.dry_run:
        return _launch_with_torchrun(plan, name, None)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="accel-launch-", ignore_cleanup_errors=True) as scratch:
        return _launch_with_torchrun(plan, name, scratch)


def _launch_with_torchrun(plan: LaunchPlan, name: str, scratch: str | None) -> int:
    """``launch_with_torchrun`` with its folder ``scratch`` (``None`` for the dry run)."""
    from accel import processes

    log_dir = plan.settings.get("log_dir")
    if not log_dir and plan.settings.get("tee") not in (None, "0") and scratch is not None:
        import tempfile

        log_dir = tempfile.mkdtemp(prefix="accel-logs-")  # where torchrun would put them, but known to us
    args = torchrun_args(
        plan.settings,
        plan.command,
        no_python=not plan.python,
        with_launcher=scratch is not None,  # the dry run shows the command as a user would type it
        python=plan.python or sys.executable,
        log_dir=log_dir,
        records=scratch and os.path.join(scratch, "torchrun"),
    )
    env = plan.env
    gpu_ids = plan.settings.get("gpu_ids")
    if gpu_ids and str(gpu_ids).lower() != "all":
        env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids)
    omp_threads(env, plan.settings)
    if scratch is None:
        print(f"launcher: {name} (torchrun): {plan.python or ''} -m torch.distributed.run {shlex.join(args)}".strip())
        return 0
    with processes.start_up_objects():  # torch's modules live until the launcher exits
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run

    os.environ.clear()
    os.environ.update(env)  # the workers inherit this process's environment
    os.environ[processes.LAUNCHER_PID] = str(os.getpid())

    def stop(signum: int) -> None:
        processes.quiet_torch_elastic()
        # torch's agent stops the workers with the signal it is given: SIGTERM ends them quietly
        raise SignalException(f"accel launch got {signal_name(signum)}", sigval=signal.SIGTERM)

    times = os.environ[processes.FAILURE_TIMES] = os.path.join(scratch, "failures")
    os.mkdir(times)
    total = plan.settings["num_processes"] // plan.settings["num_machines"]
    with processes.stop_signals(stop) as request:
        try:
            run(parse_args(args))
        except SignalException as exc:
            signum = request.signum or int(exc.sigval)
            print(processes.stopped_line(signum, f"the {total} process(es) of this machine"), file=sys.stderr)
            return 128 + signum
        except ChildFailedError as exc:
            line, code = failure_line(exc, plan.settings, log_dir, processes.failure_times(times))
            print(line, file=sys.stderr)
            return code
    return 0


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist such as ``node[03-05,7],gpu1`` (no scontrol needed)."""
    head = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    match = re.match(r"^(.*?)\[([^\]]+)\](.*)$", head)
    if not match:
        return head
    prefix, ranges, suffix = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def local_device(local_rank: int, cpu: bool) -> torch.device:
    """This process's device: the local accelerator that ``local_rank`` picks (made the current one), or the CPU when
    ``cpu`` is set or there is no accelerator."""
    import torch

    acc = getattr(torch, "accelerator", None)
    if cpu or acc is None or not acc.is_available():
        return torch.device("cpu")
    device = torch.device(acc.current_accelerator().type, local_rank % acc.device_count())
    acc.set_device_index(device.index)
    return device


#: Process groups this process has initialised through :func:`restart_store_args` (it numbers their store keys).
_GROUPS_INITIALISED = 0


def restart_store_args(env: Mapping[str, str], timeout: Any, prefix: str) -> dict[str, Any]:
    """Extra ``init_process_group`` arguments when torchrun's agent store may still hold an earlier group's keys;
    none for the first group of the first round. Call it once before each ``init_process_group``.

    The agent keeps one store for the whole launch, and torch names a re-created default group as it named the
    destroyed one, so its keys are those of the earlier group: after a torchrun restart (``--max_restarts``), and
    in a process that initialises a group again (a second ``Kernel`` after ``end_training`` destroyed the first
    one's group). A process would read the earlier group's addresses and fail, or hang, connecting (gloo waits
    on a listener that is gone). So the new group gets a key prefix of its own: ``prefix/restart_N`` after a
    restart, ``/group_K`` added for the K-th group of this process (K >= 1). Every process of the launch
    initialises its groups in the same order, so they agree on K."""
    global _GROUPS_INITIALISED
    group, _GROUPS_INITIALISED = _GROUPS_INITIALISED, _GROUPS_INITIALISED + 1
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    if (restart == "0" and group == 0) or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    import torch.distributed as dist

    world = int(env["WORLD_SIZE"])
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout)
    name = f"{prefix}/restart_{restart}" + (f"/group_{group}" if group else "")
    return {"store": dist.PrefixStore(name, store), "rank": int(env["RANK"]), "world_size": world}


def world_of_one(env: MutableMapping[str, str]) -> None:
    """torch.distributed variables for a plain ``python script.py`` run of a plugin that owns a process group: one
    process on this machine, on a free port (variables already set are kept)."""
    env.setdefault("RANK", "0")
    env.setdefault("WORLD_SIZE", "1")
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("LOCAL_WORLD_SIZE", "1")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(free_port()))


def torchrun_env(env: MutableMapping[str, str]) -> None:
    """Make sure the torch.distributed variables exist: as torchrun set them, translated from SLURM (one ``srun``
    task per process; the first host of the job is the master), or :func:`world_of_one`."""
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
    world_of_one(env)


class ProcessGroupComponent(Component):
    """Base of strategy components that set up the default torch.distributed process group in ``accel_setup``.

    A subclass sets ``device``, ``local_rank``, ``local_world`` and (when it created the group)
    ``owns_process_group`` there; this base answers topology, device, collectives, the end-of-training barrier and
    the teardown from them. Override any of them (DeepSpeed destroys its engines in its own teardown)."""

    role = "strategy"
    device: torch.device  # set by the subclass's accel_setup
    owns_process_group = False
    local_rank = 0
    local_world = 1

    @hookimpl
    def accel_topology(self, kernel: KernelView) -> Topology:
        import torch.distributed as dist

        return Topology(dist.get_rank(), dist.get_world_size(), self.local_rank, self.local_world)

    @hookimpl
    def accel_device(self, kernel: KernelView) -> torch.device:
        return self.device

    @hookimpl
    def accel_collectives(self, kernel: KernelView) -> TorchDistributed:
        return TorchDistributed(kernel.topology.num_processes)

    @hookimpl
    def accel_end_training(self, kernel: KernelView) -> None:
        if self.owns_process_group:
            barrier_if_initialized()

    @hookimpl
    def accel_teardown(self, kernel: KernelView) -> None:
        if self.owns_process_group:
            destroy_process_group()
