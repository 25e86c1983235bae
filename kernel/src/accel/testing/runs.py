"""Run a command whose processes start processes of their own (``accel launch``, its workers, their DataLoader
workers) and wait for all of them, with a deadline that holds.

``subprocess.run(capture_output=True, timeout=...)`` is not enough for such a tree: it reads the output through
pipes until every process holding them has closed them, so a grandchild that outlives the command (an orphaned
DataLoader worker, a stuck rank) makes the wait last past any timeout, and on a timeout it kills only the direct
child. :func:`run_tree` writes the output to files instead, marks every process of the run with an environment
variable (inherited through fork and exec), and on the deadline or after the command exits:

- asks every process of the run for its Python stacks (``SIGABRT`` with ``PYTHONFAULTHANDLER=1``: each Python
  process prints the tracebacks of all its threads to its standard error) and then kills them all;
- raises :class:`RunTimeout` (the deadline passed) or :class:`RunLeftovers` (the command exited and left processes
  running), each naming the processes and showing the end of the output, stacks included.

Linux only for the process search (``/proc``); elsewhere only the command itself is waited for and killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

#: The variable that marks the processes of one run (its value is unique per run).
RUN_MARK = "ACCEL_TEST_RUN_ID"


class RunTimeout(AssertionError):
    """The command (or a process it started) was still running at the deadline."""


class RunLeftovers(AssertionError):
    """The command exited but processes it started were still running afterwards."""


def processes_of(mark: str) -> dict[int, str]:
    """``{pid: command line}`` of the processes whose environment holds ``RUN_MARK=mark`` (Linux; else empty)."""
    needle = f"{RUN_MARK}={mark}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir() if Path("/proc/self/environ").exists() else ():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
            if state == "Z":  # exited, not yet reaped by its parent: not running
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _stop(mark: str, proc: subprocess.Popen[bytes], command: str) -> dict[int, str]:
    """Ask every process of the run for its stacks, then kill them all; the ones that were running."""
    running = processes_of(mark)
    if proc.poll() is None:
        running.setdefault(proc.pid, command)
    for pid in running:
        try:
            os.kill(pid, signal.SIGABRT)  # faulthandler prints the stacks of every thread, then the process ends
        except OSError:
            pass
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and (processes_of(mark) or proc.poll() is None):
        time.sleep(0.1)
    for pid in [*processes_of(mark), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    proc.wait()
    return running


def _tail(path: Path, chars: int) -> str:
    return path.read_text(errors="replace")[-chars:]


def run_tree(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 240,
    grace: float = 15,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` and return its exit code and output (text) once it and every process it started have ended.
    Raises :class:`RunTimeout` when anything of the run is still running after ``timeout`` seconds, and
    :class:`RunLeftovers` when processes it started outlive it by more than ``grace`` seconds (both after stopping
    them, their stacks in the message)."""
    mark = uuid.uuid4().hex
    command = " ".join(map(str, argv))
    full_env = {**env, RUN_MARK: mark, "PYTHONFAULTHANDLER": "1"}
    with tempfile.TemporaryDirectory(prefix="accel-run-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(list(argv), env=full_env, cwd=cwd, stdout=o, stderr=e, stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + timeout
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                running = _stop(mark, proc, command)
                raise RunTimeout(_report(f"still running after {timeout:.0f} s", command, running, out, err)) from None
            left_deadline = min(deadline, time.monotonic() + grace)
            while processes_of(mark) and time.monotonic() < left_deadline:
                time.sleep(0.2)
            if processes_of(mark):
                running = _stop(mark, proc, command)
                raise RunLeftovers(
                    _report(f"exited with {proc.returncode} and left processes running", command, running, out, err)
                )
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        return subprocess.CompletedProcess(list(argv), proc.returncode, stdout, stderr)


def _report(what: str, command: str, running: Mapping[int, str], out: Path, err: Path) -> str:
    listed = "\n".join(f"  pid {pid}: {cmd[:300]}" for pid, cmd in sorted(running.items()))
    return (
        f"`{command}` {what}:\n{listed}\n--- stdout (end) ---\n{_tail(out, 3000)}\n"
        f"--- stderr (end, with the stacks of those processes) ---\n{_tail(err, 12000)}"
    )


__all__ = ["RUN_MARK", "RunLeftovers", "RunTimeout", "processes_of", "run_tree"]
