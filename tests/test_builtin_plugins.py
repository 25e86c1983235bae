"""The kernel's own features are built-in plugins (pytest's ``default_plugins``): registered by name as installed
plugins are, answering hooks through pluggy, visible in ``accel plugins``, the dry-run hook table and the trace.
And one launch plan (:mod:`accel.planning`): ``accel launch`` and ``notebook_launcher``/``debug_launcher`` refuse
the same settings with the same line (that library code never imports the CLI is an import rule of `make lint`)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from clitools import clean_env, run

from accel.builtin import BUILTIN_PLUGINS, is_builtin
from accel.commands.launch import plan_launch
from accel.errors import UsageError
from accel.launchers import preflight
from accel.plugins import Plugins


def test_every_builtin_plugin_is_registered_by_name_and_listed_as_built_in() -> None:
    plugins = Plugins.load(env={"ACCEL_PLUGINS": ""})
    assert [r.name for r in plugins.builtin] == [name for name, _ in BUILTIN_PLUGINS]
    for rec, (name, module) in zip(plugins.builtin, BUILTIN_PLUGINS, strict=True):
        assert plugins.pm.get_plugin(name) is importlib.import_module(module)
        assert rec.status == "built-in" and rec.distribution == "accel-kernel" and rec.hooks, rec
        assert is_builtin(name)
    assert not is_builtin("ddp") and "accel.checkpoint" not in plugins.records  # not an installed plugin


def test_each_builtin_answers_its_hooks_through_pluggy() -> None:
    order = Plugins.load(env={"ACCEL_PLUGINS": ""}).answer_order()
    assert order["accel_prepare_dataloader"] == (True, ["accel.data"])
    for hook in ("accel_state_items", "accel_save_state", "accel_load_state"):
        assert order[hook][1] == ["accel.checkpoint"], hook
    assert order["accel_estimate_memory"] == (False, ["accel.memory"])
    assert order["accel_prepare_training"] == (True, ["accel"])


def test_a_kernel_save_goes_through_the_builtin_checkpoint_writer(tmp_path: Path) -> None:
    """The hook call is pluggy's (a call monitor sees the built-in answer it), and the manifest still names the
    kernel as the items' owner, so checkpoints of earlier versions and of this one read the same."""
    import torch

    from accel import Kernel

    kernel = Kernel(cpu=True, plugins=[])
    model = kernel.prepare(torch.nn.Linear(2, 1))
    seen: list[list[str]] = []
    undo = kernel.plugins.pm.add_hookcall_monitoring(
        lambda hook, impls, kwargs: seen.append([i.plugin_name for i in impls]) if hook == "accel_save_state" else None,
        lambda *a: None,
    )
    try:
        directory = kernel.save_state(tmp_path / "ck")
    finally:
        undo()
    kernel.end_training()
    assert ["accel.checkpoint"] in seen
    manifest = json.loads((Path(directory) / "accel_manifest.json").read_text())
    assert manifest["items"]["model"]["plugin"] == "accel", manifest["items"]
    assert model is not None


def test_accel_plugins_lists_the_builtins(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    rows = {row["name"]: row for row in json.loads(run(["plugins", "--json"], env).stdout)}
    for name, module in BUILTIN_PLUGINS:
        assert rows[name]["status"] == "built-in" and rows[name]["entry_point"] == module, rows[name]
    assert rows["ddp"]["status"] == "active"
    table = run(["plugins"], env).stdout
    assert "accel.checkpoint" in table and "built-in" in table, table


def test_dry_run_and_trace_show_the_builtins(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    env = clean_env(tmp_path)
    dry = run(["launch", "--dry-run", "--verbose", str(script)], env)  # the hook table is behind --verbose
    assert dry.returncode == 0, dry
    assert "  accel_prepare_dataloader: accel.data\n" in dry.stdout, dry.stdout
    assert "  accel_save_state: each of accel.checkpoint\n" in dry.stdout, dry.stdout
    traced = subprocess.run(
        [sys.executable, "-c", "from accel.plugins import Plugins; Plugins.load()"],
        env={**env, "ACCEL_TRACE_PLUGINS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    for name, module in BUILTIN_PLUGINS:
        assert f"built-in plugin {name} ({module}) [register]" in traced.stderr, traced.stderr


@pytest.mark.parametrize(
    ("flags", "handed", "extra_env"),
    [
        (["--cpu", "--gpu_ids", "0"], {"cpu": True, "gpu_ids": "0"}, {}),
        (["--tee", "7"], {"tee": "7"}, {}),
        ([], {}, {"ACCEL_PLUGINS": ""}),  # no strategy for 2 processes: the plugins' activation says so
    ],
    ids=["cpu-and-gpu-ids", "tee", "no-strategy"],
)
def test_notebook_launcher_and_accel_launch_share_one_plan(
    tmp_path: Path, flags: list[str], handed: dict[str, object], extra_env: dict[str, str]
) -> None:
    """Before: ``launchers.preflight`` made its own plan with ``accel.commands.launch.check``; now both build it
    with :mod:`accel.planning` and refuse bad settings with the same line."""
    script = tmp_path / "train.py"
    script.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    env["ACCEL_HOME"] = str(tmp_path)
    with pytest.raises(UsageError) as from_cli:
        plan_launch(["-n", "2", *flags, str(script)], env={**env, **extra_env})
    with pytest.raises(UsageError) as from_notebook:
        preflight(2, 1, {"ACCEL_CONFIG": json.dumps(handed), **extra_env})
    assert str(from_notebook.value) == str(from_cli.value)


def test_help_lists_every_command_from_the_table() -> None:
    from accel.commands.cli import COMMANDS, USAGE

    for name, target, _ in COMMANDS:
        assert f"  {name} " in USAGE
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), target
    code = textwrap.dedent("""
        import sys
        from accel.commands.cli import main
        assert main(["--help"]) == 0
        assert not [m for m in sys.modules if m.startswith(("torch", "accel.commands.launch"))]
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
