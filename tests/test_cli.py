"""The `accel` command line: launch flags (both spellings), the defaults notice, --dry-run, `python -m
accel.commands.launch`, flags beating the config file, the default config lookup order, `accel env`, and that
`--help`, `launch --help`, `plugins` and `env` never import torch."""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

import pytest
from clitools import GOOD_AND_BROKEN, TESTS, clean_env, install, pythonpath, run

PROBE = str(TESTS / "scripts" / "cli_probe.py")

#: Every seed flag with a value, underscore spelling (not --cpu: with --gpu_ids it is a contradiction).
SEED_FLAGS = [
    "--multi_gpu",
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--machine_rank",
    "0",
    "--main_process_ip",
    "127.0.0.1",
    "--main_process_port",
    "29533",
    "--rdzv_backend",
    "c10d",
    "--same_network",
    "--gpu_ids",
    "0",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
    "--max_restarts",
    "1",
    "--monitor_interval",
    "0.5",
]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return clean_env(tmp_path)


def settings_of(stdout: str) -> dict[str, str]:
    """``name -> "value (source)"`` from the settings block of a dry run (only the settings that differ from their
    defaults, unless the dry run was --verbose)."""
    block = stdout.split("\nsettings (", 1)[1].splitlines()[1:]
    return dict(line.strip().split(" = ", 1) for line in itertools.takewhile(lambda x: x.startswith("  "), block))


def launcher_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("launcher: "))


# ---- help and flags ----------------------------------------------------------------------------------------------


def test_launch_help_lists_every_seed_flag_in_both_spellings(env, tmp_path):
    result = run(["launch", "--help"], {**env, "COLUMNS": "200"})
    assert result.returncode == 0, result
    for flag in [f for f in SEED_FLAGS if f.startswith("--")] + ["--config_file", "--dry-run", "--plugin"]:
        assert flag in result.stdout, flag
        if "_" in flag:
            assert flag.replace("_", "-") in result.stdout, flag
    assert re.search(r"--num_processes INT, --num-processes INT, -n INT", result.stdout)
    assert "plugin 'ddp':" in result.stdout and "--ddp_backend" in result.stdout  # plugins add their own flags


def test_plugin_flags_appear_in_help(tmp_path):
    env = clean_env(tmp_path, PYTHONPATH=pythonpath(install(*GOOD_AND_BROKEN)), COLUMNS="200")
    result = run(["launch", "--help"], env)
    assert result.returncode == 0, result
    assert "plugin 'hello':" in result.stdout and "--hello_greeting STR, --hello-greeting STR" in result.stdout


def test_seed_flags_dash_and_underscore_spellings_are_the_same(env):
    underscore = run(["launch", "--dry-run", *SEED_FLAGS, PROBE], env)
    assert underscore.returncode == 0, underscore
    dashed = run(
        ["launch", "--dry_run", *[f.replace("_", "-") if f.startswith("--") else f for f in SEED_FLAGS], PROBE], env
    )
    assert dashed.returncode == 0, dashed
    assert dashed.stdout == underscore.stdout
    values = settings_of(underscore.stdout)
    for name, shown in [
        ("multi_gpu", "True"),
        ("num_processes", "2"),
        ("num_machines", "1"),
        ("machine_rank", "0"),
        ("main_process_ip", "'127.0.0.1'"),
        ("main_process_port", "29533"),
        ("rdzv_backend", "'c10d'"),
        ("same_network", "True"),
        ("gpu_ids", "'0'"),
        ("mixed_precision", "'no'"),
        ("dynamo_backend", "'no'"),
        ("max_restarts", "1"),
        ("monitor_interval", "0.5"),
    ]:
        assert values[name] == f"{shown} (flag)", (name, values[name])
    command = launcher_line(underscore.stdout)
    for part in (
        "-m torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--max_restarts=1",
        "--monitor_interval=0.5",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=127.0.0.1:29533",
        PROBE,
    ):
        assert part in command, (part, command)
    assert "CUDA_VISIBLE_DEVICES=0" in underscore.stdout  # --gpu_ids reaches the workers' environment


def test_short_n_and_equals_forms(env):
    a = run(["launch", "--dry-run", "-n", "2", "--main_process_port", "29534", PROBE], env)
    b = run(["launch", "--dry-run", "--num-processes=2", "--main-process-port=29534", PROBE], env)
    assert a.returncode == b.returncode == 0, (a, b)
    assert a.stdout == b.stdout
    assert "--nproc_per_node=2" in launcher_line(a.stdout)


# ---- notices ---------------------------------------------------------------------------------------------------------


