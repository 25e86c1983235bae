"""``accel new-plugin --kind tracker|strategy|precision|compiler|launcher``: the projects it writes install with pip
into a fresh environment (each kind once), show up in ``accel plugins`` and pass their own tests (accel's
conformance suites) out of the box; the precision template's mode works by name. The command's input checks and
the templates' rendering are in kernel/tests/test_commands_new_plugin.py."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest
from clitools import run_plugin_tests

from accel.commands.new_plugin import KINDS
from accel.testing import isolated_env, run_accel


def accel_cli(args: list[str], tmp_path: Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "accel.commands.cli", *args],
        env=isolated_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtual environment that sees this one's packages (torch, accel, pytest) through a .pth file, so a
    plugin installed into it leaves the test environment untouched."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    here = sysconfig.get_paths()["purelib"]
    Path(purelib, "_accel_test_parent.pth").write_text(f"import site; site.addsitedir({here!r})\n")
    return python


@pytest.fixture(scope="module")
def installed(fresh_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``installed(kind)``: the project ``accel new-plugin tmpl_KIND --kind KIND`` wrote, pip-installed (editable)
    into ``fresh_env``; each kind once per test session."""
    projects: dict[str, Path] = {}

    def install(kind: str) -> Path:
        if kind not in projects:
            root = tmp_path_factory.mktemp(kind)
            project = root / "project"
            made = accel_cli(["new-plugin", f"tmpl_{kind}", "--kind", kind, "--directory", str(project)], root)
            assert made.returncode == 0, made.stderr
            subprocess.run(
                [str(fresh_env), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(project)],
                check=True,
                env=isolated_env(root / "home"),
                timeout=300,
                capture_output=True,
            )
            projects[kind] = project
        return projects[kind]

    return install


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_new_plugin_installs_is_listed_and_passes_its_own_tests(
    kind: str, tmp_path: Path, fresh_env: Path, installed: Callable[[str], Path]
) -> None:
    name = f"tmpl_{kind}"
    project = installed(kind)
    env = isolated_env(tmp_path / "home")
    listed = subprocess.run(
        [str(fresh_env), "-m", "accel.commands.cli", "plugins", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    assert rows[name]["status"] == "active" and rows[name]["distribution"] == f"accel-plugin-tmpl-{kind}"
    assert name not in {r["name"] for r in json.loads(run_accel(["plugins", "--json"], home=tmp_path).stdout)}
    run_plugin_tests(fresh_env, project, env)


MODE_SCRIPT = """
import json, sys

import torch

from accel import Kernel

kernel = Kernel(**json.loads(sys.argv[1]))
assert [c.name for c in kernel.components if c.role == "precision"] == ["tmpl_precision"], kernel.components
net = torch.nn.Linear(4, 2)
seen = []
net.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
model = kernel.prepare(net)
out = model(torch.randn(3, 4, device=kernel.device))
assert seen == [torch.float16] and out.dtype == torch.float32, (seen, out.dtype)
print("mode", kernel.mixed_precision)
kernel.end_training()
"""

MODE_SUITE = """
from typing import Any

from test_tmpl_precision import TestTmplPrecisionConformance


class TestTheModeByName(TestTmplPrecisionConformance):
    def kernel_kwargs(self) -> dict[str, Any]:
        return {"mixed_precision": "tmpl_precision"}
"""


@pytest.mark.slow
def test_the_precision_template_adds_a_mode(tmp_path: Path, fresh_env: Path, installed: Callable[[str], Path]) -> None:
    """The generated precision plugin's mode works as Kernel(mixed_precision=...), as accel launch
    --mixed_precision ..., and passes the precision suite when chosen by that mode."""
    project = installed("precision")
    env = isolated_env(tmp_path / "home", registered=["tmpl_precision"])
    (tmp_path / "train.py").write_text(MODE_SCRIPT)

    def run(*args: str) -> str:
        proc = subprocess.run(
            [str(fresh_env), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    assert "mode tmpl_precision" in run("train.py", json.dumps({"mixed_precision": "tmpl_precision"}))
    launched = run("-m", "accel.commands.launch", "--quiet", "--mixed_precision", "tmpl_precision", "train.py", "{}")
    assert "mode tmpl_precision" in launched
    (project / "tests" / "test_mode_by_name.py").write_text(MODE_SUITE)
    suite = run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(project / "tests" / "test_mode_by_name.py"))
    assert " passed" in suite and "failed" not in suite, suite[-3000:]
