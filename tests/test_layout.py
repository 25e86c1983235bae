"""Where the tests live: kernel/tests, plugins/<name>/tests, tests/. ``pytest`` from the repository root
runs every folder (pyproject.toml ``testpaths``), and the folders' module names never collide (pytest's default import
mode puts each test module's folder on ``sys.path``, so two ``test_x.py`` would be one module)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
#: Tested in their own venvs (their own torch: `make test-xla`, `make test-ipex`), not from the root; but the module
#: of each that tests the plugin in the main venv (its conftest.py's MAIN_VENV, left out in the plugin's own venv).
OWN_VENV = {"plugins/xla/tests", "plugins/ipex/tests"}
MAIN_VENV = {"plugins/xla/tests/test_xla_plugin.py", "plugins/ipex/tests/test_ipex_plugin.py"}


def test_testpaths_name_every_test_folder() -> None:
    testpaths = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    folders = {str(p.relative_to(ROOT)) for p in [*ROOT.glob("plugins/*/tests"), *ROOT.glob("compat/*/tests")]}
    folders -= OWN_VENV
    assert all((ROOT / path).is_file() for path in MAIN_VENV)
    assert sorted(testpaths) == sorted({"kernel/tests", "tests", *folders, *MAIN_VENV})


def test_module_names_are_unique_across_folders() -> None:
    folders = [
        ROOT / "kernel" / "tests",
        ROOT / "tests",
        ROOT / "tests" / "compat",
        *ROOT.glob("plugins/*/tests"),
        *ROOT.glob("compat/*/tests"),
    ]
    names = Counter(p.name for folder in folders for p in folder.glob("*.py") if p.name != "conftest.py")
    assert [name for name, n in names.items() if n > 1] == []


def test_relayout_has_nothing_left_to_do() -> None:
    """tools/relayout.py moved the modules; a module added under its old path would be left behind."""
    proc = subprocess.run([sys.executable, "tools/relayout.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
