"""Accelerate's launch flags, as a migrating user types them: every flag of `accelerate launch` 1.15 (the checked-in
list tests/data/accelerate_launch_flags.txt) is accepted with its meaning or refused in one line saying what to
use, with every plugin of this venv and with the kernel alone; booleans take Accelerate's `--flag true/false`;
Accelerate's default config file is found; `--dry-run` shows what differs from the defaults; per-rank log files;
torchrun's OMP_NUM_THREADS banner."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from clitools import TESTS, clean_env, run

from accel.distributed import free_port
from accel.testing.shadow import hide_plugins

FLAGS_FILE = TESTS / "data" / "accelerate_launch_flags.txt"
PROBE = str(TESTS / "scripts" / "cli_probe.py")
ACCELERATE_PYTHON = Path(os.environ.get("ACCEL_TEST_ACCELERATE_PYTHON", "/work/venvs/acc/bin/python"))
#: Flags whose setting has another name in accel (the name of the option they set).
SETS = {
    "tpu_cluster": "tpu_use_cluster",
    "no_tpu_cluster": "tpu_use_cluster",
    "tpu_use_sudo": "tpu_use_sudo",
    "vm": "tpu_vm",
    "env": "tpu_env",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
}
#: Switches that change how the script is started, not a setting.
NO_SETTING = {
    "quiet",
    "module",
    "no_python",
    "use_deepspeed",
    "use_fsdp",
    "use_parallelism_config",
    "use_megatron_lm",
    "tpu",
}


@dataclass(frozen=True)
class Case:
    flag: str
    value: str
    expect: str
    context: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.flag[2:]


def read_cases() -> list[Case]:
    cases = []
    for line in FLAGS_FILE.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        flag, value, expect, *context = [part.strip() for part in line.split("|")]
        cases.append(Case(flag, value, expect, tuple(" ".join(context).split())))
    return cases


CASES = read_cases()


def argv_for(case: Case, tmp_path: Path) -> list[str]:
    files = {
        "LOGS": str(tmp_path / "logs"),
        "DSCONFIG": str(tmp_path / "ds.json"),
        "HOSTFILE": str(tmp_path / "hostfile"),
    }
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": "auto"}')
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    value = [] if case.value == "-" else [files.get(case.value, case.value)]
    return ["-q", *case.context, case.flag, *value, PROBE]


def probe(argvs: list[list[str]], env: dict[str, str], tmp_path: Path) -> list[dict]:
    """Plan each launch in one process of ``env`` (nothing is started): settings set by flags, or the error."""
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps(argvs))
    proc = subprocess.run(
        [sys.executable, str(TESTS / "scripts" / "flag_probe.py"), str(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_list_is_every_flag_of_accelerate_launch():
    """The checked-in list against Accelerate's own parser, where Accelerate 1.15 is installed."""
    if not ACCELERATE_PYTHON.exists():
        pytest.skip(f"no Accelerate venv at {ACCELERATE_PYTHON} (ACCEL_TEST_ACCELERATE_PYTHON)")
    code = (
        "import accelerate; from accelerate.commands.launch import launch_command_parser as p; "
        "print(accelerate.__version__); "
        "print('\\n'.join(next(o for o in a.option_strings if o.startswith('--')) "
        "for a in p()._actions if a.option_strings and a.option_strings[0] != '-h'))"
    )
    out = subprocess.run([str(ACCELERATE_PYTHON), "-c", code], capture_output=True, text=True, check=True).stdout
    version, *flags = out.split()
    assert version.startswith("1.15")
    assert sorted(set(flags) - {"--config_file"}) == sorted(c.flag for c in CASES)


