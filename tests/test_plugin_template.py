"""``accel new-plugin``: the templates render, install with pip into a fresh environment, show up in
``accel plugins`` and pass their own tests (accel's conformance suites) out of the box."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from clitools import run_plugin_tests

from accel.commands.new_plugin import render
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
    kind = accel_cli(["new-plugin", "ok", "--kind", "compiler"], tmp_path, cwd=tmp_path)
    assert kind.returncode == 2 and "--kind must be one of tracker, strategy" in kind.stderr
    target = tmp_path / "taken"
    target.mkdir()
    (target / "mine.txt").write_text("keep me")
    taken = accel_cli(["new-plugin", "ok", "--directory", str(target)], tmp_path)
    assert taken.returncode == 2 and "already exists and is not empty" in taken.stderr
    assert [p.name for p in target.iterdir()] == ["mine.txt"] and (target / "mine.txt").read_text() == "keep me"
    assert not (tmp_path / "accel-plugin-ok").exists()


@pytest.mark.parametrize("kind", ["tracker", "strategy"])
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


@pytest.fixture
def fresh_env(tmp_path: Path) -> Path:
    """A new virtual environment that sees this one's packages (torch, accel, pytest) through a .pth file, so a
    plugin installed into it leaves the test environment untouched."""
    venv = tmp_path / "venv"
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


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tracker", "strategy"])
def test_new_plugin_installs_is_listed_and_passes_its_own_tests(kind: str, tmp_path: Path, fresh_env: Path) -> None:
    name = f"tmpl_{kind}"
    project = tmp_path / "project"
    made = accel_cli(["new-plugin", name, "--kind", kind, "--directory", str(project)], tmp_path)
    assert made.returncode == 0, made.stderr
    env = isolated_env(tmp_path / "home")
    subprocess.run(
        [str(fresh_env), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(project)],
        check=True,
        env=env,
        timeout=300,
        capture_output=True,
    )
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
