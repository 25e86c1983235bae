"""accel.commands.launch with the kernel alone (``ACCEL_PLUGINS=""``): the plan it hands to ``accel_launch`` (the
worker command, the settings handed over in ``ACCEL_CONFIG``, where each value came from), the kernel's own
launcher running one process with the script's arguments and exit code, and bad input refused in one line before
anything starts. Launches through ddp and the other plugins, and every Accelerate flag, are in tests/test_cli.py,
tests/test_launch_flags.py and tests/test_bad_input*.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accel.commands.launch import plan_launch
from accel.errors import UsageError
from accel.testing import isolated_env


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """No plugin, every config lookup place inside ``tmp_path``."""
    env = isolated_env(tmp_path / "accel_home", registered=[])
    env.update(HOME=str(tmp_path / "user"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    return env


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(
        "import json, os, sys\n"
        "print('ARGS', json.dumps(sys.argv[1:]), 'CONFIG', os.environ['ACCEL_CONFIG'], flush=True)\n"
        "sys.exit(int(os.environ.get('EXIT_WITH', '0')))\n"
    )
    return path


def test_the_plan_carries_the_command_and_the_settings_given(env: dict[str, str], script: Path) -> None:
    env["ACCEL_GRADIENT_ACCUMULATION_STEPS"] = "2"
    plugins, plan, notices = plan_launch(["--monitor_interval", "0.5", str(script), "--lr", "3"], env)
    assert plugins.components == [] and list(plugins.loaded) == []  # the kernel alone
    assert plan.command == [str(script), "--lr", "3"] and plan.python == sys.executable and not plan.dry_run
    assert plan.settings.phase == "launch" and plan.settings.world_size == 1
    assert plan.settings.sources["monitor_interval"] == "flag"
    assert plan.settings.sources["gradient_accumulation_steps"] == "env ACCEL_GRADIENT_ACCUMULATION_STEPS"
    handed = json.loads(plan.env["ACCEL_CONFIG"])
    assert handed["monitor_interval"] == 0.5 and handed["gradient_accumulation_steps"] == 2
    assert "num_processes" not in handed  # defaults are not handed over
    assert any(n.startswith("these values were not given, so defaults were used: ") for n in notices)
    _, quiet, notices = plan_launch(["-q", "-m", "mypkg.train"], env)
    assert quiet.command == ["-m", "mypkg.train"] and notices == []


def test_a_config_file_is_read_and_flags_beat_it(env: dict[str, str], script: Path, tmp_path: Path) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text("monitor_interval: 0.25\nmax_restarts: 0\nmixed_precision: 'no'\n")
    _, plan, notices = plan_launch(["--config_file", str(config), "--monitor_interval", "2", str(script)], env)
    assert plan.settings["monitor_interval"] == 2.0 and plan.settings.sources["monitor_interval"] == "flag"
    assert plan.settings.sources["mixed_precision"] == "file" and notices == []


def test_the_kernels_launcher_runs_one_process_with_the_scripts_arguments_and_exit_code(
    env: dict[str, str], script: Path, tmp_path: Path
) -> None:
    accel = str(Path(sys.executable).parent / "accel")
    proc = subprocess.run(
        [accel, "launch", "-q", str(script), "--lr", "3"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("ARGS ")]
    args, config = line[len("ARGS ") :].split(" CONFIG ")
    assert json.loads(args) == ["--lr", "3"] and json.loads(config) == {}
    proc = subprocess.run(
        [accel, "launch", "-q", str(script)], env={**env, "EXIT_WITH": "3"}, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 3, proc


def test_a_dry_run_starts_nothing_and_shows_the_plan(env: dict[str, str], tmp_path: Path) -> None:
    marker = tmp_path / "started"
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    accel = str(Path(sys.executable).parent / "accel")
    proc = subprocess.run(
        [accel, "launch", "--dry-run", "--monitor_interval", "0.5", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("accel launch plan (dry run: nothing is started)\n")
    assert "  monitor_interval = 0.5 (flag)" in proc.stdout and "ACCEL_CONFIG=" in proc.stdout
    assert not marker.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num_processes", "two", "train.py"], "`--num_processes` expects a whole number, got 'two'"),
        (["--rdzv_backend", "c10", "train.py"], "`--rdzv_backend` must be one of static, c10d, etcd, etcd-v2, got"),
        (["--monitor_interval", "1"], "no training script given: accel launch [options] script.py [script args]"),
        (["missing.py"], "training script 'missing.py' does not exist"),
        (["-p", "ddp", "train.py"], "-p expects no:NAME to disable a plugin, got 'ddp'"),
        (["--config_file", "nowhere.yaml", "train.py"], "config file 'nowhere.yaml' does not exist; fix the path"),
    ],
)
def test_bad_input_is_one_line_before_anything_starts(
    env: dict[str, str], script: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    args = [str(script) if a == "train.py" else a for a in args]
    with pytest.raises(UsageError) as info:
        plan_launch(args, env)
    assert message in str(info.value) and "\n" not in str(info.value), info.value
    before = sorted(os.listdir(tmp_path))
    accel = str(Path(sys.executable).parent / "accel")
    proc = subprocess.run([accel, "launch", *args], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc
    assert lines[0].startswith("accel: error: ") and message in lines[0]
    assert sorted(os.listdir(tmp_path)) == before  # nothing written
