"""More bad input (the config and plugin-loading part): each case is one clear line naming the bad
value and the fix, exit code 2, no traceback, nothing written or overwritten. Plugins that misbehave are real
distributions from tests/plugin_pkgs, pip-installed by ``clitools.install``; a plugin that fails is shown as failed
and leaves every run that does not ask for it alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from clitools import TESTS, clean_env, install, pythonpath, run
from test_bad_input import check_one_line_error, snapshot

PROBE = str(TESTS / "scripts" / "cli_probe.py")
MISBEHAVING = ("hello", "exits", "badopts", "badactivate")


@pytest.fixture(scope="module")
def site() -> Path:
    return install(*MISBEHAVING)


@pytest.fixture
def env(tmp_path: Path, site: Path) -> dict[str, str]:
    return clean_env(tmp_path, PYTHONPATH=pythonpath(site), COLUMNS="250")


# ---- plugins that fail ----------------------------------------------------------------------------------------


def test_plugin_calling_sys_exit_on_import_is_reported_and_isolated(env: dict[str, str]) -> None:
    result = run(["plugins", "--json"], env)
    assert result.returncode == 0, result
    found = {row["name"]: row for row in json.loads(result.stdout)}
    assert found["exits"]["status"] == "failed"
    assert found["exits"]["reason"] == (
        "import failed: SystemExit: the plugin called sys.exit('accel_exits refuses to load (on purpose)')"
    )
    assert found["hello"]["status"] == "active" and found["ddp"]["status"] == "active"
    for command in (["env"], ["config", "show"], ["plugins"]):
        other = run(command, env)
        assert other.returncode == 0 and "Traceback" not in other.stderr, (command, other)


def test_plugin_failing_in_add_options_is_failed_not_fatal(env: dict[str, str]) -> None:
    found = {row["name"]: row for row in json.loads(run(["plugins", "--json"], env).stdout)}
    assert found["badopts"]["status"] == "failed"
    assert found["badopts"]["reason"] == (
        "accel_add_options failed: ValueError: badopts cannot declare its options (on purpose)"
    )
    shown = json.loads(run(["config", "show", "--json"], env).stdout)["settings"]
    assert "badopts_level" not in shown  # what it declared before failing is dropped with it


def test_unselected_failing_plugins_do_not_block_a_run(env: dict[str, str], tmp_path: Path) -> None:
    """Before: `accel launch script.py` failed for everyone with `plugin 'badactivate' failed in accel_activate`
    (and `plugin 'badopts' failed in accel_add_options`). After: the run works; the launcher notes the skips."""
    result = run(["launch", PROBE], env, cwd=tmp_path)
    assert result.returncode == 0, result
    assert "PROBE rank=0 world=1" in result.stdout
    assert "Traceback" not in result.stderr
    notes = [line for line in result.err_lines if "is skipped" in line]
    assert any(
        "plugin 'badactivate' (accel-plugin-badactivate 0.1.0) is skipped: accel_activate failed: "
        "RuntimeError: badactivate cannot decide" in line
        for line in notes
    ), result
    assert any(
        "plugin 'badopts' (accel-plugin-badopts 0.1.0) is skipped: accel_add_options failed" in line for line in notes
    ), result
    assert any("plugin 'exits'" in line and "SystemExit" in line for line in notes), result


@pytest.mark.parametrize(
    "name, needle",
    [
        ("badactivate", "plugin 'badactivate' failed in accel_activate: RuntimeError: badactivate cannot decide"),
        (
            "badopts",
            "plugin 'badopts' (accel-plugin-badopts 0.1.0) cannot be used: accel_add_options failed: ValueError",
        ),
        ("exits", "plugin 'exits' (accel-plugin-exits 0.1.0) cannot be used: import failed: SystemExit"),
    ],
)
def test_selecting_a_failing_plugin_names_its_error(
    env: dict[str, str], tmp_path: Path, name: str, needle: str
) -> None:
    before = snapshot(tmp_path)
    result = run(["launch", "--plugin", name, PROBE], env, cwd=tmp_path)
    check_one_line_error(result, [needle])
    assert snapshot(tmp_path) == before


def test_kernel_in_a_plain_script_is_not_blocked_by_unselected_failing_plugins(
    env: dict[str, str], tmp_path: Path
) -> None:
    code = "from accel import Kernel\nk = Kernel()\nprint(sorted(r.name for r in k.plugins.failed))\nk.end_training()\n"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['badactivate', 'badopts', 'exits']"


# ---- config files, ACCEL_HOME, environment ----------------------------------------------------------------------

CONFIG_CASES = [
    # (id, file name, bytes, substrings of the error line)
    (
        "non-utf8",
        "config.yaml",
        b"num_processes: 1\nmixed_precision: \xff\xfe\n",
        ["config.yaml: not UTF-8 text (byte 0xff at offset 34); save the file as UTF-8"],
    ),
    (
        "deep-yaml",
        "config.yaml",
        b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n",
        ["config.yaml: nested too deeply to be a config file", "fix the file"],
    ),
    (
        "deep-json",
        "config.json",
        b'{"fsdp_config": ' + b'{"k": ' * 3000 + b"1" + b"}" * 3001,
        ["config.json: nested too deeply to be a config file"],
    ),
    (
        "section-not-a-mapping",
        "config.yaml",
        b"fsdp_config: 5\n",
        [
            "config.yaml: `fsdp_config` must be a mapping of settings (e.g. `fsdp_config: {fsdp_",
            "got 5; put its keys under it",
        ],
    ),
    (
        "bad-host",
        "config.yaml",
        b"main_process_ip: not an ip!\n",
        ["`main_process_ip` must be an IP address (10.0.0.7) or a host name", "got 'not an ip!'"],
    ),
    (
        "bad-gpu-ids",
        "config.yaml",
        b"gpu_ids: 0,x\n",
        ["`gpu_ids` must be 'all' or device numbers separated by commas (0,1,3), got '0,x'"],
    ),
]


@pytest.mark.parametrize("case_id, name, content, needles", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_files_are_one_line(
    tmp_path: Path, case_id: str, name: str, content: bytes, needles: list[str]
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / name).write_bytes(content)
    env = clean_env(tmp_path, hide=False, ACCEL_PLUGINS="ddp,fsdp")  # fsdp visible: `fsdp_config` is its section
    before = snapshot(tmp_path)
    for command in (
        ["launch", "--config_file", name, PROBE],
        ["config", "show", "--config_file", name],
        ["config", "update", "--config_file", name],
    ):
        check_one_line_error(run(command, env, cwd=work), needles)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "flags, needle",
    [
        (
            ["--main_process_ip", "not an ip!", "--num_machines", "2", "-n", "2"],
            "`--main_process_ip` must be an IP address (10.0.0.7) or a host name (node-1.example.com), got 'not an ip!'",
        ),
        (["--gpu_ids", "0,x"], "`--gpu_ids` must be 'all' or device numbers separated by commas (0,1,3), got '0,x'"),
        (["--gpu_ids", "1,1"], "`--gpu_ids` lists a device twice, got '1,1'"),
    ],
)
def test_bad_host_and_device_flags(tmp_path: Path, flags: list[str], needle: str) -> None:
    env = clean_env(tmp_path)
    before = snapshot(tmp_path)
    check_one_line_error(run(["launch", *flags, PROBE], env, cwd=tmp_path), [needle])
    assert snapshot(tmp_path) == before


def _unwritable_homes(tmp_path: Path) -> list[tuple[str, Path, str]]:
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory\n")
    homes = [
        ("a file", a_file, f"{a_file} is a file, not a directory"),
        ("inside a file", a_file / "sub", f"{a_file} is a file, not a directory"),
        ("proc", Path("/proc/accel-home"), "/proc/accel-home"),
    ]
    if os.geteuid() != 0:  # root writes anywhere: a read-only directory only stops other users
        read_only = tmp_path / "read_only"
        read_only.mkdir()
        read_only.chmod(0o555)
        homes.append(("read-only", read_only, "Permission denied"))
    return homes


def test_unwritable_accel_home_is_one_line(tmp_path: Path) -> None:
    """Before: `FileExistsError` / `PermissionError` tracebacks from `accel config default`."""
    for label, home, needle in _unwritable_homes(tmp_path):
        env = clean_env(tmp_path, ACCEL_HOME=str(home))
        result = run(["config", "default"], env, cwd=tmp_path)
        line = check_one_line_error(
            result,
            [
                "cannot write the config file",
                needle,
                "set ACCEL_HOME to a writable directory, or pass --config_file PATH",
            ],
        )
        assert str(home / "default_config.yaml") in line, (label, line)
    a_file = tmp_path / "a_file"
    assert a_file.read_text() == "not a directory\n"  # nothing overwritten


def test_interactive_config_checks_the_target_before_asking(tmp_path: Path) -> None:
    pexpect = pytest.importorskip("pexpect")
    a_file = tmp_path / "a_file"
    a_file.write_text("x\n")
    env = clean_env(tmp_path, ACCEL_HOME=str(a_file), TERM="xterm")
    child = pexpect.spawn(sys.executable, ["-m", "accel.commands.cli", "config"], env=env, encoding="utf-8", timeout=60)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 2
    assert "is a file, not a directory" in child.before and "Which type of machine" not in child.before


@pytest.mark.parametrize(
    "variable, code",
    [
        ("WORLD_SIZE", "accel.Kernel()"),
        ("WORLD_SIZE", "get_logger('x').warning('hi')"),
        ("RANK", "get_logger('x').warning('hi')"),
        ("LOCAL_RANK", "get_logger('x').warning('hi')"),
    ],
)
def test_non_numeric_process_variables_are_named(tmp_path: Path, variable: str, code: str) -> None:
    """Before: `ValueError: invalid literal for int() with base 10: 'two'` (the variable not named)."""
    env = clean_env(tmp_path, **{variable: "two"})
    script = (
        "import logging\nimport accel\nfrom accel.logging import get_logger\nlogging.basicConfig()\n"
        f"try:\n    {code}\nexcept accel.UsageError as exc:\n    print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"environment variable {variable} must be a whole number, got 'two'; unset it "
        "(launchers set it) or set it to a number"
    )


# ---- one validator per option, whatever the surface --------------------------------------------------------------

# (id, `accel launch` arguments or a config file (text), Kernel arguments, what the one line says on both surfaces)
SURFACES = [
    (
        "pp-microbatches-negative",
        ["--parallelism_config_pp_microbatches", "-3"],
        {"parallelism_config": {"pp_size": 1, "pp_microbatches": -3}},
        "must be at least 0, got ",
    ),
    (
        "pp-split-points-twice",
        ["--parallelism_config_pp_split_points", "layers.1,layers.1"],
        {"parallelism_config": {"pp_split_points": ["layers.1", "layers.1"]}},
        "names layers.1 more than once",
    ),
    (
        "pp-split-points-not-a-list",
        "parallelism_config:\n  parallelism_config_pp_split_points: 5\n",
        {"parallelism_config": {"pp_split_points": 5}},
        "expects a list, got 5",
    ),
    (
        "tp-size-0",
        ["--parallelism_config_tp_size", "0"],
        {"parallelism_config": {"tp_size": 0}},
        "must be at least 1, got ",
    ),
    (
        "megatron-micro-batches-0",
        "megatron_lm_config:\n  megatron_lm_num_micro_batches: 0\n",
        {"megatron_lm_num_micro_batches": 0},
        "must be at least 1, got 0",
    ),
    ("dynamo-backend-empty", ["--dynamo_backend", ""], {"dynamo_backend": ""}, "must be no or a compile mode"),
    ("mixed-precision-empty", ["--mixed_precision", ""], {"mixed_precision": ""}, "must be no or a precision mode"),
]


@pytest.mark.parametrize(("case_id", "cli", "kwargs", "needle"), SURFACES, ids=[c[0] for c in SURFACES])
@pytest.mark.requires_plugins("parallel", "dynamo")
def test_a_value_refused_on_one_surface_is_refused_on_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case_id: str, cli: list[str] | str, kwargs: dict, needle: str
) -> None:
    from accel import Kernel, UsageError

    args = cli if isinstance(cli, list) else ["--config_file", "c.yaml"]
    if isinstance(cli, str):
        (tmp_path / "c.yaml").write_text(cli)
    result = run(["launch", "--dry-run", *args, PROBE], clean_env(tmp_path, hide=False), cwd=tmp_path)
    check_one_line_error(result, [needle])
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCEL_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UsageError, match=re.escape(needle)):
        Kernel(**kwargs)