def test_defaults_are_listed_in_one_notice(env):
    result = run(["launch", "--dry-run", PROBE], env)
    assert result.returncode == 0, result
    assert len(result.err_lines) == 1, result
    notice = result.err_lines[0]
    for part in (
        "`--num_processes` was set to a value of `1`",
        "`--num_machines` was set to a value of `1`",
        "`--mixed_precision` was set to a value of `'no'`",
        "`--dynamo_backend` was set to a value of `'no'`",
    ):
        assert part in notice, part
    given = run(["launch", "--dry-run", "-n", "2", "--mixed_precision", "no", PROBE], env)
    assert len(given.err_lines) == 1 and "--num_processes" not in given.err_lines[0]
    assert "--mixed_precision" not in given.err_lines[0] and "--num_machines" in given.err_lines[0]
    quiet = run(["launch", "--dry-run", "-q", PROBE], env)
    assert quiet.returncode == 0 and quiet.stderr == ""


# ---- --dry-run -----------------------------------------------------------------------------------------------------


@pytest.mark.smoke
def test_dry_run_prints_the_plan_and_starts_nothing(env, tmp_path):
    """Before: 43 lines, 30 of them hook names, and the worker prelude `python -S -c 'import ctypes...prctl'` in
    the command. Now: the plan, the command as a user would type it, the environment; hooks with --verbose."""
    marker = tmp_path / "started.txt"
    result = run(["launch", "--dry-run", "-n", "2", "-p", "no:ddpp", PROBE, "--touch", str(marker)], env)
    assert result.returncode == 0, result
    out = result.stdout
    assert "active plugins: ddp (strategy)" in out
    assert "accel_" not in out and "prctl" not in out and "-S -c" not in out, out
    assert len(out.splitlines()) <= 12, out
    # the launcher command as typed by hand (torchrun's own), with the script and its arguments
    command = launcher_line(out)
    assert command.startswith(f"launcher: ddp (torchrun): {sys.executable} -m torch.distributed.run ")
    assert command.endswith(
        f"--nproc_per_node=2 --max_restarts=0 --monitor_interval=0.1 --node_rank=0 "
        f"--master_addr=127.0.0.1 --master_port={command.split('--master_port=')[1].split()[0]} "
        f"-- {PROBE} --touch {marker}"
    )
    # the environment handed to the workers
    env_block = out.split("environment for the workers (added to or changed from yours):\n", 1)[1]
    assert "ACCEL_CONFIG='{\"num_processes\": 2}'" in env_block
    assert "ACCEL_DISABLE_PLUGINS=ddpp" in env_block
    assert result.err_lines[0] == (
        "accel: warning: -p no:ddpp names no plugin, so it does nothing; did you mean `ddp`? (installed: ddp)"
    )
    assert not marker.exists()  # nothing was started
    # which plugin answers each hook: behind --verbose
    verbose = run(["launch", "--dry-run", "--verbose", "-n", "2", PROBE], env).stdout
    assert re.search(r"^  accel_prepare_training: ddp:strategy \(then accel\)$", verbose, re.M), verbose
    assert re.search(r"^  accel_backward: accel$", verbose, re.M), verbose
    assert re.search(r"^  accel_detect_hardware: each of ddp, accel$", verbose, re.M), verbose


def test_dry_run_single_process(env, tmp_path):
    marker = tmp_path / "started.txt"
    result = run(["launch", "--dry-run", PROBE, "--touch", str(marker)], env)
    assert result.returncode == 0, result
    assert "active plugins: none (kernel only)" in result.stdout
    assert launcher_line(result.stdout) == f"launcher: accel (one process): {sys.executable} {PROBE} --touch {marker}"
    assert not marker.exists()


@pytest.mark.slow
def test_real_launch_runs_the_script_with_its_arguments_and_exit_code(env, tmp_path):
    marker = tmp_path / "started.txt"
    result = run(["launch", "-q", PROBE, "--touch", str(marker)], env)
    assert result.returncode == 0, result
    assert marker.read_text() == "started\n"
    assert f"PROBE rank=0 world=1 hello_imported=False components=[] args=['--touch', '{marker}']" in result.stdout
    failed = run(["launch", "-q", PROBE, "--exit", "3"], env)
    assert failed.returncode == 3, failed


def test_python_m_accel_commands_launch_is_the_same(env):
    args = ["--dry-run", "-n", "2", "--main_process_port", "29535", PROBE, "x"]
    via_cli = run(["launch", *args], env)
    via_module = run(args, env, python_m="accel.commands.launch")
    assert via_cli.returncode == via_module.returncode == 0, (via_cli, via_module)
    assert via_module.stdout == via_cli.stdout and via_module.stderr == via_cli.stderr
    bad_cli = run(["launch", "--mixed_precision", "fp17", PROBE], env)
    bad_module = run(["--mixed_precision", "fp17", PROBE], env, python_m="accel.commands.launch")
    assert bad_cli.returncode == bad_module.returncode == 2
    assert bad_cli.stderr == bad_module.stderr


# ---- config file: precedence and lookup ------------------------------------------------------------------------------


