"""These tests need torch 2.8.* with intel-extension-for-pytorch 2.8.* (``make test-ipex`` builds ``.venv-ipex``).
In any other environment they stop at once with that reason instead of failing one by one; but ``MAIN_VENV``: the
plugin in the main venv (torch 2.13, where IPEX cannot load), which ``make test`` runs (pyproject.toml's testpaths
name it) and which is left out where IPEX loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from accel_ipex import accel_unavailable_reason

HERE = Path(__file__).resolve().parent
#: Modules for the main venv (``make test``), not for ``.venv-ipex``.
MAIN_VENV = ["test_ipex_plugin.py"]
REASON = accel_unavailable_reason()
collect_ignore = [] if REASON else MAIN_VENV


def asks_for_ipex_tests(config: pytest.Config) -> bool:
    """Whether the command line names this folder, a folder above it, or a module here other than ``MAIN_VENV``."""
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if HERE.is_relative_to(path) or (path.is_relative_to(HERE) and path.name not in MAIN_VENV):
            return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    if REASON and asks_for_ipex_tests(config):
        raise pytest.UsageError(f"plugins/ipex/tests need a torch that matches IPEX (run `make test-ipex`): {REASON}")