def check_case(case: Case, result: dict, loaded: set[str]) -> str | None:
    """What is wrong with one flag's outcome (None when right)."""
    error = result.get("error")
    expect = case.expect
    if expect.startswith("plugin:"):
        plugin = expect.split(":", 1)[1]
        if plugin not in loaded:
            if not error:  # an unavailable plugin may still take part (an XLA pod launch only runs gcloud here)
                return None if plugin in result["active"] else f"accepted without plugin {plugin}: {result}"
            if f"'{plugin}'" not in error or not re.search(r"pip install|cannot be used|installed but", error):
                return f"refusal does not name plugin {plugin} and how to get it: {error}"
            return None
        if error:
            return f"refused with plugin {plugin} loaded: {error}"
        if case.name not in NO_SETTING and SETS.get(case.name, case.name) not in result["flags"]:
            return f"accepted but set nothing: {result}"
        if plugin not in result["active"]:
            return f"plugin {plugin} does not take part: {result}"
        return None
    if expect == "refuse":
        if not error:
            return "accepted, expected a refusal"
        if "unrecognized" in error or case.flag not in error or len(error.splitlines()) != 1:
            return f"refusal is not specific: {error}"
        return None
    if error:
        return f"refused: {error}"
    if case.name not in NO_SETTING and SETS.get(case.name, case.name) not in result["flags"]:
        return f"accepted but set nothing: {result}"
    return None


@pytest.mark.parametrize("plugins", ["every-plugin-of-this-venv", "kernel-alone"])
def test_every_accelerate_flag_is_accepted_or_refused_in_one_line(tmp_path, plugins):
    if plugins == "kernel-alone":
        hidden = hide_plugins(tmp_path / "hidden", keep=())
        env = clean_env(tmp_path, hide=False, PYTHONPATH=str(hidden))
        loaded: set[str] = set()
    else:
        env = clean_env(tmp_path, hide=False)
        loaded = {
            "ddp",
            "deepspeed",
            "fsdp",
            "dynamo",
            "amp",
            "parallel",
        }  # xla and ipex cannot load next to torch 2.13
    results = probe([argv_for(case, tmp_path) for case in CASES], env, tmp_path)
    wrong = {
        case.flag: why
        for case, result in zip(CASES, results, strict=True)
        if (why := check_case(case, result, loaded)) is not None
    }
    assert wrong == {}


def test_boolean_flags_take_true_and_false(tmp_path):
    env = clean_env(tmp_path, hide=False)
    argvs = [
        ["--use_fsdp", "--fsdp_offload_params", "true", PROBE],
        ["--use_fsdp", "--fsdp_offload_params", "false", PROBE],
        ["--use_fsdp", "--fsdp_offload_params", PROBE],
        ["--use_fsdp", "--fsdp_offload_params=yes", PROBE],
        ["--cpu", "false", PROBE],
        ["--cpu", PROBE, "true"],  # after the script: the script's argument
        ["--use_fsdp", "false", "-n", "2", PROBE],
        ["--use_deepspeed", "true", "--zero3_init_flag", "True", PROBE],
        ["--use_fsdp", "--fsdp_offload_params", "maybe", PROBE],
    ]
    r = probe(argvs, env, tmp_path)
    assert r[0]["flags"]["fsdp_offload_params"] is True and r[0]["active"][-1:] != []
    assert r[1]["flags"]["fsdp_offload_params"] is False
    assert r[2]["flags"]["fsdp_offload_params"] is True
    assert r[3]["flags"]["fsdp_offload_params"] is True
    assert r[4]["flags"]["cpu"] is False
    assert r[5]["flags"]["cpu"] is True
    assert "fsdp" not in r[6]["active"] and "ddp" in r[6]["active"]
    assert "deepspeed" in r[7]["active"] and r[7]["flags"]["zero3_init_flag"] is True
    # "maybe" is not a boolean: it is taken for the script, which does not exist
    assert r[8] == {"error": "training script 'maybe' does not exist"}


def test_specific_refusals(tmp_path):
    env = clean_env(tmp_path, hide=False)
    argvs = [
        ["--fsdp_offload_params", "true", PROBE],  # fsdp installed but not selected
        ["--cpu", "--gpu_ids", "0", PROBE],
        ["--tee", "7", "--log_dir", str(tmp_path), PROBE],
        ["--dynamo_mode", "max-autotune", PROBE],
        ["--num_procesess", "2", PROBE],
    ]
    r = probe(argvs, env, tmp_path)
    assert r[0]["error"] == (
        "plugin 'fsdp': FSDP option(s) --fsdp_offload_params given, but FSDP is not selected; "
        "add --plugin fsdp (or --use_fsdp, or Kernel(plugins=['fsdp']))"
    )
    assert r[1]["error"] == ("--cpu and --gpu_ids 0 contradict each other: --cpu trains on the CPU; drop one of them")
    assert r[2]["error"].startswith("--tee expects 0 (none), 1 (stdout), 2 (stderr), 3 (both)")
    assert r[3]["error"] == (
        "--dynamo_mode is an option of plugin 'dynamo', which does not take part in this run; "
        "select it (--plugin dynamo) or drop the flag"
    )
    assert "did you mean `--num_processes`?" in r[4]["error"]


