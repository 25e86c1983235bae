"""The ``requires_plugins`` marker of accel.testing.fixtures: a plugin's test that also needs another plugin runs where
that plugin is installed and is skipped, naming it, where it is not (``make test-plugin-alone``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = """
import pytest

@pytest.mark.requires_plugins("ddp")
def test_runs():
    pass

@pytest.mark.requires_plugins("ddp", "nosuchplugin")
def test_skipped():
    raise AssertionError("must not run")
"""


def test_installed_plugins_run_missing_ones_skip_naming_them(tmp_path: Path) -> None:
    (tmp_path / "test_marked.py").write_text(TESTS)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "--strict-markers", "-p", "no:cacheprovider", "test_marked.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed, 1 skipped" in proc.stdout, proc.stdout
    assert "needs accel plugin(s) nosuchplugin installed too" in proc.stdout, proc.stdout
