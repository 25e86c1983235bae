"""Forking beside torch.distributed's threads on CPython before 3.11.8 (CPython gh-112275).

A child made by ``os.fork`` (every DataLoader worker) takes the interpreter's thread-list lock (``HEAD_LOCK``) in
``PyOS_AfterFork_Child`` before CPython 3.11.8 re-creates that lock. If another thread of the parent held it at the
moment of the fork, the child waits for it forever, before any of its own code runs. torch.distributed's threads
take it without the GIL: a gloo thread that finishes a collective releases the tensors the collective held, and
entering Python for that creates a thread state (``PyThreadState_New``). So a DataLoader whose workers start right
after a collective (an epoch that begins after ``gather_for_metrics``, an allreduce) left a worker hung now and then,
more often on a loaded machine (CI saw it in 2 of ~1,400 tests; a 2-process loop of allreduce, all_gather and a
2-worker DataLoader hung in 4 of 7 runs of 150 rounds, and in none of 6 runs of 600 rounds with the hook).

:func:`install` adds an ``os.register_at_fork(before=...)`` hook on the affected versions: before each fork it
waits until that lock is free (reading the semaphore behind it, never taking it; the GIL released between
reads, so the thread holding it finishes), then lets the fork go on. Python 3.11.8 and later, and 3.12, re-create
the lock first and need none.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import time
from typing import Any

#: CPython 3.11 releases that take the lock before re-creating it (3.11.8 fixed it)
AFFECTED = (3, 11) <= sys.version_info[:3] < (3, 11, 8)
#: ``offsetof(_PyRuntimeState, interpreters.mutex)`` in CPython 3.11 on 64-bit Linux (five ints, then a pointer;
#: checked with gdb on 3.11.7)
_MUTEX_OFFSET = 32
#: the longest a fork waits for the lock (a thread holds it for microseconds; past this the fork goes on as before)
MAX_WAIT = 2.0

_installed = False


@functools.cache
def _sem_getvalue() -> Any:
    """libc's ``sem_getvalue(sem_t *, int *)``."""
    function = ctypes.CDLL(None).sem_getvalue
    function.argtypes, function.restype = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)], ctypes.c_int
    return function


def _head_lock() -> int | None:
    """The address of CPython's ``HEAD_LOCK`` (``_PyRuntime.interpreters.mutex``), or None where unknown."""
    if not (AFFECTED and sys.platform.startswith("linux") and ctypes.sizeof(ctypes.c_void_p) == 8):
        return None
    try:
        runtime = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
    except (ValueError, AttributeError):
        return None
    lock = ctypes.c_void_p.from_address(runtime + _MUTEX_OFFSET).value
    return lock or None


def _held(lock: int) -> bool:
    """Whether a thread holds ``lock`` (a CPython lock is a POSIX semaphore on Linux: 1 free, 0 held). Read with
    ``sem_getvalue``, never taken: a lock taken here could be held across a GIL hand-over, and a thread that holds
    the GIL and waits for this lock (one deleting its thread state) would then wait forever."""
    value = ctypes.c_int(1)
    _sem_getvalue()(lock, ctypes.byref(value))
    return value.value <= 0


def _wait_until_free(lock: int) -> bool:
    """Wait (at most :data:`MAX_WAIT` s) until no thread holds ``lock``; whether it was free."""
    deadline = time.monotonic() + MAX_WAIT
    while _held(lock):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.0005)  # releases the GIL: the thread holding the lock goes on and gives it back
    return True


def install() -> bool:
    """Add the before-fork hook once, on the affected CPython releases; whether it is (now) installed."""
    global _installed
    if _installed:
        return True
    lock = _head_lock()
    if lock is None:
        return False
    _sem_getvalue()  # looked up now, not in the middle of a fork
    os.register_at_fork(before=lambda: _wait_until_free(lock))
    _installed = True
    return True