def test_flags_of_an_uninstalled_plugin_say_which_package(tmp_path):
    env = clean_env(tmp_path)  # ddp only
    for args, plugin in (
        (["--zero_stage", "2"], "deepspeed"),
        (["--fsdp_offload_params", "true"], "fsdp"),
        (["--use_deepspeed"], "deepspeed"),
        (["--dynamo_mode", "default"], "dynamo"),
    ):
        result = run(["launch", "--dry-run", *args, PROBE], env)
        assert result.returncode == 2, result
        assert len(result.err_lines) == 1 and f"pip install accel-plugin-{plugin}" in result.stderr, result
    tpu = run(["launch", "--dry-run", "--tpu", PROBE], env)
    assert tpu.returncode == 2 and "did you mean" not in tpu.stderr and "accel-plugin-xla" in tpu.stderr, tpu


# ---- flags that act: seen in --dry-run --------------------------------------------------------------------------


def dry(args: list[str], env: dict[str, str]) -> str:
    result = run(["launch", "--dry-run", "-q", *args, PROBE], env)
    assert result.returncode == 0, result
    return result.stdout


def test_dry_run_shows_what_the_flags_do(tmp_path):
    env = clean_env(tmp_path, hide=False)
    logs = tmp_path / "logs"
    out = dry(
        [
            "-n",
            "2",
            "--main_process_port",
            "29561",
            "--tee",
            "1",
            "--log_dir",
            str(logs),
            "--role",
            "trainer",
            "--rdzv_conf",
            "timeout=60",
            "--gradient_accumulation_steps",
            "4",
            "--enable_cpu_affinity",
            "false",
        ],
        env,
    )
    launcher = next(line for line in out.splitlines() if line.startswith("launcher: "))
    for part in (f"--log_dir={logs}", "--tee=1", "--role=trainer", "--rdzv_conf=timeout=60"):
        assert part in launcher, (part, launcher)
    assert '"gradient_accumulation_steps": 4' in out  # handed to the Kernel of every process
    fsdp = dry(["--use_fsdp", "--fsdp_offload_params", "true"], env)
    assert "active plugins: fsdp (strategy)" in fsdp and "  fsdp_offload_params = True (flag)" in fsdp
    ds = dry(["--use_deepspeed", "--zero_stage", "3"], env)
    assert "deepspeed (strategy)" in ds and "  zero_stage = 3 (flag)" in ds


def test_dry_run_lists_only_what_differs_from_the_defaults(tmp_path):
    env = clean_env(tmp_path)
    short = dry(["-n", "2", "--main_process_port", "29562"], env)
    block = short.split("settings", 1)[1].splitlines()
    shown = list(itertools.takewhile(lambda line: line.startswith("  "), block[1:]))
    assert shown == ["  main_process_port = 29562 (flag)", "  num_processes = 2 (flag)"]
    assert re.match(r" \(value, where it came from; \d+ more at their defaults, --verbose lists them\):", block[0])
    full = dry(["-n", "2", "--main_process_port", "29562", "--verbose"], env)
    assert "  max_restarts = 0 (default)" in full and full.count(" (default)\n") > 30


def test_enable_cpu_affinity_without_a_gpu_says_it_does_nothing(tmp_path):
    result = run(["launch", "--dry-run", "--enable_cpu_affinity", PROBE], clean_env(tmp_path))
    assert result.returncode == 0, result
    assert (
        "accel: --enable_cpu_affinity binds each process to the CPUs next to its GPU; there is no GPU here, so "
        "it does nothing" in result.err_lines
    )


