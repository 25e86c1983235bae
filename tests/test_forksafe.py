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
def test_the_wait_sees_the_lock_taken_and_free(monkeypatch: pytest.MonkeyPatch) -> None:
    lock = forksafe._head_lock()
    assert lock is not None
    assert forksafe._wait_until_free(lock)
    acquire, release = ctypes.pythonapi.PyThread_acquire_lock, ctypes.pythonapi.PyThread_release_lock
    acquire.argtypes, release.argtypes = [ctypes.c_void_p, ctypes.c_int], [ctypes.c_void_p]
    monkeypatch.setattr(forksafe, "MAX_WAIT", 0.05)
    assert acquire(lock, 0)  # held here (nothing in between may start a thread): the wait gives up, says so
    try:
        held = forksafe._wait_until_free(lock)
    finally:
        release(lock)
    assert not held
    assert forksafe._wait_until_free(lock)


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
