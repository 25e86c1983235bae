"""What a person reads from `accel plugins` and `accel env`: plugin text shown as written (plain text, no markup), the
table in the terminal's width with whole hook names, backend versions in `accel env` without importing anything."""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
from pathlib import Path

import pytest
from clitools import clean_env, run


def _published_visible(tmp_path: Path, columns: int) -> dict[str, str]:
    return clean_env(tmp_path, hide=False, COLUMNS=str(columns))  # every plugin of this venv, ipex and xla included


def _installed(dist: str) -> bool:
    try:
        md.version(dist)
        return True
    except md.PackageNotFoundError:
        return False


@pytest.mark.parametrize("columns", [80, 100, 120, 200])
def test_plugins_table_fits_the_terminal_with_whole_hook_names(tmp_path: Path, columns: int) -> None:
    """Before: the table was forced to 120 columns (cut by a narrower terminal) and hook names were cut
    mid-word (`accel_config_question` / `s`)."""
    env = _published_visible(tmp_path, columns)
    result = run(["plugins"], env)
    assert result.returncode == 0, result
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= columns, result.stdout
    assert "…" not in result.stdout
    cells = " ".join(part.strip() for line in lines for part in line.split("│"))
    for row in json.loads(run(["plugins", "--json"], env).stdout):
        for hook in row["hooks"]:
            assert f" {hook}," in f" {cells}," or f" {hook} " in f" {cells} ", (hook, result.stdout)


def test_plugin_text_with_brackets_is_shown_as_written(tmp_path: Path) -> None:
    """Before: `pip install 'accel-plugin-ipex'` and `add torch-xla on a TPU VM`: rich ate `[ipex]` and `[tpu]`."""
    if not (_installed("accel-plugin-ipex") and _installed("accel-plugin-xla")):
        pytest.skip("needs accel-plugin-ipex and accel-plugin-xla installed (unavailable on this torch)")
    env = _published_visible(tmp_path, 250)
    rows = {row["name"]: row for row in json.loads(run(["plugins", "--json"], env).stdout)}
    table = run(["plugins"], env).stdout
    shown = 0
    for name, bracketed in (("ipex", "[ipex]"), ("xla", "[tpu]")):
        if rows[name]["status"] != "unavailable" or bracketed not in rows[name]["reason"]:
            continue  # the backend is installed here: no reason to show
        shown += 1
        assert bracketed in table, (bracketed, table)
    if not shown:
        pytest.skip("ipex and xla are both usable here: no bracketed reason to show")


def test_plugins_json_is_unchanged(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    rows = json.loads(run(["plugins", "--json"], env).stdout)
    assert [sorted(row) for row in rows] == [
        ["distribution", "entry_point", "hooks", "name", "provides", "reason", "status", "version"]
    ] * len(rows)


def test_plugins_env_and_config_import_no_torch_with_every_plugin_visible(tmp_path: Path) -> None:
    """The other no-torch tests hide most plugins; a plugin module that imports torch at import time (directly or
    through a kernel module that does) slows every CLI command. Here every installed plugin is visible."""
    env = clean_env(tmp_path, hide=False)
    code = (
        "import sys\nfrom accel.commands.cli import main\n"
        "assert main(['plugins']) == 0 and main(['plugins', '--json']) == 0 and main(['env']) == 0\n"
        "assert main(['config', 'show']) == 0\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "TORCH False" in result.stdout


def test_env_lists_backend_versions_without_importing_them(tmp_path: Path) -> None:
    """Before: `accel env` showed torch and pluggy only; the backends' versions had to be looked up by hand."""
    env = clean_env(tmp_path, hide=False)
    code = (
        "import sys\nfrom accel.commands.cli import main\nassert main(['env']) == 0\n"
        "heavy = [m for m in ('torch', 'deepspeed', 'torchao', 'mlflow', 'tensorboard', 'wandb', 'transformers') "
        "if m in sys.modules]\nprint('IMPORTED', heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "IMPORTED []" in result.stdout
    line = next(line for line in result.stdout.splitlines() if line.startswith("- `Backend and related packages`"))
    for dist in (
        "deepspeed",
        "torchao",
        "mlflow-skinny",
        "tensorboard",
        "wandb",
        "safetensors",
        "transformers",
        "accelerate",
    ):
        if _installed(dist):
            assert f"{dist} {md.version(dist)}" in line, (dist, line)
    missing = next((line for line in result.stdout.splitlines() if line.startswith("- `Not installed`")), "")
    for dist, plugin in (("torch-xla", "xla"), ("intel-extension-for-pytorch", "ipex")):
        if not _installed(dist) and _installed(f"accel-plugin-{plugin}"):
            assert dist in missing, (dist, missing)
