"""accel.commands.config, with no plugin loaded (``ACCEL_PLUGINS=""``; the one test that needs ddp says so):
``config default`` writes the detected hardware's config and never overwrites without ``--force``; ``config show``
gives each setting's value and where it came from (flag over environment over file over default); ``config update``
brings an older or Accelerate-written file to the current schema; a missing file is one line. The interactive
questions through a real terminal are in tests/test_config_command.py."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from accel import hookimpl
from accel.commands.cli import main
from accel.commands.config import upgrade
from accel.plugins import Plugins


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every config lookup place inside ``tmp_path``, no accel or Accelerate variable, no plugin."""
    for name in [k for k in os.environ if k.startswith(("ACCEL_", "ACCELERATE_")) or k == "MIXED_PRECISION"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "accel_home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setenv("ACCEL_PLUGINS", "")
    return tmp_path / "accel_home"


def module(name: str, **hooks: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    for hook, fn in hooks.items():
        setattr(mod, hook, hookimpl(fn))
    return mod


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and captured.out == "", captured
    return lines[0]


def test_config_default_writes_this_machine_and_never_overwrites(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "default"]) == 0
    path = home / "default_config.yaml"
    assert capsys.readouterr().out == f"accel configuration saved at {path}\n"
    data = yaml.safe_load(path.read_text())
    assert (data["distributed_type"], data["num_processes"], data["use_cpu"], data["mixed_precision"]) == (
        "NO",
        1,
        True,
        "no",
    )
    path.write_text("num_processes: 1\n")
    assert main(["config", "default", "--mixed_precision", "bf16"]) == 2
    assert error_line(capsys) == (
        f"accel: error: {path} already exists; pass --force to overwrite it, or --config_file PATH to write elsewhere"
    )
    assert path.read_text() == "num_processes: 1\n"
    assert main(["config", "default", "--force", "--mixed_precision", "bf16"]) == 0
    assert yaml.safe_load(path.read_text())["mixed_precision"] == "bf16"
    assert "mixed_precision bf16" in capsys.readouterr().err  # no plugin provides it here: a note says so


def test_config_show_says_where_each_value_comes_from(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = home.parent / "mine.yaml"
    path.write_text("gradient_accumulation_steps: 2\nmonitor_interval: 0.5\nmachine_rank: 0\n")
    monkeypatch.setenv("ACCEL_GRADIENT_ACCUMULATION_STEPS", "3")
    assert main(["config", "show", "--json", "--config_file", str(path), "--monitor_interval", "1.5"]) == 0
    shown = json.loads(capsys.readouterr().out)
    settings = {name: (row["value"], row["source"]) for name, row in shown["settings"].items()}
    assert shown["config_file"] == str(path) and shown["ignored"] == []
    assert settings["monitor_interval"] == (1.5, "flag")
    assert settings["gradient_accumulation_steps"] == (3, "env ACCEL_GRADIENT_ACCUMULATION_STEPS")
    assert settings["machine_rank"] == (0, f"file {path}")
    assert settings["num_processes"] == (1, "default")

    assert main(["config", "show"]) == 0  # no file anywhere: the defaults, and the environment
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in out.splitlines()[1:]}
    assert out.startswith("config file: none (defaults)\n")
    assert rows["gradient_accumulation_steps"] == ["3", "env ACCEL_GRADIENT_ACCUMULATION_STEPS"]
    assert rows["monitor_interval"] == ["0.1", "default"]


def test_config_update_rewrites_an_accelerate_file_in_place(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home.mkdir(parents=True)
    path = home / "default_config.yaml"
    path.write_text("fp16: true\nnum_processes: 1\nmain_process_ip: null\n")
    assert main(["config", "update"]) == 0
    out = capsys.readouterr().out
    assert out.endswith(f"accel configuration updated at {path}\n") and "fp16" in out
    data = yaml.safe_load(path.read_text())
    assert data["mixed_precision"] == "fp16" and "fp16" not in data and "main_process_ip" not in data
    assert main(["config", "update"]) == 0
    assert capsys.readouterr().out == f"{path} is already up to date\n"


def test_config_update_without_a_file_is_one_line(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "update"]) == 2
    line = error_line(capsys)
    assert line.startswith(f"accel: error: no config file found (looked in {home}, ") and line.endswith(
        "pass --config_file PATH or create one with `accel config` / `accel config default`"
    )


def test_config_without_a_terminal_is_one_line(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config"]) == 2  # pytest's captured stdin and stdout are no terminal
    assert error_line(capsys).startswith("accel: error: ")
    assert not home.exists() or not any(home.iterdir())


def test_upgrade_keeps_values_and_reports_changes() -> None:
    options = Plugins.load(env={"ACCEL_PLUGINS": ""}).options()
    new, changes = upgrade({"fp16": True, "dynamo_backend": "INDUCTOR", "num_processes": 4}, options)
    assert new["mixed_precision"] == "fp16" and new["dynamo_config"] == {"dynamo_backend": "inductor"}
    assert new["num_processes"] == 4 and "fp16" not in new and "dynamo_backend" not in new
    assert any("fp16" in c for c in changes) and any("dynamo_backend" in c for c in changes)
    same, none = upgrade(new, options)
    assert same == new and none == []


@pytest.mark.requires_plugins("ddp")  # a machine with several devices: several processes through ddp
def test_default_config_uses_the_detected_hardware() -> None:
    from accel import HardwareInfo
    from accel.commands.config import default_config

    gpus = module("gpus", accel_detect_hardware=lambda env: HardwareInfo("cuda", device_count=4, priority=10))
    plugins = Plugins.load(env={"ACCEL_PLUGINS": "ddp"}, extra=[("gpus", gpus)])
    data = default_config(plugins, plugins.options(), {}, "bf16")
    assert (data["distributed_type"], data["num_processes"], data["use_cpu"], data["mixed_precision"]) == (
        "MULTI_GPU",
        4,
        False,
        "bf16",
    )
    # without a plugin that runs several processes: one process on one device
    alone = Plugins.load(env={"ACCEL_PLUGINS": ""}, extra=[("gpus", gpus)])
    data = default_config(alone, alone.options(), {}, "no")
    assert (data["distributed_type"], data["num_processes"], data["use_cpu"]) == ("NO", 1, False)
    # a CPU-only machine (the kernel's own answer)
    cpu = Plugins.load(env={"ACCEL_PLUGINS": ""})
    data = default_config(cpu, cpu.options(), {}, "no")
    assert (data["distributed_type"], data["num_processes"], data["use_cpu"]) == ("NO", 1, True)
