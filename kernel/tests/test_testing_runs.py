"""accel.testing.run_tree: a run's deadline holds even when processes it started outlive it or hang, and the
failure shows where each process was (its Python stacks)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from accel.testing import RunLeftovers, RunTimeout, run_tree
from accel.testing.runs import processes_of

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds a run's processes in /proc")

#: A child that says when it is inside ``{name}`` (it creates the file named by its parent's argument) and then waits
#: there. A parent waits for that file, so the child's stack is where the test looks for it even when a loaded machine
#: takes seconds to start a Python (a signal that comes before faulthandler is set up prints no stack at all).
CHILD = "import sys, time\\ndef {name}():\\n    open(sys.argv[1], 'w').close()\\n    time.sleep(600)\\n{name}()"
WAIT_FOR_CHILD = """
import os, subprocess, sys, time
ready = sys.argv[1]
child = subprocess.Popen([sys.executable, "-S", "-c", "{code}", ready])
while not os.path.exists(ready):
    time.sleep(0.05)
"""

#: Starts a grandchild that keeps the standard streams open and outlives its parent (an orphaned worker).
ORPHAN = WAIT_FOR_CHILD.format(code=CHILD.format(name="orphaned_worker")) + 'print("parent done", flush=True)\n'

#: A process whose child waits forever (a stuck rank).
STUCK = WAIT_FOR_CHILD.format(code=CHILD.format(name="waiting_in_collective")) + "child.wait()\n"


def test_output_and_exit_code_of_a_finished_run() -> None:
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    proc = run_tree([sys.executable, "-c", code], env=dict(os.environ), timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out\n", "err\n")


def test_a_process_left_running_fails_the_run_and_is_stopped(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(RunLeftovers) as info:
        run_tree([sys.executable, "-c", ORPHAN, str(tmp_path / "ready")], env=dict(os.environ), timeout=60, grace=2)
    assert time.monotonic() - started < 30  # not the orphan's 600 s (subprocess.run would wait for its pipes)
    message = str(info.value)
    assert "exited with 0 and left processes running" in message and "orphaned_worker" in message
    assert "parent done" in message
    assert "in orphaned_worker" in message  # its stack, from faulthandler
    assert not [cmd for cmd in processes_of_any() if "orphaned_worker" in cmd]  # stopped, not left behind


def test_a_hung_run_fails_at_its_deadline_with_the_stacks(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(RunTimeout) as info:
        run_tree([sys.executable, "-c", STUCK, str(tmp_path / "ready")], env=dict(os.environ), timeout=10)
    assert time.monotonic() - started < 40
    message = str(info.value)
    assert "still running after 10 s" in message
    assert "in waiting_in_collective" in message
    assert not [cmd for cmd in processes_of_any() if "waiting_in_collective" in cmd]


def processes_of_any() -> list[str]:
    """Command lines of this machine's processes that run the snippets above."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                found.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
    return found


def test_processes_of_an_unknown_mark_is_empty() -> None:
    assert processes_of("no-such-run") == {}
