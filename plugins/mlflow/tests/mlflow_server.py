"""A real MLflow tracking server for the tests: ``mlflow server`` on 127.0.0.1 (free port), sqlite backend,
proxied artifacts, one worker.

The plugin only needs the mlflow-skinny client; the server needs full ``mlflow`` (SQLAlchemy, alembic, Flask...),
about 850 MB. It is installed once into its own virtual environment, ``<repo>/.venv-mlflow-server`` (ignored by
git), so the test environment keeps only what the plugin declares. ``ACCEL_TEST_MLFLOW`` may name an existing
``mlflow`` executable instead.

A new sqlite store costs the server about as long to create (its tables, by ``mlflow db upgrade``) as everything
else of its start together; so an empty, created store is kept in the server environment (``TEMPLATE``, made once
with the environment) and each session starts from a copy of it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from accel.testing import free_port

REPO = Path(__file__).resolve().parents[3]
VENV = REPO / ".venv-mlflow-server"
TEMPLATE = VENV / "accel-empty-store.db"


def server_executable() -> Path:
    """The ``mlflow`` command of the server environment, installing it on first use."""
    given = os.environ.get("ACCEL_TEST_MLFLOW")
    if given:
        return Path(given)
    exe = VENV / "bin" / "mlflow"
    with open(Path(tempfile.gettempdir()) / "accel-mlflow-server.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test sessions must not install at once
        if not exe.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
            subprocess.run(
                [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", "mlflow>=3,<4"], check=True, timeout=900
            )
        if not TEMPLATE.exists():
            part = TEMPLATE.with_suffix(".part")
            part.unlink(missing_ok=True)
            subprocess.run(
                [str(exe), "db", "upgrade", f"sqlite:///{part}"], check=True, capture_output=True, timeout=300
            )
            part.rename(TEMPLATE)
    return exe


def _healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def running_server(workdir: Path, timeout: float = 120) -> Iterator[str]:
    """Start the server, wait until ``/health`` answers, yield its URI; stop it afterwards."""
    exe = server_executable()
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    workdir.mkdir(parents=True, exist_ok=True)
    if not os.environ.get("ACCEL_TEST_MLFLOW"):  # a given server's schema may differ from the template's
        shutil.copyfile(TEMPLATE, workdir / "mlflow.db")
    log = open(workdir / "server.log", "w")
    proc = subprocess.Popen(
        [
            str(exe),
            "server",
            "--backend-store-uri",
            f"sqlite:///{workdir / 'mlflow.db'}",
            "--artifacts-destination",
            str(workdir / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        cwd=workdir,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # no background job workers
    )
    try:
        deadline = time.monotonic() + timeout
        while not _healthy(uri):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                raise RuntimeError(f"mlflow server did not start: {(workdir / 'server.log').read_text()[-3000:]}")
            time.sleep(0.25)
        yield uri
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


if __name__ == "__main__":  # `make setup-mlflow-server`: install the server environment ahead of the tests
    print(server_executable())
