"""The suite's warm workers (tests/warm_workers, CONTRIBUTING.md "Warm workers in the test suite") must be invisible
to what a test checks: a worker forked from the warm server sees what a cold one sees (argv, ``__main__``,
``sys.path``, environment, working directory, umask, streams, signal handlers, /proc/PID/cmdline and environ, a
traceback without the server's frames, the exit code), and a launcher killed with SIGKILL takes its forked processes with it.

Each test runs real ``accel launch`` processes with a warm-workers folder of its own: the first launch of an
environment runs cold, the second starts the server, the third is forked from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from clitools import ACCEL, alive, clean_env

pytestmark = [pytest.mark.multiprocess]

if not any((Path(p) / "zz_accel_warm_workers.pth").exists() for p in sys.path if p):
    pytest.skip("this venv has no warm-workers hook (make setup installs it)", allow_module_level=True)

FACTS = r"""
import json, os, signal, sys, tempfile, threading
facts = {
    "argv": sys.argv, "file": __file__, "name": __name__, "spec": __spec__ and __spec__.name,
    "loader": type(__loader__).__name__, "globals": sorted(globals()), "path": sys.path, "cwd": os.getcwd(),
    "var": os.environ.get("FACT_VAR"), "umask": os.umask(0o022), "flags": repr(sys.flags),
    "tmp": tempfile.gettempdir(), "stdin": sys.stdin is None,
    "streams": [(s.encoding, s.errors, s.line_buffering, s.write_through) for s in (sys.stdout, sys.stderr)],
    "sigint": repr(signal.getsignal(signal.SIGINT)), "sigterm": repr(signal.getsignal(signal.SIGTERM)),
    "threads": threading.active_count(), "rank": os.environ.get("RANK"),
    "cmdline": open("/proc/self/cmdline", "rb").read().decode().replace(sys.argv[1], "OUT").split("\0"),
    "environ": sorted(e.partition("=")[0] for e in open("/proc/self/environ", "rb").read().decode().split("\0")),
    "environ_var": [e for e in open("/proc/self/environ", "rb").read().decode().split("\0") if "FACT_VAR" in e],
}
warm = "warm_zygote" in sys.modules
path = os.path.join(sys.argv[1], f"facts{os.environ.get('RANK', '0')}")
with open(path + ".tmp", "w") as f:
    json.dump({"facts": facts, "warm": warm}, f)
