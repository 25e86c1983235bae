"""Start several processes of a *function* from a notebook, a REPL or a test: ``notebook_launcher`` and
``debug_launcher``.

The processes are started by torch's elastic agent (``torch.distributed.launcher.api.elastic_launch``, the machinery
behind torchrun), which gives every process ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``; the settings given here (``mixed_precision``, ``cpu``) reach the ``Kernel()``
created inside the function through ``ACCEL_CONFIG``, exactly as with ``accel launch``. So inside the function,
``Kernel()`` sees the right world with whatever strategy plugin is installed (accel-plugin-ddp for data parallel).

The same pre-flight checks as ``accel launch`` run before any process starts (the installed plugins are asked to
take part in a run of that many processes, so a missing strategy is one line, not a failure in every child). The
processes die with the launching process (parent-death signal) and leave the terminal's process group; Ctrl-C or
SIGTERM stops them quietly and comes back as ``KeyboardInterrupt`` (Ctrl-C) or the signal's usual effect (SIGTERM),
see :mod:`accel.processes`.

Processes are forked when possible (a function defined in a notebook cannot be imported by a fresh interpreter).
A forked process cannot use a GPU that its parent already initialised ("Cannot re-initialize CUDA in forked
subprocess", Accelerate #3925), so before forking we check whether the parent touched the accelerator: if it did,
an importable function is started with ``spawn`` instead, and a notebook-defined one is refused with a clear message.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from accel.distributed import free_port
from accel.errors import UsageError
from accel.processes import die_with_parent, elastic_signals, quiet_torch_elastic, stop_signals, stopped_line

CUDA_FORK_ERROR = "Cannot re-initialize CUDA in forked subprocess"


def initialized_accelerator(torch_module: Any = None) -> str | None:
    """The device type (``"cuda"``, ``"xpu"``, ...) of torch's accelerator if this process already initialised it,
    else ``None``. Never initialises anything itself; ``None`` when torch was not even imported."""
    torch = torch_module if torch_module is not None else sys.modules.get("torch")
    if torch is None:
        return None
    accelerator = getattr(torch, "accelerator", None)
    current = getattr(accelerator, "current_accelerator", None)
    if current is None:
        return None
    try:
        device = current(check_available=False)
    except TypeError:  # torch < 2.7: no check_available, and current() raises when no accelerator is available
        if accelerator is None or not accelerator.is_available():
            return None
        device = current()
    if device is None:
        return None
    module = getattr(torch, device.type, None)
    is_initialized = getattr(module, "is_initialized", None)
    return device.type if callable(is_initialized) and is_initialized() else None


def importable(function: Callable[..., Any], args: Sequence[Any]) -> bool:
    """Whether a fresh interpreter (``spawn``) can get ``function`` and ``args``: they pickle, and the function does
    not live in an interactive ``__main__`` (a notebook or REPL has no file to import it from)."""
    try:
        pickle.dumps((function, tuple(args)))
    except Exception:
        return False
    if getattr(function, "__module__", None) == "__main__":
        return bool(getattr(sys.modules.get("__main__"), "__file__", None))
    return True


def choose_start_method(
    function: Callable[..., Any], args: Sequence[Any], requested: str | None, accelerator: str | None
) -> str:
    """``fork`` unless the accelerator is already initialised here (or fork does not exist on this platform);
    then ``spawn`` for an importable function, else a UsageError that says what to do."""
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    if requested is not None:
        if requested not in methods:
            raise UsageError(f"start_method {requested!r} is not available here; use one of {', '.join(methods)}")
        if requested == "fork" and accelerator:
            raise UsageError(fork_message(accelerator, function))
        return requested
    if accelerator is None and "fork" in methods:
        return "fork"
    if importable(function, args):
        return "spawn"
    if accelerator:
        raise UsageError(fork_message(accelerator, function))
    raise UsageError(
        f"{getattr(function, '__qualname__', function)!r} cannot be started: this platform cannot fork, "
        "and a new interpreter cannot import it; define it in a module (a .py file) and import it"
    )


def fork_message(accelerator: str, function: Callable[..., Any]) -> str:
    name = getattr(function, "__qualname__", repr(function))
    return (
        f"{accelerator} was already initialised in this process (something used the device: a tensor or model "
        f"moved to it, torch.{accelerator}.* calls), and processes started with fork cannot use it "
        f'("Cannot re-initialize {accelerator.upper()} in forked subprocess"). Restart the notebook kernel and '
        f"call notebook_launcher before anything touches {accelerator} (do that work inside the launched "
        f"function), or define {name!r} in a .py module and import it, so it can be started with spawn"
    )


@contextmanager
def environment(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (or, for ``None``, remove) environment variables of this process for the block (processes started
    inside inherit them), then restore them. ``accel.testing.patched_environ`` is this function."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def handed_settings(mixed_precision: str | None, cpu: bool | None) -> dict[str, str]:
    """``ACCEL_CONFIG`` for the processes: what is already there plus these settings, checked like any option (a
    mixed precision mode against the installed plugins')."""
    from accel.plugins import Plugins

    options = Plugins.load().options()
    try:
        handed = json.loads(os.environ.get("ACCEL_CONFIG") or "{}")
    except ValueError:
        raise UsageError("environment variable ACCEL_CONFIG is not valid JSON; unset it") from None
    if mixed_precision is not None:
        handed["mixed_precision"] = options["mixed_precision"].coerce(mixed_precision, "mixed_precision")
    if cpu is not None:
        handed["cpu"] = options["cpu"].coerce(cpu, "cpu")
    return {"ACCEL_CONFIG": json.dumps(handed, sort_keys=True)}


def preflight(num_processes: int, num_nodes: int, handed: Mapping[str, str]) -> None:
    """The launch plan ``accel launch`` makes (:mod:`accel.planning`) before starting anything, for a run of
    ``num_processes`` processes on each of ``num_nodes`` machines with the settings in ``handed``
    (``ACCEL_CONFIG``): settings, plugins and their roles and capabilities (a strategy that provides
    ``distributed``). Raises ``UsageError`` with one line."""
    from accel.planning import activate_plan, resolve_plan
    from accel.plugins import Plugins

    env = {**os.environ, **handed}
    plugins = Plugins.load(env=env)
    launched = json.loads(handed.get("ACCEL_CONFIG") or "{}")
    # the precision may come from a plugin the function's Kernel registers itself (extra_plugins): its Kernel checks it
    launched.pop("mixed_precision", None)
    flags = {"num_processes": num_processes * num_nodes, "num_machines": num_nodes}
    values, sources = resolve_plan(plugins, env, flags=flags, launched=launched)
    activate_plan(plugins, values, sources, env)


def _worker(function: Callable[..., Any], parent: int, forked: bool, *args: Any) -> Any:
    """Each launched process: die with the launching process, leave its terminal's process group (Ctrl-C goes to
    the launching process, which stops everyone), and take the signals' usual meaning back (a forked process
    inherits torch's and accel's handlers). A forked process runs torch with one intra-op thread, as torchrun's
    processes (``OMP_NUM_THREADS=1``) and DataLoader workers do: GNU OpenMP's thread pool does not survive a fork,
    and a forked process whose parent had used it hung in its first multi-threaded op."""
    if forked and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    die_with_parent(parent)
    try:
        os.setsid()
    except OSError:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return function(*args)


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = None,
    mixed_precision: str | None = "no",
    use_port: int | str | None = None,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: Mapping[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    start_method: str | None = None,
    cpu: bool | None = None,
) -> list[Any]:
    """Run ``function(*args)`` in ``num_processes`` processes on this machine and return their results, in process
    order. Create the ``Kernel()`` *inside* the function.

    - ``num_processes``: processes on this machine (default: the devices the installed plugins detect, e.g. the
      GPUs; 1 on a CPU-only machine). With 1 (and one node) the function runs in this process.
    - ``mixed_precision`` ("no", "fp16", "bf16", "fp8") and ``cpu`` reach ``Kernel()`` through ``ACCEL_CONFIG``
      (``None`` leaves them to the Kernel's usual sources).
    - ``use_port``: the rendezvous port (default: a free port on one machine, 29500 on several); ``master_addr``,
      ``node_rank``, ``num_nodes``, ``rdzv_backend`` ("static" or "c10d"), ``rdzv_endpoint``, ``rdzv_conf``,
      ``rdzv_id``, ``max_restarts``, ``monitor_interval``: as for torchrun, for runs over several machines.
    - ``start_method``: ``None`` picks ``fork`` (``spawn`` when the accelerator is already initialised in this
      process and the function can be imported); ``"fork"``/``"spawn"``/``"forkserver"`` force one.

    A failure in a process raises torch's ``ChildFailedError`` with that process's traceback. Ctrl-C stops every
    process and raises ``KeyboardInterrupt``; SIGTERM stops them and then ends this process as SIGTERM would have.
    """
    if num_processes is None:
        from accel.plugins import Plugins

        num_processes = max(1, Plugins.load().detect_hardware().device_count)
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise UsageError(f"num_processes must be a whole number >= 1, got {num_processes!r}")
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise UsageError(f"num_nodes must be a whole number >= 1, got {num_nodes!r}")
    updates = handed_settings(mixed_precision, cpu)
    if num_processes == 1 and num_nodes == 1:
        with environment(updates):
            return [function(*args)]
    preflight(num_processes, num_nodes, updates)
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if dist.is_available() and dist.is_initialized():
        raise UsageError(
            "a process group already exists in this process (a Kernel of several processes was created "
            "here?); call kernel.end_training() first, and create the Kernel inside the launched function"
        )
    method = choose_start_method(function, args, start_method, initialized_accelerator())
    port = int(use_port) if use_port not in (None, "") else (free_port() if num_nodes == 1 else 29500)
    conf = dict(rdzv_conf or {})
    if rdzv_backend == "static":
        conf.setdefault("rank", node_rank)
    # accel handles SIGINT, SIGTERM and SIGHUP (below); a torch without the field forwards them as before
    handled: dict[str, Any] = {"signals_to_handle": signals} if (signals := elastic_signals()) else {}
    total = num_processes * num_nodes
    print(f"accel: launching {total} process(es) ({num_processes} on this machine, start method {method})")

    def stop(signum: int) -> None:
        quiet_torch_elastic()
        raise SignalException(f"got {signal.Signals(signum).name}", sigval=signal.SIGTERM)

    entry = functools.update_wrapper(
        functools.partial(_worker, function, os.getpid(), method == "fork"),
        function,
        assigned=("__module__", "__name__", "__qualname__"),
        updated=(),
    )  # torch names it
    # torch's records of the run (each process's error file) go in a folder removed when the launch ends (torch
    # would leave a new torchelastic_* folder in the temp directory on every call)
    with (
        tempfile.TemporaryDirectory(prefix="accel-launch-", ignore_cleanup_errors=True) as records,
        environment(updates),
        stop_signals(stop) as request,
    ):
        config = LaunchConfig(
            logs_specs=DefaultLogsSpecs(log_dir=records),
            min_nodes=num_nodes,
            max_nodes=num_nodes,
            nproc_per_node=num_processes,
            run_id=rdzv_id,
            rdzv_endpoint=rdzv_endpoint or f"{master_addr}:{port}",
            rdzv_backend=rdzv_backend,
            rdzv_configs=conf,
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            start_method=method,
            **handled,
        )
        try:
            results = elastic_launch(config, entrypoint=entry)(*args)
        except SignalException:
            signum = request.signum or signal.SIGTERM
        except ChildFailedError as exc:
            if any(CUDA_FORK_ERROR in str(f.message) for f in exc.failures.values()):
                raise UsageError(fork_message("cuda", function)) from exc
            raise
        else:
            return [results[rank] for rank in sorted(results)]
    # the handlers from before the launch are back: give the signal its usual meaning here
    line = stopped_line(signum, f"the {num_processes} process(es)")
    if signum == signal.SIGINT:
        raise KeyboardInterrupt(line) from None
    print(line, file=sys.stderr)
    os.kill(os.getpid(), signum)
    raise SystemExit(128 + signum)  # only reached when this process has a handler of its own for the signal


def debug_launcher(function: Callable[..., Any], args: Sequence[Any] = (), num_processes: int = 2) -> list[Any]:
    """Run ``function(*args)`` in ``num_processes`` CPU processes (for debugging distributed code and for tests):
    ``notebook_launcher`` with ``cpu=True``. Returns the results in process order."""
    return notebook_launcher(function, args, num_processes=num_processes, mixed_precision=None, cpu=True)


__all__ = ["notebook_launcher", "debug_launcher", "initialized_accelerator", "choose_start_method"]
