"""Signals and launcher death, with real processes: every launcher (``accel launch`` through torchrun, the
one-process launcher, ``debug_launcher`` from a plain script) ends its workers when it is killed with SIGKILL (alone
or with its process group), and Ctrl-C / SIGTERM end a run with exit code 130 / 143 and one line on stderr."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from clitools import ACCEL, TESTS, alive, clean_env

from accel.distributed import free_port

LONG = str(TESTS / "scripts" / "long_train.py")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def wait_for_pids(piddir: Path, count: int, launcher: subprocess.Popen[str], timeout: float = 180) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(piddir.glob("rank*.pid"))
        if len(files) == count and all(f.read_text() for f in files):
            time.sleep(0.5)  # every worker is in its training loop
            return [int(f.read_text()) for f in files]
        if launcher.poll() is not None:
            raise AssertionError(f"the launcher ended early: {launcher.communicate()}")
        time.sleep(0.2)
    launcher.kill()
    raise AssertionError(f"the workers did not start: {launcher.communicate()}")


# How long the workers may take to end once their launcher did: they end at once (a signal, or the parent-death
# signal), but on a loaded machine (the suite on several xdist workers beside other work) a process can wait seconds
# for a CPU; the wait returns as soon as they are gone, so a wide bound costs nothing when the test passes.
GONE = 20


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still running after ``seconds`` (killed afterwards, so nothing outlives the test)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended after the last look
            pass
    return left


def drain(proc: subprocess.Popen[str]) -> str:
    """What the launcher wrote on stderr so far (the workers' start-up warnings), so that a test sees only what
    came after its signal."""
    fd = proc.stderr.fileno()  # type: ignore[union-attr]
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    finally:
        os.set_blocking(fd, True)
    return b"".join(chunks).decode(errors="replace")


def start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """A launcher in a process group of its own, as a shell starts a job."""
    return subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def accel_launch(tmp_path: Path, processes: int) -> tuple[subprocess.Popen[str], Path]:
    env = clean_env(tmp_path)
    piddir = tmp_path / "pids"
    args = [
        ACCEL,
        "launch",
        "-q",
        "--cpu",
        "-n",
        str(processes),
        "--main_process_port",
        str(free_port()),
        LONG,
        str(piddir),
    ]
    return start(args, env), piddir


SENDS = {
    "ctrl-c": (lambda proc: os.killpg(proc.pid, signal.SIGINT), 130, "stopped by Ctrl-C (SIGINT)"),
    "sigterm": (lambda proc: proc.send_signal(signal.SIGTERM), 143, "stopped by SIGTERM"),
}


@pytest.mark.parametrize("processes", [2, 1], ids=["torchrun-2", "one-process"])
@pytest.mark.parametrize("how", list(SENDS))
def test_accel_launch_signal_ends_the_run_with_one_line(tmp_path, how, processes):
    send, code, words = SENDS[how]
    launcher, piddir = accel_launch(tmp_path, processes)
    pids = wait_for_pids(piddir, processes, launcher)
    drain(launcher)  # start-up output of the workers
    send(launcher)
    out, err = launcher.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert launcher.returncode == code, err
    assert len(lines) == 1 and words in lines[0] and f"(exit code {code})" in lines[0], err
    assert gone_within(pids, GONE) == []


@pytest.mark.parametrize("processes", [2, 1], ids=["torchrun-2", "one-process"])
@pytest.mark.parametrize("group", [False, True], ids=["launcher", "process-group"])
def test_workers_die_with_a_killed_launcher(tmp_path, group, processes):
    launcher, piddir = accel_launch(tmp_path, processes)
    pids = wait_for_pids(piddir, processes, launcher)
    if group:
        os.killpg(launcher.pid, signal.SIGKILL)
    else:
        launcher.kill()
    launcher.communicate(timeout=30)
    assert gone_within(pids, GONE) == [], "workers still running after their launcher was killed"


DEBUG_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import accel

    def train(piddir):
        from accel import Kernel
        kernel = Kernel()
        Path(piddir, f"rank{kernel.process_index}.pid").write_text(str(os.getpid()))
        while True:
            time.sleep(0.05)

    if __name__ == "__main__":
        Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
        accel.debug_launcher(train, args=(sys.argv[1],), num_processes=2)
""")


