"""A warm Python for tests that start the same script many times (the kill -9 trials): one server process imports
torch and accel once, then forks a fresh child for each run of a script, so a run costs a fork instead of a Python
start-up and torch's import, with what torch imports on an optimizer's construction (torch._dynamo): 2-3 s on
the 2-core machine, 10-15 s when it is loaded.

The child is a real process of its own (its own pid, killable with SIGKILL at any moment, its own files): it runs the
script as ``python SCRIPT ARGS`` would (``runpy`` as ``__main__``, ``sys.argv``, the environment and working
directory asked for), with stdout and stderr on FIFOs the test reads. :meth:`WarmPython.popen` returns an object
with the part of ``subprocess.Popen``'s interface the tests use (``pid``, ``stdout``, ``stderr``, ``poll``,
``wait``, ``communicate``, ``send_signal``, ``returncode``). One child runs at a time.

Not for tests whose subject is a fresh interpreter (exact resume of random states: every child starts from the
server's Python random and hash seeds) or whose environment matters at torch's import time (the server's counts).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

# The server: reads one JSON request per line, forks, reports "pid <pid>", waits and reports "exit <pid> <status>".
SERVER = r"""
import json, os, runpy, sys
import torch, accel  # the point: imported once, before the forks
# and what torch imports on first use: an optimizer's construction imports torch._dynamo (6 of a loaded machine's
# 8 s from a fresh process to ckpt_crash.py's first save); no tensor op runs here (no thread pool before the fork)
torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the run: as `python SCRIPT ARGS` from here on, its exit (atexit, threads, traceback) included
        os.setsid()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(os.open(req["stdout"], os.O_WRONLY), 1)
        os.dup2(os.open(req["stderr"], os.O_WRONLY), 2)
        sys.stdout.reconfigure(line_buffering=True)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.argv = req["argv"]
        sys.path[0] = os.path.dirname(os.path.abspath(req["argv"][0]))
        runpy.run_path(req["argv"][0], run_name="__main__")
        raise SystemExit(0)
    print("pid", pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print("exit", pid, os.waitstatus_to_exitcode(status), flush=True)
"""


class WarmChild:
    """One forked run, read like a ``subprocess.Popen`` with ``text=True`` and piped stdout/stderr."""

    def __init__(self, server: WarmPython, pid: int, stdout: IO[str], stderr: IO[str]) -> None:
        self._server = server
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"warm child {self.pid}", timeout or 0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both streams to their end, then the exit. stderr is read beside stdout: a child (an `accel launch` and
        its workers) that fills the stderr FIFO while stdout is being read would otherwise block for ever."""
        err: list[str] = []
        reader = threading.Thread(target=lambda: err.append(self.stderr.read()), daemon=True)
        reader.start()
        out = self.stdout.read()
        reader.join()
        self.wait(timeout)
        return out, err[0]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmPython:
    """The server process (start it with the environment the runs need at import time: ``OMP_NUM_THREADS``...)."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=workdir,
        )
        self.exits: dict[int, int] = {}
        self._pids: list[int] = []
        self._lock = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self._runs = 0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            word, *rest = line.split()
            with self._lock:
                if word == "pid":
                    self._pids.append(int(rest[0]))
                elif word == "exit":
                    self.exits[int(rest[0])] = int(rest[1])
                self._lock.notify_all()

    def popen(self, argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 300) -> WarmChild:
        """Run ``python *argv`` (``argv[0]`` the script) in a fresh fork."""
        if self._pids and self._pids[-1] not in self.exits:
            raise RuntimeError("WarmPython runs one child at a time; wait for the last one first")
        self._runs += 1
        fifos = [self.workdir / f"run{self._runs}.{name}" for name in ("out", "err")]
        for fifo in fifos:
            os.mkfifo(fifo)
        request: dict[str, Any] = {
            "argv": [str(a) for a in argv],
            "env": env,
            "cwd": str(cwd),
            "stdout": str(fifos[0]),
            "stderr": str(fifos[1]),
        }
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        # the child opens stdout then stderr for writing; opening for reading in the same order pairs them up
        stdout = open(fifos[0])  # noqa: SIM115 (closed by close())
        stderr = open(fifos[1])  # noqa: SIM115
        end = time.monotonic() + timeout
        with self._lock:
            while len(self._pids) < self._runs:
                if self.proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"the warm Python server is gone (exit {self.proc.returncode})")
                self._lock.wait(0.1)
            pid = self._pids[-1]
        return WarmChild(self, pid, stdout, stderr)

    def close(self) -> None:
        for pid in self._pids:
            if pid not in self.exits:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> WarmPython:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
