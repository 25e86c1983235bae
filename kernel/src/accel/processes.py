"""Worker processes that end with their launcher, and signals that end a run with one line.

Every launcher of accel (``accel launch`` through torchrun or one plain process, DeepSpeed's runner,
``notebook_launcher``/``debug_launcher``) follows the same rules:

- **Workers die with their launcher.** Each worker asks the Linux kernel for a parent-death signal
  (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) before it runs anything, so a launcher killed with SIGKILL (alone or with
  its process group) takes its workers with it. torchrun starts each worker in a session of its own, so a signal
  to the launcher's process group never reached them: they went on training.
- **A signal ends the run with one line.** SIGINT (Ctrl-C), SIGTERM or SIGHUP to the launcher stops every worker
  with SIGTERM (quietly: Python's default action) and the launcher exits with ``128 + signal``: 130 for Ctrl-C,
  143 for SIGTERM, printing one line. A second signal while the workers are stopping kills them at once.

No torch import here (the CLI plans launches without it).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import importlib.util
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1
#: Signals that stop a run; the workers always get SIGTERM.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: The launcher's pid, for the prelude's check that the launcher is still there.
LAUNCHER_PID = "ACCEL_LAUNCHER_PID"
#: The code run in front of a worker command (``python -S -c CODE COMMAND...``): ask for SIGKILL when the parent
#: dies, give up if it already has, then become the worker (same pid, so torchrun still watches it).
PARENT_DEATH_CODE = (
    "import ctypes,os,sys;ctypes.CDLL(None).prctl(1,9);"
    f"os.getppid()==int(os.environ.get('{LAUNCHER_PID}',os.getppid())) or os._exit(137);"
    "os.execvp(sys.argv[1],sys.argv[1:])"
)


#: A folder the launcher makes for the workers to note when an exception ended them (file ``<RANK>``: the time), so
#: the failure summary names the process that failed first: torch's timestamps have whole seconds only, and a
#: process whose peer died fails in its next collective, within the same second.
FAILURE_TIMES = "ACCEL_FAILURE_TIMES"


def note_failure_time() -> None:
    """In a worker of ``accel launch``: make an uncaught exception write the time to ``$ACCEL_FAILURE_TIMES/<RANK>``
    before Python prints it (nothing happens elsewhere, or twice)."""
    folder, rank = os.environ.get(FAILURE_TIMES), os.environ.get("RANK")
    previous = sys.excepthook
    if not folder or not rank or getattr(previous, "notes_failure_time", False):
        return
    import time

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        try:
            Path(folder, rank).write_text(repr(time.time()), encoding="utf-8")
        except OSError:
            pass  # the summary then falls back to torch's order
        previous(kind, exc, tb)

    hook.notes_failure_time = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def failure_times(folder: str | None) -> dict[int, float]:
    """The times :func:`note_failure_time` wrote, by rank."""
    times: dict[int, float] = {}
    for path in Path(folder).iterdir() if folder and os.path.isdir(folder) else []:
        try:
            times[int(path.name)] = float(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
    return times


@contextmanager
def start_up_objects() -> Iterator[None]:
    """For a launcher's start-up (its plan, torch's modules): Python's cyclic garbage collector is paused in the block
    and what exists at its end is frozen out of the collector's reach (``gc.freeze``). Those objects live until the
    launcher exits, so the collector's passes over them free nothing, and with torch's modules loaded a full pass
    costs 50-90 ms of CPU: `accel launch -n 2` made three during its start-up, 0.2 s of the CPU its workers start
    on. The collector runs as usual after the block (the launcher's wait for its workers). For the launcher's own
    process only: freezing also keeps whatever garbage exists at that moment from ever being collected."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def parent_death_supported() -> bool:
    return sys.platform.startswith("linux")


def die_with_parent(parent: int | None = None) -> None:
    """Ask for SIGKILL when the parent process ends (Linux; nothing elsewhere). With ``parent``, exit at once when
    the parent already ended before the request (the signal would never come)."""
    if not parent_death_supported():
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os._exit(137)


def with_parent_death(command: Sequence[str], python: str = sys.executable) -> list[str]:
    """``command`` started through the parent-death prelude (unchanged where the platform has no prctl). The
    launcher puts its pid in ``ACCEL_LAUNCHER_PID`` of the workers' environment."""
    if not parent_death_supported():
        return list(command)
    return [python, "-S", "-c", PARENT_DEATH_CODE, *command]


def signal_name(signum: int) -> str:
    return "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name


def stopped_line(signum: int, what: str) -> str:
    """The one line a launcher prints when a signal ended the run."""
    return f"accel: stopped by {signal_name(signum)}: {what} ended (exit code {128 + signum})"


class StopRequest:
    """What a stop handler saw: the first signal (``None`` until one came)."""

    def __init__(self) -> None:
        self.signum: int | None = None


@contextmanager
def stop_signals(
    on_first: Callable[[int], None], on_again: Callable[[int], None] | None = None
) -> Iterator[StopRequest]:
    """Handle SIGINT, SIGTERM and SIGHUP for the block: the first calls ``on_first(signum)`` (which may raise),
    later ones ``on_again(signum)``. The previous handlers come back afterwards. Only in the main thread (elsewhere
    nothing is installed)."""
    import threading

    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum: int, frame: Any) -> None:
        if request.signum is None:
            request.signum = signum
            on_first(signum)
        elif on_again is not None:
            on_again(signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def quiet_torch_elastic() -> None:
    """After a stop signal: torch's agent logs a warning for every worker it stops; the one line says it all."""
    for name in [n for n in logging.Logger.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.ERROR)  # each has a level of its own (torch sets them)


def elastic_signals() -> str | None:
    """torchrun's ``--signals_to_handle``: the signals of its default list that accel does not handle itself; None
    where this torch's torchrun has no such option (torch < 2.10: its agent then forwards the signals as before)."""
    if not _torchrun_takes_signals():
        return None
    mine = {s.name for s in STOP_SIGNALS}
    return ",".join(s for s in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if s not in mine)


@functools.cache
def _torchrun_takes_signals() -> bool:
    """Whether torchrun knows ``--signals_to_handle``, read from its source (importing torch here would cost ~1 s)."""
    spec = importlib.util.find_spec("torch")
    run = Path(spec.origin).parent / "distributed" / "run.py" if spec and spec.origin else None
    return run is not None and run.is_file() and "signals_to_handle" in run.read_text(encoding="utf-8")


def run_process(argv: Sequence[str], env: Mapping[str, str], what: str = "the process") -> int:
    """Run one worker command (or a runner that starts workers) and wait: the accel rules above. Returns its exit
    code (``128 + N`` when a signal N ended it)."""
    parent = os.getpid()
    proc = subprocess.Popen(
        list(argv),
        env={**env, LAUNCHER_PID: str(parent)},
        start_new_session=True,
        preexec_fn=lambda: die_with_parent(parent) if parent_death_supported() else None,
    )

    def stop(sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    with stop_signals(lambda signum: stop(signal.SIGTERM), lambda signum: stop(signal.SIGKILL)) as request:
        code = proc.wait()
    if request.signum is not None:
        print(stopped_line(request.signum, what), file=sys.stderr)
        return 128 + request.signum
    return 128 - code if code < 0 else code


__all__ = [
    "die_with_parent",
    "with_parent_death",
    "run_process",
    "stop_signals",
    "stopped_line",
    "elastic_signals",
    "quiet_torch_elastic",
    "PARENT_DEATH_CODE",
    "note_failure_time",
    "failure_times",
    "start_up_objects",
]
