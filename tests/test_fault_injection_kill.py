"""Fault injection: SIGKILL during synchronous and asynchronous saves, on 1 and 2 processes (DDP, gloo).

`tests/scripts/ckpt_crash.py` saves automatic checkpoints in a loop (total_limit=2); before each save every parameter
and momentum buffer is set to the step number. A trial starts it (resuming from the newest complete checkpoint,
which the script checks holds one single step), waits for a first save, then sends SIGKILL at a random moment to
one rank, or to every process of the run at once (the launcher and each worker: torchrun starts each worker in a
session of its own). Afterwards:

- every visible ``checkpoint_<i>`` is complete (its manifest lists exactly the files present, with their sizes);
- the next trial (and a final ``--check`` run that trains one step) resumes from the newest complete checkpoint,
  holding one single step, at least the last save known to be published: for a synchronous save, the last one that
  returned; for an asynchronous one, the one before it (a ``save_state`` returns once the previous one is published);
- nothing hangs: after a kill the run ends within 90 s.

Each trial prints what it tried and what survived. Killing ``accel launch`` alone is tested with the launcher
(workers must die with it); here the launcher is killed together with its workers.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from warm_python import WarmChild, WarmPython

from accel.checkpoint import numbered_checkpoints, read_manifest

SCRIPT = Path(__file__).parent / "scripts" / "ckpt_crash.py"
ACCEL = Path(sys.executable).parent / "accel"

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def run_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, ACCEL_HOME=str(tmp_path / "home"))
    for name in ("ACCEL_CONFIG", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCEL_ASYNC_SAVE"):
        env.pop(name, None)
    return env


class Run:
    """One start of ckpt_crash.py (1 process, or ``accel launch -n 2 --plugin ddp``), its output read as it comes."""

    def __init__(
        self,
        tmp_path: Path,
        project: Path,
        nprocs: int,
        asynchronous: bool,
        check: bool = False,
        warm: WarmPython | None = None,
        overlap: bool = False,
    ):
        env = run_env(tmp_path)
        if overlap:  # the async_save_overlap option (ckpt_crash.py then steps its optimizer before changing weights)
            env["ACCEL_ASYNC_SAVE_OVERLAP"] = "1"
        cmd = [sys.executable, str(SCRIPT), str(project)]
        if nprocs > 1:
            cmd = [str(ACCEL), "launch", "-q", "-n", str(nprocs), "--plugin", "ddp", *cmd[1:]]
        cmd += ["--async"] * asynchronous + ["--check"] * check
        self.nprocs = nprocs
        self.proc: subprocess.Popen[str] | WarmChild
        if warm is not None:  # one process: forked from the warm Python (a session of its own too)
            self.proc = warm.popen(cmd[1:], env=env, cwd=tmp_path)
        else:
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        self.lines: list[str] = []
        self.err: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True).start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            into.append(line.rstrip("\n"))

    def values(self, word: str) -> list[int]:
        # the processes share one pipe: a line of one may be glued to another's (seen: "pid 1 14126pid 0 14127")
        return [int(v) for v in re.findall(rf"{word} (\d+)", "\n".join(list(self.lines)))]

    def pids(self) -> dict[int, int]:
        return {int(rank): int(pid) for rank, pid in re.findall(r"pid (\d+) (\d+)", "\n".join(list(self.lines)))}

    def wait_for(self, condition, timeout: float = 180) -> None:  # type: ignore[no-untyped-def]
        end = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None and not condition():
                time.sleep(0.5)  # let the readers catch up
                if condition():
                    return
                raise AssertionError(
                    f"run ended ({self.proc.returncode}) early:\n"
                    + "\n".join(self.lines[-20:])
                    + "\n"
                    + "\n".join(self.err[-40:])
                )
            if time.monotonic() > end:
                self.kill_all()
                raise AssertionError(
                    "timed out waiting:\n" + "\n".join(self.lines[-20:]) + "\n" + "\n".join(self.err[-40:])
                )
            time.sleep(0.02)

    def kill(self, victim: str) -> None:
        pids = self.pids()
        if victim == "all":
            targets = [self.proc.pid, *pids.values()]
        else:
            targets = [pids[int(victim.removeprefix("rank "))]]
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill_all(self) -> None:
        for pid in [self.proc.pid, *self.pids().values()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def end(self, timeout: float = 90) -> tuple[int | None, bool]:
        """(exit status, whether it hung) after a kill; leftovers are killed either way."""
        try:
            rc = self.proc.wait(timeout=timeout)
            hung = False
        except subprocess.TimeoutExpired:
            rc, hung = None, True
        self.kill_all()
        self.proc.wait(timeout=30)
        time.sleep(0.3)
        return rc, hung


def visible(project: Path) -> tuple[list[str], list[str]]:
    folder = project / "checkpoints"
    if not folder.is_dir():
        return [], []
    complete = []
    for _, path in numbered_checkpoints(folder):
        read_manifest(path)  # complete: exactly the listed files with their sizes, or this raises
        complete.append(path.name)
    hidden = sorted(p.name for p in folder.iterdir() if p.name.startswith("."))
    return complete, hidden


def kill_trials(
    tmp_path: Path, nprocs: int, asynchronous: bool, victims: list[str], seed: int, overlap: bool = False
) -> None:
    rng = random.Random(seed)
    project = tmp_path / "proj"
    # one process: each run is forked from a Python that imported torch once (tests/warm_python.py); two: accel launch
    warm = WarmPython(tmp_path / "warm", run_env(tmp_path)) if nprocs == 1 else None
    try:
        _trials(tmp_path, project, nprocs, asynchronous, victims, rng, warm, overlap)
    finally:
        if warm is not None:
            warm.close()


def _trials(
    tmp_path: Path,
    project: Path,
    nprocs: int,
    asynchronous: bool,
    victims: list[str],
    rng: random.Random,
    warm: WarmPython | None,
    overlap: bool = False,
) -> None:
    mode = ("asynchronous, overlapped copy" if overlap else "asynchronous") if asynchronous else "synchronous"
    confirmed = 0  # the newest step whose checkpoint is known to be published
    inside = 0
    hangs = []
    for trial, victim in enumerate(victims):
        run = Run(tmp_path, project, nprocs, asynchronous, warm=warm, overlap=overlap)
        run.wait_for(lambda run=run: len(run.values("resumed")) >= nprocs and len(run.pids()) >= nprocs)
        resumed = min(run.values("resumed"))
        assert resumed >= confirmed, f"trial {trial}: resumed from step {resumed}, but step {confirmed} was published"
        run.wait_for(lambda run=run: len(run.values("saved")) >= nprocs)
        delay = rng.uniform(0.0, 0.8)
        time.sleep(delay)
        saved_before = max(run.values("saved"))
        run.kill(victim)
        rc, hung = run.end()
        saved = max(run.values("saved"))
        if hung:
            hangs.append(trial)
        complete, hidden = visible(project)
        inside += bool(hidden)
        # published for sure: the last save that returned (synchronous), the one before it (asynchronous)
        confirmed = max(confirmed, saved - 1 if asynchronous else saved)
        print(
            f"[{nprocs} process(es), {mode} save] trial {trial}: resumed from step {resumed}; SIGKILL to {victim} "
            f"{delay:.2f} s after the first save (last save returned before the kill: step {saved_before}, at the "
            f"end: {saved}); run ended with {rc}{' after HANGING 90 s' if hung else ''}; visible: {complete} "
            f"(all complete), hidden leftovers: {hidden or 'none'}"
        )
    final = Run(tmp_path, project, nprocs, asynchronous, check=True, warm=warm, overlap=overlap)
    rc = final.proc.wait(timeout=300)
    time.sleep(0.5)
    assert rc == 0, "\n".join(final.lines[-20:] + final.err[-40:])
    resumed = min(final.values("resumed"))
    print(
        f"[{nprocs} process(es), {mode} save] final: resumed from step {resumed} (published for sure: {confirmed}), "
        f"trained one step; {inside}/{len(victims)} kills left a hidden temporary/set-aside directory (landed "
        "inside a save)"
    )
    assert resumed >= confirmed
    assert not hangs, f"trials {hangs} hung after the kill"
    assert inside >= 1, "no kill landed inside a save; the test did not test anything"


def test_kill_9_one_process_sync_save(tmp_path: Path) -> None:
    kill_trials(tmp_path, 1, False, ["rank 0"] * 5, seed=1)


def test_kill_9_one_process_async_save(tmp_path: Path) -> None:
    kill_trials(tmp_path, 1, True, ["rank 0"] * 5, seed=2)


@pytest.mark.timeout(1200)
def test_kill_9_two_processes_sync_save(tmp_path: Path) -> None:
    kill_trials(tmp_path, 2, False, ["rank 0", "rank 1", "all"], seed=3)


@pytest.mark.timeout(1200)
def test_kill_9_two_processes_async_save(tmp_path: Path) -> None:
    kill_trials(tmp_path, 2, True, ["rank 0", "rank 1", "all"], seed=4)


def test_kill_9_one_process_async_save_with_overlapped_copy(tmp_path: Path) -> None:
    # async_save_overlap: the parameters' and momentum's copy is made by the background thread while the script
    # goes on; the next optimizer step waits for it, and only then does the script change them
    kill_trials(tmp_path, 1, True, ["rank 0"] * 5, seed=5, overlap=True)
