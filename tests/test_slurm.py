"""accel under a real Slurm: munge, slurmctld and slurmd started on this machine (127.0.0.1, free ports, state in
pytest's tmp dir), jobs submitted with ``sbatch`` and ``srun`` as a user of a cluster would.

Debian's packages (``make setup-slurm``: slurmctld, slurmd, slurm-client, munge) must be installed; without them the
tests are skipped, except under CI (``CI=true``), where a missing Slurm is a failure: CI installs it.
The batch scripts are the ones docs/slurm.md shows.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "sinfo")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _find(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for d in ("/usr/sbin", "/sbin") if os.access(p := f"{d}/{name}", os.X_OK)), None
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    """A one-node Slurm cluster; ``env`` is what a user's shell on it has (``SLURM_CONF``, the test venv's PATH)."""

    root: Path
    env: dict[str, str]

    def run(self, *cmd: str, timeout: float = 60) -> str:
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}"
        return out.stdout

    def sbatch(self, script: str) -> str:
        path = self.root / f"job{time.monotonic_ns()}.sh"
        path.write_text(script)
        return self.run("sbatch", "--parsable", str(path)).strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        fields = self.run("scontrol", "show", "job", "-o", job_id).split()
        return dict(f.split("=", 1) for f in fields if "=" in f)

    def wait(self, job_id: str, timeout: float = 240) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"):
                return info
            time.sleep(0.5)
        self.run("scancel", job_id)
        raise AssertionError(f"job {job_id} still {info['JobState']} after {timeout} s")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    missing = [n for n in DAEMONS + CLIENTS if _find(n) is None]
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Slurm is not installed ({', '.join(missing)} missing): CI runs `make setup-slurm` first")
        pytest.skip(f"Slurm not installed ({', '.join(missing)} missing): run `make setup-slurm` (as root)")
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "log", "munge"):
        (root / sub).mkdir()
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    # munged refuses a socket whose directories are not searchable by all; pytest's tmp dirs, and the session's temp
    # directory among them (conftest.py), are private (0700): the socket's folder is the system's, removed at the end
    sockdir = Path(tempfile.mkdtemp(prefix="accel-munge-", dir="/tmp"))
    sockdir.chmod(0o755)
    sock = sockdir / "munge.sock"
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    # cred_expire: how long a requeued job waits before it may start again (default 120 s, the whole of the requeue
    # test's time before this was set; `scontrol update StartTime=now` does not shorten it)
    conf.write_text(f"""ClusterName=accel-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={sock},cred_expire=20
CryptoType=crypto/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 2} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ACCEL_", "ACCELERATE_"))}
    env.update(
        SLURM_CONF=str(conf),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        ACCEL_HOME=str(root / "home"),
        PYTHONUNBUFFERED="1",
    )
    daemons = [
        subprocess.Popen(
            [
                _find("munged") or "munged",
                "-F",
                f"--key-file={key}",
                f"--socket={sock}",
                f"--pid-file={root}/munge/munged.pid",
                f"--log-file={root}/munge/munged.log",
                f"--seed-file={root}/munge/seed",
            ],
            env=env,
        )
    ]
    for _ in range(100):
        if sock.exists() or daemons[0].poll() is not None:
            break
        time.sleep(0.1)
    assert sock.exists(), f"munged did not start: see {root}/munge/munged.log"
    daemons += [
        subprocess.Popen(
            [_find(d) or d, "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for d in ("slurmctld", "slurmd")
    ]
    cl = Cluster(root, env)
    try:
        deadline = time.monotonic() + 60
        while "idle" not in (
            state := subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout
        ):
            dead = [p.args[0] for p in daemons if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, (
                f"the node never became idle (sinfo: {state.strip()!r}, exited: {dead}); see {root}/log"
            )
            time.sleep(0.5)
        yield cl
    finally:
        for p in reversed(daemons):
            p.terminate()
        for p in daemons:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(sockdir, ignore_errors=True)


def test_srun_two_tasks_train(cluster: Cluster, tmp_path: Path) -> None:
    """``srun python train.py`` with two tasks and no launcher: the strategy plugin turns SLURM_PROCID/NTASKS/LOCALID/
    JOB_NODELIST into the torch.distributed world; the digits example trains on 2 processes."""
    out = tmp_path / "job.out"
    job = cluster.sbatch(f"""#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --output={out}
export MASTER_PORT={free_port()}
cd {ROOT}
srun python examples/train_digits.py --epochs 1
""")
    info = cluster.wait(job)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED", text
    assert "epoch 0: accuracy" in text and "(2 processes)" in text, text
    accuracy = float(text.split("accuracy ")[1].split()[0])
    assert accuracy > 0.5, text


def test_accel_launch_in_job_two_tasks(cluster: Cluster, tmp_path: Path) -> None:
    """Accelerate's multi-node Slurm recipe: one ``accel launch`` per task (here 2 tasks stand for 2 machines), c10d
    rendezvous at the first node's address; 2 processes in all."""
    out = tmp_path / "job.out"
    job = cluster.sbatch(f"""#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --ntasks-per-node=2
#SBATCH --output={out}
cd {ROOT}
srun accel launch --num_machines $SLURM_NTASKS --num_processes $SLURM_NTASKS --rdzv_backend c10d \\
    --main_process_ip 127.0.0.1 --main_process_port {free_port()} --mixed_precision no --dynamo_backend no \\
    examples/train_digits.py --epochs 1
""")
    info = cluster.wait(job)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED", text
    lines = [line for line in text.splitlines() if line.startswith("epoch 0: accuracy")]
    # kernel.print prints on each machine's local main process (as Accelerate's): one line per task, same result
    assert len(lines) == 2 and lines[0] == lines[1] and "(2 processes)" in lines[0], text


def test_requeue_resumes_from_last_checkpoint(cluster: Cluster, tmp_path: Path) -> None:
    """``scontrol requeue`` stops a running job and starts its batch script again: the example finds its newest
    checkpoint, continues with the next epoch, and finishes; no epoch before the checkpoint is trained twice."""
    out, project, epochs = tmp_path / "job.out", tmp_path / "project", 8
    job = cluster.sbatch(f"""#!/bin/bash
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={out}
echo "start restart=${{SLURM_RESTART_COUNT:-0}}"
cd {ROOT}
accel launch -n 2 --mixed_precision no --dynamo_backend no examples/train_digits.py --epochs {epochs} \\
    --project_dir {project}
echo "exit $?"
""")
    deadline = time.monotonic() + 240
    while not list((project / "checkpoints").glob("checkpoint_*")):
        assert time.monotonic() < deadline and cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), (
            out.read_text() if out.exists() else "no output"
        )
        time.sleep(0.2)
    # a requeued job waits cred_expire (+1 s) before it starts again: 120 s by default, 20 s in this cluster's conf
    cluster.run("scontrol", "requeue", job)
    info = cluster.wait(job)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text
    first, _, second = text.partition("start restart=1")
    assert second, text
    resumed = [line for line in second.splitlines() if line.startswith("resumed from checkpoint_")]
    assert len(resumed) == 1, text
    next_epoch = int(resumed[0].rsplit("epoch ", 1)[1].split()[0])
    trained_before = {int(line.split()[1].rstrip(":")) for line in first.splitlines() if line.startswith("epoch ")}
    trained_after = [int(line.split()[1].rstrip(":")) for line in second.splitlines() if line.startswith("epoch ")]
    assert next_epoch >= 1 and next_epoch - 1 in trained_before, text
    assert trained_after == list(range(next_epoch, epochs)), text
    assert second.rstrip().endswith("exit 0"), text
