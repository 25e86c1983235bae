"""accel.commands.info with the kernel alone (``ACCEL_PLUGINS=""``): ``accel plugins`` lists the kernel's built-in
plugins with the hooks they answer (table and ``--json`` agree) and every installed plugin as disabled, and
``accel env`` reports versions, the devices accel uses, each plugin's status and the config file, without importing
a plugin. The listings with real example plugins (failed, broken, misspelt) are in tests/test_plugins.py,
tests/test_cli.py and tests/test_cli_output.py."""

from __future__ import annotations

import importlib.metadata as md
import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from accel.testing import isolated_env


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    env = isolated_env(tmp_path / "accel_home", registered=[], extra={"COLUMNS": "400"})
    env.update(HOME=str(tmp_path / "user"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    return env


def accel(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "accel.commands.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


def installed_plugins() -> set[str]:
    return {ep.name for ep in md.entry_points(group="accel")}


def test_plugins_lists_the_kernels_built_ins_and_nothing_else_active(env: dict[str, str]) -> None:
    result = accel(["plugins", "--json"], env)
    assert result.returncode == 0 and result.stderr == "", result
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    built_in = {name for name, row in rows.items() if row["status"] == "built-in"}
    assert "accel" in built_in and all(rows[n]["distribution"] == "accel-kernel" for n in built_in)
    assert rows["accel"]["version"] == md.version("accel-kernel") and "accel_launch" in rows["accel"]["hooks"]
    others = {name: row["status"] for name, row in rows.items() if name not in built_in}
    assert set(others) == installed_plugins() and set(others.values()) <= {"disabled"}, others

    table = accel(["plugins"], env)
    assert table.returncode == 0, table
    body = [line for line in table.stdout.splitlines()[3:] if line.strip()]
    lines = {line.split()[0]: line for line in body if line.split()[0] in rows}
    assert set(lines) == set(rows)
    # after the rows, only the hint a venv without plugins gets
    assert all(line.startswith("no plugins installed") for line in body if line.split()[0] not in rows), body
    for name, row in rows.items():
        assert row["status"] in lines[name] and all(hook in lines[name] for hook in row["hooks"]), name


def test_env_reports_versions_devices_plugins_and_the_config_file(env: dict[str, str]) -> None:
    config = Path(env["ACCEL_HOME"]) / "default_config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("num_processes: 1\n")
    result = accel(["env"], env)
    assert result.returncode == 0 and result.stderr == "", result
    out = result.stdout
    assert f"- `accel-kernel version`: {md.version('accel-kernel')}" in out
    assert f"- `Platform`: {platform.platform()}" in out
    assert f"- `Python version`: {sys.version.split()[0]}" in out
    assert f"- `PyTorch version (build)`: {md.version('torch')}" in out
    assert "- `Devices reported by accel`: cpu x1 (priority 0)" in out
    for name in installed_plugins():
        assert f"- `Plugin {name}`: " in out and "disabled (not in ACCEL_PLUGINS)" in out, name
    assert f"- `Config file`: {config}" in out and "\t- num_processes: 1" in out


def test_informational_commands_import_no_plugin(env: dict[str, str]) -> None:
    code = (
        "import sys\nbefore = set(sys.modules)\nfrom accel.commands.cli import main\n"
        "codes = [main(['plugins', '--json']), main(['env'])]\n"
        "from importlib.metadata import entry_points\n"
        "plugins = {e.value.partition(':')[0].split('.')[0] for e in entry_points(group='accel')}\n"
        "print('RESULT', codes, sorted(m for m in set(sys.modules) - before if m.split('.')[0] in plugins))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "RESULT [0, 0] []", out.stdout[-2000:]
