"""accel.forksafe: a DataLoader worker forked right after a collective must not hang on CPython < 3.11.8
(CPython gh-112275: the child takes the interpreter's thread-list lock, which a gloo thread may hold)."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest
from clitools import launch_env

from accel import forksafe
from accel.testing import run_tree

SCRIPT = Path(__file__).parent / "scripts" / "fork_after_collective.py"
ACCEL = Path(sys.executable).parent / "accel"
LINUX64 = sys.platform.startswith("linux") and ctypes.sizeof(ctypes.c_void_p) == 8


def test_installed_exactly_on_the_affected_releases() -> None:
    assert forksafe.AFFECTED == ((3, 11) <= sys.version_info[:3] < (3, 11, 8))
    assert forksafe.install() == (forksafe.AFFECTED and LINUX64)
    assert forksafe.install() == (forksafe.AFFECTED and LINUX64)  # once: a second call adds no second hook


@pytest.mark.skipif(not (forksafe.AFFECTED and LINUX64), reason="only CPython 3.11.0-3.11.7 on 64-bit Linux")
def test_the_wait_reads_a_cpython_lock_taken_and_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a lock of CPython's own kind (``PyThread_allocate_lock``; HEAD_LOCK itself is never taken here: a lock
    held across a GIL hand-over is the deadlock the first version of the hook made)."""
    head = forksafe._head_lock()
    assert head is not None and not forksafe._held(head)
    api = ctypes.pythonapi
    api.PyThread_allocate_lock.restype = ctypes.c_void_p
    api.PyThread_acquire_lock.argtypes, api.PyThread_acquire_lock.restype = (
        [ctypes.c_void_p, ctypes.c_int],
        ctypes.c_int,
    )
    api.PyThread_release_lock.argtypes = api.PyThread_free_lock.argtypes = [ctypes.c_void_p]
    lock = api.PyThread_allocate_lock()
    try:
        assert not forksafe._held(lock) and forksafe._wait_until_free(lock)
        assert api.PyThread_acquire_lock(lock, 0) == 1
        monkeypatch.setattr(forksafe, "MAX_WAIT", 0.05)
        assert forksafe._held(lock) and not forksafe._wait_until_free(lock)  # gives up after MAX_WAIT, says so
        api.PyThread_release_lock(lock)
        assert not forksafe._held(lock) and forksafe._wait_until_free(lock)
    finally:
        api.PyThread_free_lock(lock)


@pytest.mark.multiprocess
def test_dataloader_workers_forked_right_after_collectives_start(tmp_path: Path) -> None:
    """150 rounds of allreduce + all_gather, each followed at once by a 2-worker DataLoader pass, on 2 processes.
    Without the hook (``--unguarded``) such a run hung in about half the runs here (docs/design.md has the count);
    with it none did."""
    proc = run_tree([str(ACCEL), "launch", "-q", "-n", "2", str(SCRIPT), "150"], env=launch_env(tmp_path), timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(line.split()[:3] for line in proc.stdout.splitlines() if " done " in line) == [
        ["0", "done", "150"],
        ["1", "done", "150"],
    ], proc.stdout
