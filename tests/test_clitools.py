"""The tests' own process helpers, against real processes: a process that ends while it is being looked at is
ended, never an error (CI once failed on exactly that race in ``tests/test_signals.py``)."""

from __future__ import annotations

import subprocess
import sys

import clitools
import pytest
from clitools import alive


def test_a_running_process_is_alive_and_a_reaped_one_is_not() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not alive(proc.pid)


def test_a_process_that_ends_between_open_and_read_is_not_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    opened = open(f"/proc/{proc.pid}/stat")  # noqa: SIM115 - read after the process is gone, as in the race
    proc.kill()
    proc.wait()
    with pytest.raises(ProcessLookupError):  # what Linux does: the open file of a reaped process cannot be read
        opened.read()
    monkeypatch.setattr(clitools, "open", lambda *args, **kwargs: opened, raising=False)
    assert not alive(proc.pid)
