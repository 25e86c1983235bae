"""Whether torch_xla can run in this environment, found out without importing torch or torch_xla here.

A torch-xla wheel only loads with the torch release it was built against (torch-xla 2.9.0 with torch 2.9.x); pip
installs it next to any torch because its metadata does not name torch. So: not installed -> say how to install it;
installed for the same major.minor as torch -> assume it loads (cheap: package metadata only); otherwise really try
``import torch_xla`` in a child interpreter (a failed import can leave half-initialised modules or crash, and the CLI
must not import torch) and report its exact error with the torch version that would fix it.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import importlib.util
import os
import subprocess
import sys

#: The pair the plugin is tested with (``make test-xla``).
TESTED = ("2.9.0", "2.9.0")  # (torch, torch-xla)
PROBE_TIMEOUT = 180.0


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def release(version: str) -> str:
    """``"2.9"`` from ``"2.9.0+cu128"``."""
    return ".".join(version.split("+", 1)[0].split(".")[:2])


def install_advice(torch_version: str | None) -> str:
    torch_part = f"you have torch {torch_version}; " if torch_version else ""
    return (
        f"{torch_part}torch-xla only loads with the torch release it was built for: install both together, e.g. "
        f"`pip install torch=={TESTED[0]} torch-xla=={TESTED[1]}` (add torch-xla[tpu] on a TPU VM)"
    )


@functools.cache
def unavailable_reason() -> str | None:
    """``None`` when torch_xla should load here; otherwise one line: why not, and how to fix it."""
    torch_version = _version("torch")
    if importlib.util.find_spec("torch_xla") is None:
        return f"torch_xla is not installed; {install_advice(torch_version)}"
    xla_version = _version("torch-xla") or _version("torch_xla")
    if torch_version and xla_version and release(torch_version) == release(xla_version):
        return None
    error = probe_import()
    if error is None:
        return None
    want = release(xla_version) if xla_version else "?"
    fix = (
        f"torch-xla {xla_version} is built for torch {want} and this environment has torch {torch_version}: "
        f"install the matching torch (`pip install torch=={xla_version.split('+')[0]}`), or a torch-xla built for "
        f"torch {release(torch_version)} if one exists"
        if xla_version and torch_version
        else install_advice(torch_version)
    )
    return f"torch_xla cannot be imported: {error}; {fix}"


def probe_import() -> str | None:
    """Import torch_xla in a child interpreter; ``None`` if that works, else the last line of its error."""
    code = "import torch_xla"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT,
            env={**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")},
        )
    except subprocess.TimeoutExpired:
        return f"`{code}` did not finish within {PROBE_TIMEOUT:g} s"
    if proc.returncode == 0:
        return None
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "Error:" in line or "Error " in line.split(":", 1)[0]]
    last = errors[-1] if errors else (lines[-1] if lines else f"exit code {proc.returncode}")
    return last
