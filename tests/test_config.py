"""`--config_file`: YAML read with yaml.safe_load using Accelerate's keys. The files below reproduce what Accelerate
writes (its interactive `accelerate config`, `accelerate config default`, and the templates in
examples/config_yaml_templates: multi_gpu, multi_node, fsdp, deepspeed; see /work/shared/reference/accelerate.md §2).
The published plugins other than ddp are hidden from these runs (kernel/src/accel/testing/shadow.py), so FSDP, DeepSpeed, amp
and dynamo count as not installed whatever this environment has."""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

import pytest
from clitools import GOOD_AND_BROKEN, TESTS, clean_env, install, pythonpath, run

from accel.options import known_plugins

PROBE = str(TESTS / "scripts" / "cli_probe.py")

# `accelerate config` -> This machine -> No distributed training -> defaults (accelerate.md §2.2, verbatim keys)
SINGLE_NO = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: 'NO'
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 1
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""

# `accelerate config default` on a CPU-only machine writes JSON text into default_config.yaml
DEFAULT_JSON = """\
{
  "compute_environment": "LOCAL_MACHINE",
  "debug": false,
  "distributed_type": "NO",
  "downcast_bf16": false,
  "enable_cpu_affinity": false,
  "machine_rank": 0,
  "main_training_function": "main",
  "mixed_precision": "no",
  "num_machines": 1,
  "num_processes": 1,
  "rdzv_backend": "static",
  "same_network": false,
  "tpu_use_cluster": false,
  "tpu_use_sudo": false,
  "use_cpu": true
}
"""

# `accelerate config` -> This machine -> multi-CPU, 1 machine, 2 processes
MULTI_CPU = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_process_port: 29541
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""

# examples/config_yaml_templates/multi_gpu.yaml
MULTI_GPU = """\
# Specify distributed_type as `MULTI_GPU` for DDP
distributed_type: "MULTI_GPU"
# Can be one of "no", "fp16", or "bf16" (see `transformer_engine.yaml` for `fp8`)
mixed_precision: "bf16"
# Specify the number of GPUs to use
num_processes: 2
"""

# examples/config_yaml_templates/multi_node.yaml
MULTI_NODE = """\
distributed_type: MULTI_GPU
machine_rank: 0
main_process_ip: '1234'
main_process_port: 9999
num_machines: 2
num_processes: 8
rdzv_backend: static # or c10d
same_network: false
"""

# examples/config_yaml_templates/fsdp.yaml
FSDP = """\
distributed_type: FSDP
mixed_precision: 'bf16'
num_processes: 2
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_use_orig_params: true
"""

