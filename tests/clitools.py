"""Helpers for the CLI, config and plugin tests: run ``accel`` as a real subprocess in an isolated environment, and
install the example plugin packages of ``tests/plugin_pkgs`` for real with pip."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dstools import EXTENSIONS, deepspeed_env  # noqa: F401  (plugins/deepspeed/tests, see conftest.py)

from accel.testing import isolated_env, run_tree

TESTS = Path(__file__).resolve().parent
PKGS = TESTS / "plugin_pkgs"
BIN = Path(sys.executable).parent
ACCEL = str(BIN / "accel")

#: The example plugins installed together (a working one next to broken ones, to show they stay isolated).
GOOD_AND_BROKEN = ("hello", "broken_import", "misspelt", "leaky")


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def err_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]

    def __str__(self) -> str:  # shown by pytest when an assert fails
        return f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def clean_env(home: Path, hide: bool = True, **extra: str) -> dict[str, str]:
    """The caller's environment without accel's variables, with every config lookup place inside ``home``, and
    every published plugin but ddp hidden (``accel.testing.shadow``), so the tests see the same plugins whatever this venv
    has installed: ddp, plus what the test puts on ``PYTHONPATH`` (kept after the hiding directory). ``hide=False``
    keeps every plugin of this venv visible."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ACCEL_", "ACCELERATE_")) and k not in ("PYTHONPATH", "XDG_CACHE_HOME")
    }
    (home / "accel_home").mkdir(parents=True, exist_ok=True)
    env.update(ACCEL_HOME=str(home / "accel_home"), HOME=str(home / "user"), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra)
    paths = [str(hidden_plugins())] if hide else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [extra.get("PYTHONPATH")])])
    return env


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its reaper counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read
        return False


def launch_env(tmp_path: Path) -> dict[str, str]:
    """The caller's environment for a test's own ``accel launch``: a private ``ACCEL_HOME`` and none of the variables
    a surrounding launcher would have set (every plugin of this venv stays visible)."""
    return isolated_env(tmp_path / "home")


@functools.cache
def hidden_plugins() -> Path:
    from accel.testing.shadow import hide_plugins

    return hide_plugins(_ROOT / "hidden", keep=("ddp",))


def run(
    args: list[str],
    env: dict[str, str],
    cwd: Path | None = None,
    timeout: float = 240,
    python_m: str | None = None,
    python_flags: tuple[str, ...] = (),
) -> Result:
    """Run ``accel ARGS`` (or ``python -m MODULE ARGS``) and capture its output."""
    if python_m is not None:
        cmd = [sys.executable, *python_flags, "-m", python_m, *args]
    elif python_flags:
        cmd = [sys.executable, *python_flags, ACCEL, *args]
    else:
        cmd = [ACCEL, *args]
    proc = run_tree(cmd, env=env, cwd=cwd, timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


_ROOT = Path(tempfile.mkdtemp(prefix="accel-plugin-pkgs-"))
atexit.register(shutil.rmtree, _ROOT, True)


@functools.cache
def install(*packages: str, source: Path = PKGS) -> Path:
    """``pip install --target`` the given directories of ``source`` (default ``tests/plugin_pkgs``; copied first, so
    the build writes nothing into the repository) and return the target directory, for ``PYTHONPATH``. Once per
    session."""
    target = _ROOT / source.name / "-".join(packages)
    src = _ROOT / f"src-{source.name}"
    if not src.exists():
        shutil.copytree(source, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--disable-pip-version-check",
        "--target",
        str(target),
        *(str(src / p) for p in packages),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target


def pythonpath(*targets: Path) -> str:
    return os.pathsep.join(str(t) for t in targets)


def run_plugin_tests(python: str | Path, project: Path, env: Mapping[str, str], *pytest_args: str) -> str:
    """Run a plugin project's own tests (``pytest tests`` in ``project``) with ``python``; they must all pass, none
    skipped. Returns pytest's output."""
    tests = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, "tests"],
        cwd=project,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert tests.returncode == 0, tests.stdout[-5000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and "skipped" not in tests.stdout, tests.stdout[-2000:]
    return tests.stdout
