"""Bad input to `accel launch`: each case is one clear line on stderr, exit code 2, no traceback, nothing on stdout,
nothing written anywhere under the test's directory (the working directory, ACCEL_HOME and HOME are all in it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from clitools import GOOD_AND_BROKEN, TESTS, clean_env, install, pythonpath, run

PROBE = str(TESTS / "scripts" / "cli_probe.py")

# (id, config file text or None, arguments before the script, script, extra env, substrings of the error line)
CASES = [
    (
        "malformed-yaml",
        "num_processes: [1, 2\nmixed_precision: no\n",
        [],
        PROBE,
        {},
        ["config.yaml: malformed YAML at line"],
    ),
    ("yaml-not-a-mapping", "- num_processes\n- 2\n", [], PROBE, {}, ["expected a mapping of keys to values"]),
    (
        "unknown-config-key",
        "num_proceses: 2\n",
        [],
        PROBE,
        {},
        ["unknown key `num_proceses`; did you mean `num_processes`?"],
    ),
    (
        "unknown-nested-key",
        "dynamo_config:\n  dynamo_backnd: inductor\n",
        [],
        PROBE,
        {},
        ["unknown key `dynamo_config.dynamo_backnd`; did you mean `dynamo_backend`?"],
    ),
    ("wrong-type", "num_processes: two\n", [], PROBE, {}, ["`num_processes` expects a whole number, got 'two'"]),
    ("wrong-type-bool", "use_cpu: maybe\n", [], PROBE, {}, ["`use_cpu` expects true or false, got 'maybe'"]),
    (
        "config-mixed-precision",
        "mixed_precision: fp17\n",
        [],
        PROBE,
        {},
        ["`mixed_precision` must be no or a precision mode a plugin provides, got 'fp17'", "did you mean `fp16`?"],
    ),
    (
        "config-file-missing",
        None,
        ["--config_file", "nowhere.yaml"],
        PROBE,
        {},
        ["config file 'nowhere.yaml' does not exist"],
    ),
    ("num-processes-0", None, ["--num_processes", "0"], PROBE, {}, ["`--num_processes` must be at least 1, got '0'"]),
    ("num-processes-word", None, ["-n", "two"], PROBE, {}, ["`--num_processes` expects a whole number, got 'two'"]),
    (
        "machine-rank-out-of-range",
        None,
        ["--machine_rank", "2", "--num_machines", "2", "--main_process_ip", "127.0.0.1"],
        PROBE,
        {},
        ["--machine_rank 2 is out of range for --num_machines 2 (ranks go from 0 to 1)"],
    ),
    ("several-machines-without-ip", None, ["--num_machines", "2", "-n", "2"], PROBE, {}, ["needs --main_process_ip"]),
    (
        "processes-not-a-multiple-of-machines",
        None,
        ["--num_machines", "2", "-n", "3", "--main_process_ip", "127.0.0.1"],
        PROBE,
        {},
        ["not a multiple of"],
    ),
    (
        "port-too-large",
        None,
        ["--main_process_port", "70000"],
        PROBE,
        {},
        ["`--main_process_port` must be at most 65535, got '70000'"],
    ),
    (
        "port-not-a-number",
        None,
        ["--main_process_port", "http"],
        PROBE,
        {},
        ["`--main_process_port` expects a whole number, got 'http'"],
    ),
    ("port-negative-in-config", "main_process_port: -1\n", [], PROBE, {}, ["`main_process_port` must be at least 0"]),
    ("missing-script", None, [], "missing.py", {}, ["training script 'missing.py' does not exist"]),
    ("no-script", None, [], None, {}, ["no training script given"]),
    ("unknown-plugin", None, ["--plugin", "nope"], PROBE, {}, ["unknown plugin 'nope' (installed: ", "ddp"]),
    (
        "mixed-precision-fp17",
        None,
        ["--mixed_precision", "fp17"],
        PROBE,
        {},
        ["`--mixed_precision` must be no or a precision mode a plugin provides, got 'fp17'", "did you mean `fp16`?"],
    ),
    (
        "mixed-precision-env",
        None,
        [],
        PROBE,
        {"ACCEL_MIXED_PRECISION": "fp17"},
        ["environment variable ACCEL_MIXED_PRECISION must be no or a precision mode a plugin provides"],
    ),
    ("rdzv-backend", None, ["--rdzv_backend", "c10"], PROBE, {}, ["did you mean `c10d`?"]),
    (
        "unknown-flag",
        None,
        ["--num_procs", "2"],
        PROBE,
        {},
        ["unrecognized argument '--num_procs'; did you mean `--num_processes`?"],
    ),
    ("p-without-no", None, ["-p", "ddp"], PROBE, {}, ["-p expects no:NAME"]),
    (
        "not-local-machine",
        "compute_environment: AMAZON_SAGEMAKER\n",
        [],
        PROBE,
        {},
        ["compute_environment AMAZON_SAGEMAKER is not supported"],
    ),
]


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def check_one_line_error(result, needles: list[str]) -> str:
    assert result.returncode == 2, result
    assert len(result.err_lines) == 1, result
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result
    assert result.stdout == "", result
    line = result.err_lines[0]
    assert line.startswith("accel: error: "), result
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def run_bad(tmp_path: Path, args: list[str], config: str | None, env_extra: dict[str, str], site: str = "") -> tuple:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    if config is not None:
        (work / "config.yaml").write_text(config)
        args = ["--config_file", "config.yaml", *args]
    env = clean_env(tmp_path, ACCEL_PLUGINS="ddp,hello,broken", **env_extra, **({"PYTHONPATH": site} if site else {}))
    before = snapshot(tmp_path)
    result = run(["launch", *args], env, cwd=work)
    assert snapshot(tmp_path) == before, "something was written"
    return result


@pytest.mark.parametrize("case_id, config, flags, script, env_extra, needles", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2(tmp_path, case_id, config, flags, script, env_extra, needles):
    args = [*flags, *([script] if script else [])]
    check_one_line_error(run_bad(tmp_path, args, config, env_extra), needles)


def test_unknown_plugin_we_publish_gives_the_pip_hint(tmp_path):
    # published plugins other than ddp are hidden from these runs (clitools.clean_env)
    line = check_one_line_error(
        run_bad(tmp_path, ["--plugin", "fsdp", PROBE], None, {}), ["unknown plugin 'fsdp' (installed: ", "ddp"]
    )
    assert line.endswith("; install it with `pip install accel-plugin-fsdp`")


def test_unknown_plugin_lists_installed_ones_with_status(tmp_path):
    site = pythonpath(install(*GOOD_AND_BROKEN))
    line = check_one_line_error(
        run_bad(tmp_path, ["--plugin", "helo", PROBE], None, {}, site),
        ["unknown plugin 'helo'", "did you mean `hello`?"],
    )
    for shown in ("ddp, ", "hello, ", "broken (failed)", "leaky (disabled)", "misspelt (disabled)"):
        assert shown in line, (shown, line)


def test_plugin_import_error_when_requested(tmp_path):
    site = pythonpath(install(*GOOD_AND_BROKEN))
    check_one_line_error(
        run_bad(tmp_path, ["--plugin", "broken", PROBE], None, {}, site),
        ["plugin 'broken' (accel-plugin-broken 0.1.0) cannot be used: import failed: RuntimeError"],
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["plugins", "--jsn"], "did you mean `--json`?"),
        (["plugins", "-p", "hello"], "-p expects no:NAME"),
        (["env", "--bogus"], "unrecognized argument '--bogus'"),
    ],
)
def test_other_commands_bad_flags(tmp_path, args, needle):
    env = clean_env(tmp_path)
    before = snapshot(tmp_path)
    check_one_line_error(run(args, env, cwd=tmp_path), [needle])
    assert snapshot(tmp_path) == before


def test_bad_input_through_python_m(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    result = run(["--num_processes", "0", PROBE], clean_env(tmp_path), cwd=work, python_m="accel.commands.launch")
    check_one_line_error(result, ["`--num_processes` must be at least 1"])
    assert os.listdir(work) == []