# examples/config_yaml_templates/deepspeed.yaml
DEEPSPEED = """\
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: ../deepspeed_config_templates/zero_stage1_config.json
  zero3_init_flag: false # true

num_processes: 2
# mixed_precision: "bf16"
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return clean_env(tmp_path)


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def settings_of(stdout: str) -> dict[str, str]:
    block = stdout.split("\nsettings (", 1)[1].splitlines()[1:]  # settings not at defaults, then the launcher line
    return dict(line.strip().split(" = ", 1) for line in itertools.takewhile(lambda x: x.startswith("  "), block))


def launcher_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("launcher: "))


def dry_run(env: dict[str, str], config: str, *flags: str):
    result = run(["launch", "--dry-run", "--config_file", config, *flags, PROBE], env)
    assert result.returncode == 0, result
    return result


def one_error(result, *needles: str) -> str:
    assert result.returncode == 2, result
    assert len(result.err_lines) == 1, result
    assert "Traceback" not in result.stderr + result.stdout and result.stdout == "", result
    for needle in needles:
        assert needle in result.err_lines[0], (needle, result.err_lines[0])
    return result.err_lines[0]


def hint(name: str) -> str:
    return f"`pip install {known_plugins()['plugins'][name]['distribution']}`"


# ---- files written by Accelerate are accepted ------------------------------------------------------------------------


def test_single_machine_no(env, tmp_path):
    result = dry_run(env, write(tmp_path, SINGLE_NO))
    values = settings_of(result.stdout)
    assert values["distributed_type"] == "'NO' (file)"
    assert values["num_processes"] == "1 (file)" and values["gpu_ids"] == "'all' (file)"
    assert values["same_network"] == "True (file)" and values["cpu"] == "False (file)"
    assert "active plugins: none (kernel only)" in result.stdout
    assert launcher_line(result.stdout).startswith("launcher: accel (one process)")
    assert result.stderr == ""  # tpu_*/downcast_bf16 are off: ignored without a note


def test_accelerate_config_default_json_in_yaml(env, tmp_path):
    result = dry_run(env, write(tmp_path, DEFAULT_JSON, "default_config.yaml"))
    values = settings_of(result.stdout)
    assert values["cpu"] == "True (file)" and values["same_network"] == "False (file)"
    assert result.stderr == ""


def test_found_as_the_default_config_file(env):
    Path(env["ACCEL_HOME"], "default_config.yaml").write_text(SINGLE_NO)
    result = run(["launch", "--dry-run", PROBE], env)
    assert result.returncode == 0, result
    assert settings_of(result.stdout)["distributed_type"] == "'NO' (file)"
    assert len(result.err_lines) == 1 and "using the default config file" in result.err_lines[0]


def test_multi_cpu_selects_ddp_and_starts_two_processes(env, tmp_path):
    result = dry_run(env, write(tmp_path, MULTI_CPU))
    assert "active plugins: ddp (strategy)" in result.stdout
    command = launcher_line(result.stdout)
    assert "--nproc_per_node=2" in command and "--master_port=29541" in command and "--nnodes=1" in command
    assert settings_of(result.stdout)["cpu"] == "True (file)"


def test_multi_gpu_template(env, tmp_path):
    # mixed_precision bf16 needs a precision plugin: one line naming what to install (or why it is unavailable)
    one_error(
        run(["launch", "--config_file", write(tmp_path, MULTI_GPU), PROBE], env),
        "mixed_precision=bf16 needs a plugin that provides 'precision:bf16'",
        hint("amp"),
    )
    # the same file without mixed precision runs DDP with 2 processes
    result = dry_run(env, write(tmp_path, MULTI_GPU.replace('"bf16"', '"no"')))
    assert "active plugins: ddp (strategy)" in result.stdout
    assert "--nproc_per_node=2" in launcher_line(result.stdout)


def test_multi_node_template_and_flags_beating_it(env, tmp_path):
    config = write(tmp_path, MULTI_NODE)
    command = launcher_line(dry_run(env, config).stdout)
    for part in ("--nnodes=2", "--nproc_per_node=4", "--node_rank=0", "--master_addr=1234", "--master_port=9999"):
        assert part in command, (part, command)
    command = launcher_line(dry_run(env, config, "--machine_rank", "1", "--rdzv_backend", "c10d").stdout)
    assert "--rdzv_backend=c10d" in command and "--rdzv_endpoint=1234:9999" in command


@pytest.mark.parametrize("text, name, kind", [(FSDP, "fsdp", "FSDP"), (DEEPSPEED, "deepspeed", "DEEPSPEED")])
def test_distributed_type_needing_a_missing_plugin_is_one_line(env, tmp_path, text, name, kind):
    line = one_error(
        run(["launch", "--config_file", write(tmp_path, text), PROBE], env),
        f"distributed_type {kind} needs plugin '{name}', which is not installed",
    )
    assert line.startswith("accel: error: ") and line.endswith(f"; install it with {hint(name)}")


def test_sections_of_missing_plugins_are_ignored_with_a_note(env, tmp_path):
    text = MULTI_CPU + FSDP.split("num_processes: 2\n", 1)[1] + DEEPSPEED.split("\n", 1)[1].split("\nnum_processes")[0]
    result = dry_run(env, write(tmp_path, text))
    assert "active plugins: ddp (strategy)" in result.stdout
    assert len(result.err_lines) == 1, result
    note = result.err_lines[0]
    assert note.startswith("accel: ignoring config keys: ")
    assert "`fsdp_config` (needs accel-plugin-fsdp, not installed)" in note, note
    assert "`deepspeed_config` (needs accel-plugin-deepspeed, not installed)" in note, note


def test_sections_of_disabled_plugins_are_ignored_with_the_reason(tmp_path):
    site = pythonpath(install(*GOOD_AND_BROKEN))
    config = write(tmp_path, "hello_greeting: salut\n")
    # hello is not a published plugin: its key is unknown once it is disabled (nothing says who owns it) ...
    one_error(
        run(["launch", "--config_file", config, "-p", "no:hello", PROBE], clean_env(tmp_path, PYTHONPATH=site)),
        "unknown key `hello_greeting`",
    )
    # ... while a published plugin's section is ignored with the reason it is unavailable
    env = clean_env(tmp_path, ACCEL_PLUGINS="")
    result = dry_run(env, write(tmp_path, "num_processes: 1\nfsdp_config:\n  fsdp_version: 2\n"))
    assert result.err_lines[0] == "accel: ignoring config keys: `fsdp_config` (needs accel-plugin-fsdp, not installed)"
    result = dry_run(env, write(tmp_path, "num_processes: 1\nddp_backend: gloo\n"))
    assert result.err_lines[0] == (
        "accel: ignoring config keys: `ddp_backend` (plugin 'ddp' is disabled: not in ACCEL_PLUGINS)"
    )


def test_dynamo_config_needs_a_compile_plugin(env, tmp_path):
    text = (
        SINGLE_NO
        + "dynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_mode: default\n  dynamo_use_fullgraph: false\n"
    )
    line = one_error(
        run(["launch", "--config_file", write(tmp_path, text), PROBE], env),
        "dynamo_backend=INDUCTOR",
        "provides 'compile:INDUCTOR'",
    )
    assert line.endswith(hint("dynamo")), line
    text = SINGLE_NO + "dynamo_config:\n  dynamo_backend: 'NO'\n"
    assert settings_of(dry_run(env, write(tmp_path, text)).stdout)["dynamo_backend"] == "'NO' (file)"


def test_unquoted_no_is_read_as_no(env, tmp_path):
    # YAML 1.1 reads an unquoted NO as false; Accelerate quotes it, hand-written files often don't
    result = dry_run(env, write(tmp_path, "distributed_type: NO\nmixed_precision: no\n"))
    values = settings_of(result.stdout)
    assert values["distributed_type"] == "'NO' (file)" and values["mixed_precision"] == "'no' (file)"


def test_plugin_keys_are_accepted_when_the_plugin_is_installed(tmp_path):
    config = write(tmp_path, "hello_greeting: salut\nplugins: [hello]\n")
    site = pythonpath(install(*GOOD_AND_BROKEN))
    env = clean_env(tmp_path, PYTHONPATH=site, ACCEL_PLUGINS="ddp,hello")
    result = dry_run(env, config)
    assert settings_of(result.stdout)["hello_greeting"] == "'salut' (file)"
    assert "active plugins: hello (observer)" in result.stdout
    env = clean_env(tmp_path, PYTHONPATH=site, ACCEL_PLUGINS="ddp")
    one_error(run(["launch", "--config_file", config, PROBE], env), "unknown key `hello_greeting`")


def test_json_config_file(env, tmp_path):
    result = dry_run(env, write(tmp_path, '{"num_processes": 2, "main_process_port": 29542}', "config.json"))
    assert "--nproc_per_node=2" in launcher_line(result.stdout)


# an Accelerate file from before `mixed_precision` and `dynamo_config` existed (Accelerate still reads it)
LEGACY = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
dynamo_backend: 'NO'
fp16: false
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
num_machines: 1
num_processes: 2
"""


def test_legacy_accelerate_keys_are_read(env, tmp_path):
    result = dry_run(env, write(tmp_path, LEGACY), "--verbose")  # every setting, defaults included
    values = settings_of(result.stdout)
    assert values["dynamo_backend"] == "'NO' (file)" and values["main_process_ip"] == "None (default)"
    assert "--nproc_per_node=2" in launcher_line(result.stdout)
    assert len(result.err_lines) == 1 and "read old Accelerate keys" in result.err_lines[0], result
    assert "removed legacy `fp16: False`" in result.err_lines[0]
    # `fp16: true` means mixed_precision fp16, which needs a precision plugin
    one_error(
        run(["launch", "--config_file", write(tmp_path, LEGACY.replace("fp16: false", "fp16: true")), PROBE], env),
        "mixed_precision=fp16 needs a plugin",
        hint("amp"),
    )
