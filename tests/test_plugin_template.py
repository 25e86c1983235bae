"""``accel new-plugin --kind tracker|strategy|precision|compiler|launcher``: the templates render, import from
accel only the plugin API, install with pip into a fresh environment (each kind once), show up in ``accel plugins``
and pass their own tests (accel's conformance suites) out of the box; the precision template's mode works by name."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest
from clitools import run_plugin_tests

from accel.commands.new_plugin import KINDS, render
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


def test_new_plugin_refuses_bad_input_and_overwrites_nothing(tmp_path: Path) -> None:
    bad = accel_cli(["new-plugin", "My-Plugin"], tmp_path, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "must start with a lowercase letter" in bad.stderr
    kind = accel_cli(["new-plugin", "ok", "--kind", "optimizer"], tmp_path, cwd=tmp_path)
    assert (
        kind.returncode == 2 and "--kind must be one of tracker, strategy, precision, compiler, launcher" in kind.stderr
    )
    target = tmp_path / "taken"
    target.mkdir()
    (target / "mine.txt").write_text("keep me")
    taken = accel_cli(["new-plugin", "ok", "--directory", str(target)], tmp_path)
    assert taken.returncode == 2 and "already exists and is not empty" in taken.stderr
    assert [p.name for p in target.iterdir()] == ["mine.txt"] and (target / "mine.txt").read_text() == "keep me"
    assert not (tmp_path / "accel-plugin-ok").exists()
    for name, needle in [
        ("ddp", "plugin name 'ddp' is taken by the installed plugin 'ddp' (accel-plugin-ddp)"),
        ("x" * 300, "plugin name is 300 characters long; use at most 64"),
    ]:
        refused = accel_cli(["new-plugin", name], tmp_path, cwd=tmp_path)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and needle in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr and list(tmp_path.glob("accel-plugin-*")) == []


def test_accel_help_names_every_kind_new_plugin_writes(tmp_path: Path) -> None:
    proc = accel_cli(["--help"], tmp_path)
    line = next(line for line in proc.stdout.splitlines() if line.strip().startswith("new-plugin"))
    assert all(kind in line for kind in KINDS), line


@pytest.mark.parametrize("kind", KINDS)
def test_templates_render_to_valid_python(kind: str) -> None:
    files = render("my_thing", kind)
    assert set(files) == {
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "src/accel_my_thing/__init__.py",
        f"src/accel_my_thing/{kind}.py",
        "tests/test_my_thing.py",
    }
    assert 'my_thing = "accel_my_thing"' in files["pyproject.toml"]
    assert 'name = "accel-plugin-my-thing"' in files["pyproject.toml"]
    for path, text in files.items():
        if path.endswith(".py"):
            compile(text, path, "exec")
            assert "${" not in text
            if path.startswith("src/"):  # a plugin imports from accel only the plugin API
                imported = set(re.findall(r"^\s*(?:from|import) (accel[\w.]*)", text, re.M))
                assert imported <= {"accel.spi", "accel_my_thing", "accel_my_thing." + kind}, (path, imported)


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
