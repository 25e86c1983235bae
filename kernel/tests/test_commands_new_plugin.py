"""accel.commands.new_plugin: ``accel new-plugin`` refuses a bad name, an unknown kind, a taken name or a non-empty
directory in one line and writes nothing; ``accel --help`` names every kind; each kind's template renders to valid
Python that imports from accel only the plugin API. Installing the rendered projects and running their own tests is
in tests/test_plugin_template.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from accel.commands.new_plugin import KINDS, render
from accel.testing import isolated_env


def accel_cli(args: list[str], tmp_path: Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "accel.commands.cli", *args],
        env=isolated_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


@pytest.mark.requires_plugins("ddp")  # a name an installed plugin has is refused: ddp's
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


def test_a_new_plugin_is_written_where_asked(tmp_path: Path) -> None:
    made = accel_cli(["new-plugin", "my_thing", "--kind", "precision", "--directory", str(tmp_path / "p")], tmp_path)
    assert made.returncode == 0, made.stderr
    written = sorted(str(p.relative_to(tmp_path / "p")) for p in (tmp_path / "p").rglob("*") if p.is_file())
    assert written == sorted(render("my_thing", "precision"))
    assert (tmp_path / "p" / "src/accel_my_thing/precision.py").read_text() == render("my_thing", "precision")[
        "src/accel_my_thing/precision.py"
    ]
