"""Test helpers for plugin authors (and for accel's own plugins).

- :func:`make_kernel`: a :class:`accel.Kernel` in this process with only the plugins you name registered.
- :func:`run_launch`: run ``accel launch`` (e.g. two processes) in a subprocess, isolated from the user's config.
- :func:`isolated_env`: the environment those subprocesses get.
- :func:`run_tree`: run a command and wait for every process it starts, with a deadline that holds (stacks shown
  and everything stopped when it passes).
- pytest fixtures ``accel_env``, ``accel_kernel``, ``accel_launch`` (:mod:`accel.testing.fixtures`, registered with
  pytest automatically when accel-kernel is installed).
- :func:`accel.testing.shadow.hide_plugins`: a directory that, first on ``sys.path``/``PYTHONPATH``, hides every
  published plugin but the ones you keep, so a test sees an exact set of plugins whatever the venv has.
- Conformance suites a plugin's tests subclass, one per role (:mod:`accel.testing.conformance`):
  ``TrackerConformance``, ``StrategyConformance``, ``PrecisionConformance``, ``CompilerConformance`` and
  ``LauncherConformance``.

Importing this module does not import torch or pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from accel.distributed import free_port
from accel.launchers import environment as patched_environ
from accel.testing.runs import RunLeftovers, RunTimeout, run_tree

if TYPE_CHECKING:
    from accel.kernel import Kernel

#: Variables a launcher sets for its workers; a test's own process must not pass them on.
WORKER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
    "ACCEL_CONFIG",
)


def isolated_env(
    home: str | os.PathLike[str], registered: Iterable[str] | None = None, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """This process's environment for a subprocess, with ``ACCEL_HOME=home`` (no user config file leaks in),
    no launcher variables, and, when ``registered`` is given, ``ACCEL_PLUGINS`` set to exactly those names."""
    env = {k: v for k, v in os.environ.items() if k not in WORKER_VARIABLES and not k.startswith("SLURM_")}
    for key in [k for k in env if k.startswith(("ACCEL_", "ACCELERATE_"))]:
        del env[key]
    env["ACCEL_HOME"] = os.fspath(home)
    env.setdefault("OMP_NUM_THREADS", "1")
    if registered is not None:
        env["ACCEL_PLUGINS"] = ",".join(registered)
    env.update(extra or {})
    return env


def make_kernel(registered: Sequence[str] = (), extra: Iterable[tuple[str, Any]] = (), **kwargs: Any) -> Kernel:
    """A Kernel with only the entry-point plugins named in ``registered`` (an ``ACCEL_PLUGINS`` allow-list) plus
    the ``(name, module-or-object)`` pairs of ``extra`` registered; ``kwargs`` go to ``Kernel(...)`` (e.g.
    ``plugins=["mine"]`` to select one, ``log_with=...``). The process is treated as a single-process run
    (launcher variables are hidden while the Kernel starts). Call ``end_training()`` when done."""
    from accel.kernel import Kernel

    hidden: dict[str, str | None] = {k: None for k in WORKER_VARIABLES}
    hidden["ACCEL_PLUGINS"] = ",".join(registered)
    hidden["ACCEL_DISABLE_PLUGINS"] = None
    with patched_environ(hidden):
        return Kernel(extra_plugins=list(extra), **kwargs)


class LaunchFailed(AssertionError):
    """``accel launch`` exited with a non-zero code; the message holds the end of its output."""


def run_launch(
    args: Sequence[str],
    *,
    num_processes: int = 2,
    registered: Iterable[str] | None = None,
    home: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 240,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``accel launch --num_processes N ARGS`` (``ARGS``: launch flags, then the script or ``-m module``
    and its arguments) with :func:`isolated_env` (``registered``: the ``ACCEL_PLUGINS`` allow-list, e.g.
    ``["ddp", "mine"]``) and return the finished process (text output captured). It and every process it started
    must have ended within ``timeout`` seconds (:func:`accel.testing.runs.run_tree`: else their stacks are shown and
    they are stopped). With ``check``, a non-zero exit raises :class:`LaunchFailed` showing the output's tail."""
    command = [sys.executable, "-m", "accel.commands.launch", "--num_processes", str(num_processes), *args]
    proc = run_tree(command, env=isolated_env(home, registered, env), cwd=cwd, timeout=timeout)
    if check and proc.returncode != 0:
        tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-6000:]).strip()
        raise LaunchFailed(f"`accel launch {' '.join(map(str, args))}` exited with {proc.returncode}:\n{tail}")
    return proc


def run_accel(
    args: Sequence[str],
    *,
    home: str | os.PathLike[str],
    registered: Iterable[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run the ``accel`` command line (``accel plugins --json``, ``accel env``...) in a subprocess."""
    command = [sys.executable, "-m", "accel.commands.cli", *args]
    return subprocess.run(
        command,
        env=isolated_env(home, registered, env),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def imported_modules(module: str, watch: Iterable[str], attrs: Iterable[str] = ()) -> list[str]:
    """Import ``module`` in a fresh interpreter (and the ``"pkg.mod:Class"`` strings of its ``accel_components``
    list, as ``accel plugins`` does) and return which of the ``watch`` modules got imported along the way."""
    code = (
        "import importlib, json, sys\n"
        f"m = importlib.import_module({module!r})\n"
        "for spec in getattr(m, 'accel_components', ()):\n"
        "    mod, _, cls = spec.partition(':')\n"
        "    getattr(importlib.import_module(mod), cls)\n"
        f"print(json.dumps([w for w in {list(watch)!r} if w in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    import json

    return list(json.loads(out.stdout.strip().splitlines()[-1]))


__all__ = [
    "LaunchFailed",
    "RunLeftovers",
    "RunTimeout",
    "run_tree",
    "free_port",
    "imported_modules",
    "isolated_env",
    "make_kernel",
    "patched_environ",
    "run_accel",
    "run_launch",
]