def test_flags_beat_the_config_file(env, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("num_processes: 2\nrdzv_backend: c10d\nmax_restarts: 3\nmain_process_port: 29536\n")
    result = run(["launch", "--dry-run", "--config_file", str(config), "-n", "1", "--max-restarts", "1", PROBE], env)
    assert result.returncode == 0, result
    values = settings_of(result.stdout)
    assert values["num_processes"] == "1 (flag)"
    assert values["max_restarts"] == "1 (flag)"
    assert values["rdzv_backend"] == "'c10d' (file)"
    assert values["main_process_port"] == "29536 (file)"
    assert result.stderr == ""  # a config file was given: no defaults notice


def test_default_config_lookup_order(tmp_path):
    env = clean_env(tmp_path, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    places = {
        "ACCEL_HOME": Path(env["ACCEL_HOME"]),
        "XDG_CACHE_HOME": tmp_path / "xdg" / "accel",
        "HOME": tmp_path / "user" / ".cache" / "accel",
    }
    for restarts, directory in enumerate(places.values(), start=1):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "default_config.yaml").write_text(f"max_restarts: {restarts}\n")
    for restarts, (name, directory) in enumerate(places.items(), start=1):
        result = run(["launch", "--dry-run", PROBE], env)
        assert result.returncode == 0, result
        used = directory / "default_config.yaml"
        assert result.err_lines == [f"accel: using the default config file {used} (--config_file FILE picks another)"]
        assert settings_of(result.stdout)["max_restarts"] == f"{restarts} (file)", name
        report = run(["env"], env)
        assert f"- `Config file`: {used}" in report.stdout, report
        used.unlink()  # the next place is used once this one is gone
    result = run(["launch", "--dry-run", "--verbose", PROBE], env)
    assert settings_of(result.stdout)["max_restarts"] == "0 (default)"
    assert "default config file" not in result.stderr and "were not given" in result.stderr
    assert "- `Config file`: none (defaults)" in run(["env"], env).stdout


def test_explicit_config_file_wins_over_the_default_one(env, tmp_path):
    Path(env["ACCEL_HOME"], "default_config.yaml").write_text("max_restarts: 5\n")
    mine = tmp_path / "mine.yml"
    mine.write_text("max_restarts: 2\n")
    result = run(["launch", "--dry-run", "--config-file", str(mine), PROBE], env)
    assert result.returncode == 0, result
    assert settings_of(result.stdout)["max_restarts"] == "2 (file)"
    assert result.stderr == ""


# ---- accel env -------------------------------------------------------------------------------------------------------


def test_env_report(tmp_path):
    env = clean_env(tmp_path, PYTHONPATH=pythonpath(install(*GOOD_AND_BROKEN)))
    Path(env["ACCEL_HOME"], "default_config.yaml").write_text("num_processes: 2\n")
    result = run(["env"], env)
    assert result.returncode == 0, result
    out = result.stdout
    import importlib.metadata as md
    import platform

    assert f"- `accel-kernel version`: {md.version('accel-kernel')}" in out
    assert f"- `Platform`: {platform.platform()}" in out
    assert f"- `Python version`: {sys.version.split()[0]}" in out
    assert f"- `PyTorch version (build)`: {md.version('torch')}" in out
    assert re.search(r"- `Devices \(used\)`: \w+ x\d+", out)
    assert "- `Devices reported by accel`: cpu x1 (priority 0)" in out
    assert "- `Plugin hello`: accel-plugin-hello 0.3.1: active" in out
    assert re.search(r"- `Plugin broken`: accel-plugin-broken 0\.1\.0: failed \(import failed: RuntimeError", out)
    assert "- `Plugin misspelt`: accel-plugin-misspelt 0.1.0: failed (unknown hook 'accel_add_option'" in out
    assert f"- `Config file`: {env['ACCEL_HOME']}/default_config.yaml" in out
    assert "\t- num_processes: 2" in out


# ---- no torch import for the informational commands ------------------------------------------------------------------


@pytest.mark.parametrize("hide", [True, False], ids=["example-plugins", "every-plugin-of-this-venv"])
@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["launch", "--help"],
        ["plugins"],
        ["plugins", "--json"],
        ["env"],
        ["launch", "--dry-run", "-n", "2", PROBE],
    ],
    ids=["help", "launch-help", "plugins", "plugins-json", "env", "launch-dry-run"],
)
def test_informational_commands_do_not_import_torch(tmp_path, args, hide):
    # with the example plugins installed, and with every plugin this venv has (make setup installs all of
    # plugins/*): their entry points and component classes must stay torch-free
    env = clean_env(tmp_path, hide=hide, PYTHONPATH=pythonpath(install(*GOOD_AND_BROKEN)))
    result = run(args, env, python_flags=("-X", "importtime"))
    assert result.returncode == 0, result
    imported = [
        line.rsplit("|", 1)[1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    ]
    assert "accel.commands.cli" in imported and "pluggy" in imported  # -X importtime did report
    torch_modules = [m for m in imported if m == "torch" or m.startswith("torch.")]
    assert torch_modules == [], torch_modules[:5]