os.replace(path + ".tmp", path + ".json")  # whole, or not there: the launcher may stop rank 0 once rank 1 failed
if os.environ.get("RANK") == "1":
    import time
    deadline = time.monotonic() + 120  # rank 0 may start later (cold, on a busy machine): fail once it has written
    while not os.path.exists(os.path.join(sys.argv[1], "facts0.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    def deeper():
        raise ValueError("rank 1 fails on purpose")
    deeper()
"""


def launch(
    tmp: Path,
    env: dict[str, str],
    run: int,
    target: tuple[str, ...] = ("facts.py",),
    launcher: tuple[str, ...] = (ACCEL, "launch"),
    processes: int = 2,
) -> tuple[subprocess.CompletedProcess[str], dict[str, dict]]:
    out = tmp / f"run{run}"
    out.mkdir()
    proc = subprocess.run(
        [*launcher, "-q", "-n", str(processes), *target, str(out)],
        cwd=tmp / "work",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, {p.stem: json.loads(p.read_text()) for p in out.glob("facts*.json")}


def traceback_of(stderr: str) -> list[str]:
    """The uncaught exception's lines: from "Traceback" to the exception's own line."""
    lines = stderr.splitlines()
    start = lines.index("Traceback (most recent call last):")
    end = next(i for i, line in enumerate(lines) if line.startswith("ValueError:"))
    return lines[start : end + 1]


def wait_for_servers(folder: Path) -> None:
    """Until every server a launch started (``KEY.starting``) listens (``KEY.sock``)."""
    deadline = time.monotonic() + 120
    while any(not p.with_suffix(".sock").exists() for p in folder.glob("*.starting")) and time.monotonic() < deadline:
        time.sleep(0.2)


def summary(stderr: str) -> str:
    return re.sub(r" \(\d+ more failed after it\)", "", stderr.splitlines()[-1])


def facts_workspace(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """``work/facts.py``, a temporary folder and a warm-workers folder of the test's own; the launches' environment."""
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "facts.py").write_text(FACTS)
    (tmp_path / "tmp").mkdir()
    folder = tmp_path / "warm"
    folder.mkdir()
    env = clean_env(tmp_path / "home", hide=False, FACT_VAR="x y", TMPDIR=str(tmp_path / "tmp"))
    env.update(WARM_WORKERS_DIR=str(folder), WARM_WORKERS_OWNER=str(os.getpid()))
    return folder, env


@contextlib.contextmanager
def servers_stopped(folder: Path) -> Iterator[None]:
    """Stop the servers the block's launches started (SIGTERM), however the block ends."""
    try:
        yield
    finally:
        for pid_file in folder.glob("*.pid"):
            os.kill(int(pid_file.read_text()), signal.SIGTERM)


def test_a_warm_worker_sees_what_a_cold_one_sees(tmp_path: Path) -> None:
    folder, env = facts_workspace(tmp_path)
    env["PYTHONPATH"] = str(tmp_path / "work")  # facts.py runs as a script, and as a module (-m facts)
    runs = []
    with servers_stopped(folder):
        for run in range(3):
            runs.append(launch(tmp_path, env, run))
            if run == 1:  # the second launch started the servers: wait until they listen
                wait_for_servers(folder)
        # and `python -m`: cold (turned off for this launch), then forked (the same servers)
        runs.append(launch(tmp_path, {**env, "WARM_WORKERS": "0"}, 3, ("-m", "facts")))
        runs.append(launch(tmp_path, env, 4, ("-m", "facts")))
    for (cold, cold_facts), (warm, warm_facts) in ((runs[0], runs[2]), (runs[3], runs[4])):
        assert [f["warm"] for f in cold_facts.values()] == [False, False], cold
        logs = {p.name: p.read_text() for p in folder.glob("*.log")}  # a server that serves nobody says why
        assert [f["warm"] for f in warm_facts.values()] == [True, True], (warm, logs)
        for rank in ("facts0", "facts1"):
            c, w = cold_facts[rank]["facts"], warm_facts[rank]["facts"]
            c["argv"][1] = w["argv"][1] = "OUT"
            c["environ"] = [k for k in c["environ"] if k != "WARM_WORKERS"]  # the cold module launch's switch
            assert w == c
        assert cold.returncode == warm.returncode == 1
        assert traceback_of(warm.stderr) == traceback_of(cold.stderr)
        assert "rank 1 fails on purpose" in warm.stderr and "warm_zygote" not in warm.stderr
        # accel's summary line; "(1 more failed after it)" only says whether rank 0 was still running when rank 1
        # failed (then torchrun stops it), which is timing, not warm or cold
        assert summary(cold.stderr) == summary(warm.stderr)
        assert "process 1 of 2 exited with code 1" in summary(warm.stderr)


def test_one_process_launches_and_python_m_accel_commands_launch_are_forked_too(tmp_path: Path) -> None:
    """The one process of `accel launch -n 1` (no torchrun: accel launch starts it, with ACCEL_CONFIG) and accel
    launch run as `python -m accel.commands.launch` (as accel.testing's launch helpers run it) are served too."""
    folder, env = facts_workspace(tmp_path)
    as_module = (sys.executable, "-m", "accel.commands.launch")
    runs = []
    with servers_stopped(folder):
        for run in range(3):
            runs.append(launch(tmp_path, env, run, launcher=as_module, processes=1))
            if run == 1:
                wait_for_servers(folder)
    (cold, cold_facts), (warm, warm_facts) = runs[0], runs[2]
    assert cold.returncode == warm.returncode == 0, (cold.stderr, warm.stderr)
    logs = "".join(p.read_text() for p in folder.glob("*.log"))
    assert [f["warm"] for f in cold_facts.values()] == [False], cold
    assert [f["warm"] for f in warm_facts.values()] == [True], (warm, logs)
    c, w = cold_facts["facts0"]["facts"], warm_facts["facts0"]["facts"]
    c["argv"][1] = w["argv"][1] = "OUT"
    assert w == c
    served = [json.loads(line.partition(": ")[2]) for line in logs.splitlines() if line.startswith("run ")]
    assert sorted(served) == [
        ["-m", "-q", "-n", "1", "facts.py", str(tmp_path / "run2")],
        ["facts.py", str(tmp_path / "run2")],
    ], logs


LONG = r"""
import os, sys, time
with open(os.path.join(sys.argv[1], "tmp%d" % os.getpid()), "w") as f:
    f.write(str(os.getppid()))
os.rename(os.path.join(sys.argv[1], "tmp%d" % os.getpid()), os.path.join(sys.argv[1], f"{os.getpid()}.pid"))
time.sleep(600)
"""


def test_a_killed_launcher_takes_its_warm_processes_with_it(tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "long.py").write_text(LONG)
    folder = tmp_path / "warm"
    folder.mkdir()
    env = clean_env(tmp_path / "home", hide=False)
    env.update(WARM_WORKERS_DIR=str(folder), WARM_WORKERS_OWNER=str(os.getpid()))
    pids: list[int] = []
    with servers_stopped(folder):
        try:
            for run in range(3):
                out = tmp_path / f"run{run}"
                out.mkdir()
                proc = subprocess.Popen(
                    [ACCEL, "launch", "-q", "-n", "2", "long.py", str(out)],
                    cwd=tmp_path / "work",
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
                deadline = time.monotonic() + 120
                while len(list(out.glob("*.pid"))) < 2 and time.monotonic() < deadline:
                    time.sleep(0.1)
                parents = {int(p.stem): int(p.read_text() or 0) for p in out.glob("*.pid")}
                pids = list(parents)
                assert len(pids) == 2, f"the workers of launch {run} did not start"
                proc.kill()
                proc.wait()
                deadline = time.monotonic() + 20
                while any(alive(p) for p in pids) and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert not [p for p in pids if alive(p)], f"launch {run}: workers outlived their killed launcher"
                if run == 1:
                    wait_for_servers(folder)
            servers = {int(p.read_text()) for p in folder.glob("*.pid")}
            assert len(servers) == 2, list(folder.iterdir())  # one for launchers, one for workers
            assert set(parents.values()) < servers  # the last launch's workers were forked by a server
        finally:
            for pid in pids:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("argv", "served"),
    [
        (["python", "/venv/bin/accel", "launch", "-n", "2", "train.py"], True),
        (["python", "-m", "accel.commands.launch", "-n", "2", "train.py"], True),
        (["python", "-m", "accel.commands.cli", "launch", "--config_file", "c.yaml", "train.py"], True),
        (["python", "-m", "accel.commands.cli", "launch", "--dry-run", "train.py"], False),
        (["python", "-m", "accel.commands.cli", "config", "--config_file", "c.yaml"], False),
        (["python", "-m", "accel.commands.launch", "--help"], False),
    ],
)
def test_which_command_lines_are_accel_launch(argv: list[str], served: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Which launchers the hook forks warm: `python -m accel.commands.cli launch` (tests/test_config_tree.py launches
    its written files that way) is accel launch too; a dry run, its help and other commands are not."""
    import importlib.util

    monkeypatch.delenv("WARM_WORKERS_DIR", raising=False)  # loading the client must not act on this process
    spec = importlib.util.spec_from_file_location("warm_client", Path(__file__).parent / "warm_workers" / "client.py")
    assert spec is not None and spec.loader is not None
    client = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(client)
    command = client.script_command(argv)
    assert command is not None
    assert client._launcher(command) is served