def debug_launch(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    script = tmp_path / "debug_run.py"
    script.write_text(DEBUG_SCRIPT)
    env = clean_env(tmp_path, ACCEL_PLUGINS="ddp")
    piddir = tmp_path / "pids"
    return start([sys.executable, str(script), str(piddir)], env), piddir


def test_debug_launcher_ctrl_c(tmp_path):
    launcher, piddir = debug_launch(tmp_path)
    pids = wait_for_pids(piddir, 2, launcher)
    drain(launcher)
    os.killpg(launcher.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == -signal.SIGINT, err  # Python's exit for an uncaught KeyboardInterrupt (130)
    assert err.count("Traceback") == 1 and "[rank" not in err, err  # the caller's KeyboardInterrupt, no worker's
    assert err.strip().splitlines()[-1] == (
        "KeyboardInterrupt: accel: stopped by Ctrl-C (SIGINT): the 2 process(es) ended (exit code 130)"
    ), err
    assert gone_within(pids, GONE) == []


def test_debug_launcher_sigterm(tmp_path):
    launcher, piddir = debug_launch(tmp_path)
    pids = wait_for_pids(piddir, 2, launcher)
    drain(launcher)
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == -signal.SIGTERM, err  # ended by SIGTERM as without accel (143 in a shell)
    assert [line for line in err.splitlines() if line.strip()] == [
        "accel: stopped by SIGTERM: the 2 process(es) ended (exit code 143)"
    ], err
    assert gone_within(pids, GONE) == []


@pytest.mark.parametrize("group", [False, True], ids=["launcher", "process-group"])
def test_debug_launcher_workers_die_with_a_killed_launcher(tmp_path, group):
    launcher, piddir = debug_launch(tmp_path)
    pids = wait_for_pids(piddir, 2, launcher)
    if group:
        os.killpg(launcher.pid, signal.SIGKILL)
    else:
        launcher.kill()
    launcher.communicate(timeout=30)
    assert gone_within(pids, GONE) == []


ROOT = TESTS.parent
EXTENSIONS = os.environ.get("TORCH_EXTENSIONS_DIR") or str(ROOT / ".cache" / "torch_extensions")


@pytest.mark.timeout(900)  # the first DeepSpeed process group of a clean workspace compiles an op
@pytest.mark.parametrize("how", ["ctrl-c", "kill-9-process-group"])
def test_deepspeed_launch_signals(tmp_path, how):
    """DeepSpeed's launch (torchrun on one machine): Ctrl-C is one line and 130; kill -9 takes the workers along."""
    env = clean_env(tmp_path, hide=False, TORCH_EXTENSIONS_DIR=EXTENSIONS)
    piddir = tmp_path / "pids"
    args = [
        ACCEL,
        "launch",
        "-q",
        "--cpu",
        "--use_deepspeed",
        "--zero_stage",
        "2",
        "-n",
        "2",
        "--main_process_port",
        str(free_port()),
        LONG,
        str(piddir),
    ]
    launcher = start(args, env)
    pids = wait_for_pids(piddir, 2, launcher, timeout=840)
    if how == "ctrl-c":
        drain(launcher)  # DeepSpeed's own warnings while starting and training
        os.killpg(launcher.pid, signal.SIGINT)
        out, err = launcher.communicate(timeout=60)
        lines = [line for line in err.splitlines() if line.strip()]
        assert launcher.returncode == 130 and len(lines) == 1 and "stopped by Ctrl-C" in lines[0], err
    else:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.communicate(timeout=30)
    assert gone_within(pids, GONE) == []