# ---- Accelerate's default config ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["HOME", "XDG_CACHE_HOME", "HF_HOME"])
def test_accelerates_default_config_is_used_when_accel_has_none(tmp_path, where):
    env = clean_env(tmp_path)
    places = {
        "HOME": Path(env["HOME"]) / ".cache" / "huggingface",
        "XDG_CACHE_HOME": tmp_path / "xdg" / "huggingface",
        "HF_HOME": tmp_path / "hf",
    }
    if where == "XDG_CACHE_HOME":
        env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    if where == "HF_HOME":
        env["HF_HOME"] = str(tmp_path / "hf")
    config = places[where] / "accelerate" / "default_config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n"
        "use_cpu: true\nmixed_precision: 'no'\nmain_process_port: 29563\n"
    )
    result = run(["launch", "--dry-run", PROBE], env)
    assert result.returncode == 0, result
    assert result.err_lines == [
        f"accel: using Accelerate's default config file {config}, as accel has none of its "
        "own (--config_file FILE picks another; `accel config` writes accel's)"
    ]
    assert "  num_processes = 2 (file)" in result.stdout and "--nproc_per_node=2" in result.stdout
    # accel's own default config wins
    Path(env["ACCEL_HOME"], "default_config.yaml").write_text("num_processes: 1\n")
    own = run(["launch", "--dry-run", PROBE], env)
    assert "Accelerate's" not in own.stderr and "  num_processes = 1 (file)" in own.stdout


# ---- real runs: per-rank logs, torchrun's banner --------------------------------------------------------------------

FAILS_ON_RANK_1 = """
from accel import Kernel
kernel = Kernel()
print(f"hello from {kernel.process_index}", flush=True)
if kernel.process_index == 1:
    raise ValueError("boom on rank 1")
kernel.end_training()
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_failed_process_is_named_with_its_log_file(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(FAILS_ON_RANK_1)
    logs = tmp_path / "logs"
    result = run(
        [
            "launch",
            "-q",
            "--cpu",
            "-n",
            "2",
            "--main_process_port",
            str(free_port()),
            "--log_dir",
            str(logs),
            str(script),
        ],
        clean_env(tmp_path),
    )
    assert result.returncode == 1, result
    last = result.err_lines[-1]
    # rank 0 may fail too (its end_training meets a closed connection) before torchrun polls: then the line says so
    match = re.fullmatch(
        r"accel: process 1 of 2 exited with code 1( \(1 more failed after it\))?; its output: (\S+)", last
    )
    assert match, f"last line: {last!r}\n{result}"
    log = Path(match.group(2))
    assert log.is_relative_to(logs) and log.name == "stderr.log" and log.parent.name == "1"
    assert "ValueError: boom on rank 1" in log.read_text()
    assert "hello from 1" in (log.parent / "stdout.log").read_text()
    assert "hello from 0" in result.stdout  # --log_dir alone: the console still shows the output (tee 3)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_launch_leaves_nothing_in_the_temp_directory(tmp_path):
    """torchrun on its own leaves a folder in the temp directory on every run (torchelastic_*); accel launch removes
    its own folder (torchrun's run records, the failure times) whether the processes succeed or fail."""
    temp = tmp_path / "temp"
    temp.mkdir()
    fails = tmp_path / "fails.py"
    fails.write_text(FAILS_ON_RANK_1)
    works = tmp_path / "works.py"
    works.write_text(FAILS_ON_RANK_1.replace("raise ValueError", "print"))
    env = clean_env(tmp_path, TMPDIR=str(temp))
    for script, code in ((works, 0), (fails, 1)):
        result = run(["launch", "-q", "--cpu", "-n", "2", "--main_process_port", str(free_port()), str(script)], env)
        assert result.returncode == code, result
        assert "hello from 0" in result.stdout and "hello from 1" in result.stdout, result
        assert sorted(p.name for p in temp.iterdir()) == [], f"{script.name} left these in the temp directory"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_no_omp_banner_and_one_thread_per_process(tmp_path):
    script = tmp_path / "threads.py"
    script.write_text(
        "import os, sys, torch\nfrom accel import Kernel\nk = Kernel()\n"
        # one write per line: workers run `python -u`, where print's pieces are separate writes that the two
        # processes interleave on the shared pipe
        "sys.stdout.write(f\"THREADS {os.environ['OMP_NUM_THREADS']} {torch.get_num_threads()}\\n\")\n"
        "k.end_training()\n"
    )
    env = clean_env(tmp_path)
    del env["OMP_NUM_THREADS"]
    result = run(["launch", "-q", "--cpu", "-n", "2", "--main_process_port", str(free_port()), str(script)], env)
    assert result.returncode == 0, result
    assert "OMP_NUM_THREADS" not in result.stderr and "*****" not in result.stderr, result
    assert result.stdout.count("THREADS 1 1") == 2, result
