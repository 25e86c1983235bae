"""`accel config` driven through a real pseudo-terminal along every branch of its tree of choices (machine type,
strategy, each strategy's own questions from its plugin, compilation, processes, devices, precision), with arrow keys
in the menus, Enter on every offered default (empty ones included), bad answers refused and asked again; then each
written file is launched: for real on the CPU (`accel launch --config_file FILE train.py`, a tiny training step on
every process), with `--dry-run` where the file asks for hardware this machine lacks (GPUs, other machines).

The real strategy plugins are visible (ddp, fsdp, deepspeed, amp, dynamo), the others hidden."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_config_command import CLEAR, DOWN, Terminal

from accel.testing.shadow import hide_plugins

pexpect = pytest.importorskip("pexpect")

VISIBLE = ("ddp", "fsdp", "deepspeed", "amp", "dynamo")
ENTER = "\r"

TRAIN = """\
import torch
from torch.utils.data import DataLoader, TensorDataset
from accel import Kernel

kernel = Kernel()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), batch_size=4)
model, optimizer, loader = kernel.prepare(model, optimizer, loader)
for x, y in loader:
    with kernel.autocast():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    kernel.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
print(f"TRAINED rank={kernel.process_index} world={kernel.num_processes} mp={kernel.mixed_precision} "
      f"components={sorted(c.name + ':' + c.role for c in kernel.components)}", flush=True)
kernel.end_training()
"""

# A path through the tree: (id, [(prompt regex, keys)], expected values in the written file (dotted keys),
# how to launch it: "run" (for real, with the strings the workers must print) or "dry" (with strings of the plan)).
Step = tuple[str, str]
MACHINE, MACHINES, DEBUG = "Which type of machine", "How many different machines", "Should distributed operations"
STRATEGY, DYNAMO, PROCS = "Which training strategy", "optimize your script with torch dynamo", "How many processes"
PRECISION, CPU_ONLY, GPUS = "Do you wish to use mixed precision", "run your training on CPU only", r"What GPU\(s\)"
FSDP_COMMON: list[Step] = [
    ("reshard the parameters after the forward", ENTER),
    ("offload parameters and gradients", ENTER),
]
FSDP_TAIL: list[Step] = [("state dict type", ENTER), ("CPU RAM efficient", ENTER), ("activation checkpointing", ENTER)]
MULTI_CPU: list[Step] = [(MACHINE, DOWN + ENTER), (MACHINES, ENTER), (DEBUG, ENTER)]

PATHS: list[tuple[str, list[Step], dict[str, Any], str, list[str]]] = [
    (
        "one-process-cpu",
        [(MACHINE, ENTER), (CPU_ONLY, ENTER), (DYNAMO, ENTER), (PRECISION, ENTER)],
        {"distributed_type": "NO", "use_cpu": True, "mixed_precision": "no", "num_processes": 1},
        "run",
        ["TRAINED rank=0 world=1 mp=no"],
    ),
    (
        "one-process-cpu-dynamo-eager-bf16",
        [
            (MACHINE, ENTER),
            (CPU_ONLY, ENTER),
            (DYNAMO, DOWN + ENTER),
            ("Which dynamo backend", DOWN + ENTER),
            ("customize the defaults sent to torch.compile", "y"),
            ("Which mode", ENTER),
            ("fullgraph mode", ENTER),
            ("dynamic shape tracing", ENTER),
            ("regional compilation", ENTER),
            (PRECISION, DOWN * 2 + ENTER),
        ],
        {"dynamo_config.dynamo_backend": "eager", "dynamo_config.dynamo_mode": "default", "mixed_precision": "bf16"},
        "run",
        ["TRAINED rank=0 world=1 mp=bf16", "dynamo:compiler", "amp:precision"],
    ),
    (
        "multi-cpu-data-parallel",
        [*MULTI_CPU, (STRATEGY, ENTER), (DYNAMO, ENTER), (PROCS, ENTER), (PRECISION, ENTER)],
        {"distributed_type": "MULTI_CPU", "use_cpu": True, "num_processes": 2},
        "run",
        ["TRAINED rank=0 world=2", "TRAINED rank=1 world=2", "ddp:strategy"],
    ),
    (
        "multi-cpu-data-parallel-fp16",
        [*MULTI_CPU, (STRATEGY, ENTER), (DYNAMO, ENTER), (PROCS, CLEAR + "2" + ENTER), (PRECISION, DOWN + ENTER)],
        {"distributed_type": "MULTI_CPU", "mixed_precision": "fp16"},
        "run",
        ["TRAINED rank=1 world=2 mp=fp16", "amp:precision"],
    ),
    (
        "multi-cpu-fsdp-transformer-wrap-left-empty",
        [
            *MULTI_CPU,
            (STRATEGY, DOWN * 2 + ENTER),
            *FSDP_COMMON,
            ("auto wrap policy", ENTER),
            ("transformer layer class names", ENTER),
            *FSDP_TAIL,
            (DYNAMO, ENTER),
            (PROCS, ENTER),
            (PRECISION, DOWN * 2 + ENTER),
        ],
        {
            "distributed_type": "FSDP",
            "use_cpu": True,
            "fsdp_config.fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_config.fsdp_transformer_layer_cls_to_wrap": [],
            "mixed_precision": "bf16",
        },
        "run",
        ["TRAINED rank=0 world=2 mp=bf16", "TRAINED rank=1 world=2", "fsdp:strategy"],
    ),
    (
        "multi-cpu-fsdp-size-wrap",
        [
            *MULTI_CPU,
            (STRATEGY, DOWN * 2 + ENTER),
            ("reshard the parameters after the forward", "n"),
            ("offload parameters and gradients", ENTER),
            ("auto wrap policy", DOWN + ENTER),
            ("minimum number of parameters", CLEAR + "100" + ENTER),
            ("state dict type", DOWN + ENTER),
            ("CPU RAM efficient", ENTER),
            ("activation checkpointing", "y"),
            (DYNAMO, ENTER),
            (PROCS, ENTER),
            (PRECISION, ENTER),
        ],
        {
            "distributed_type": "FSDP",
            "fsdp_config.fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
            "fsdp_config.fsdp_min_num_params": 100,
            "fsdp_config.fsdp_reshard_after_forward": False,
            "fsdp_config.fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_config.fsdp_activation_checkpointing": True,
        },
        "run",
        ["TRAINED rank=1 world=2 mp=no", "fsdp:strategy"],
    ),
    (
        "multi-cpu-fsdp-no-wrap",
        [
            *MULTI_CPU,
            (STRATEGY, DOWN * 2 + ENTER),
            *FSDP_COMMON,
            ("auto wrap policy", DOWN * 2 + ENTER),
            *FSDP_TAIL,
            (DYNAMO, ENTER),
            (PROCS, ENTER),
            (PRECISION, ENTER),
        ],
        {"fsdp_config.fsdp_auto_wrap_policy": "NO_WRAP"},
        "run",
        ["TRAINED rank=1 world=2", "fsdp:strategy"],
    ),
    (
        "multi-cpu-deepspeed-zero2",
        [
            *MULTI_CPU,
            (STRATEGY, DOWN + ENTER),
            ("json file to a DeepSpeed config", ENTER),
            ("ZeRO optimization stage", ENTER),
            ("offload optimizer states", ENTER),
            ("gradient accumulation steps", ENTER),
            ("gradient clipping", "y"),
            ("clipping value", ENTER),
            (DYNAMO, ENTER),
            (PROCS, ENTER),
            (PRECISION, DOWN * 2 + ENTER),
        ],
        {
            "distributed_type": "DEEPSPEED",
            "use_cpu": True,
            "deepspeed_config.zero_stage": 2,
            "deepspeed_config.gradient_clipping": 1.0,
            "mixed_precision": "bf16",
        },
        "run",
        ["TRAINED rank=0 world=2 mp=bf16", "TRAINED rank=1 world=2", "deepspeed:strategy"],
    ),
    (
        "multi-cpu-deepspeed-zero3",
        [
            *MULTI_CPU,
            (STRATEGY, DOWN + ENTER),
            ("json file to a DeepSpeed config", "n"),
            ("ZeRO optimization stage", DOWN + ENTER),
            ("offload optimizer states", ENTER),
            ("offload parameters", ENTER),
            ("gradient accumulation steps", ENTER),
            ("gradient clipping", ENTER),
            ("save 16-bit model weights", "y"),
            ("deepspeed.zero.Init", ENTER),
            (DYNAMO, ENTER),
            (PROCS, ENTER),
            (PRECISION, ENTER),
        ],
        {
            "deepspeed_config.zero_stage": 3,
            "deepspeed_config.zero3_save_16bit_model": True,
            "deepspeed_config.zero3_init_flag": False,
        },
        "run",
        ["TRAINED rank=1 world=2 mp=no", "deepspeed:strategy"],
    ),
    (
        "multi-cpu-deepspeed-json-file",
        [
            *MULTI_CPU,
            (STRATEGY, DOWN + ENTER),
            ("json file to a DeepSpeed config", "y"),
            ("path to the json DeepSpeed config file", CLEAR + "{ds_json}" + ENTER),
            ("deepspeed.zero.Init", ENTER),
            (DYNAMO, ENTER),
            (PROCS, ENTER),
            (PRECISION, ENTER),
        ],
        {"deepspeed_config.deepspeed_config_file": "{ds_json}"},
        "run",
        ["TRAINED rank=1 world=2", "deepspeed:strategy"],
    ),
    (
        "multi-node-bad-address-and-port-asked-again",
        [
            (MACHINE, DOWN + ENTER),
            (MACHINES, CLEAR + "2" + ENTER),
            ("rank of this machine", DOWN + ENTER),
            ("IP address of the machine", "not an ip!" + ENTER),
            ("must be an IP address .10.0.0.7. or a host name", ""),
            ("IP address of the machine", "node-0.cluster" + ENTER),
            ("What is the port", CLEAR + "99999" + ENTER),
            ("must be at most 65535", ""),
            ("What is the port", CLEAR + "29555" + ENTER),
            ("same local network", "n"),
            ("rendezvous backend", DOWN + ENTER),
            (DEBUG, "y"),
            (STRATEGY, ENTER),
            (DYNAMO, ENTER),
            (PROCS, ENTER),
            (PRECISION, ENTER),
        ],
        {
            "num_machines": 2,
            "machine_rank": 1,
            "main_process_ip": "node-0.cluster",
            "main_process_port": 29555,
            "rdzv_backend": "c10d",
            "num_processes": 4,
            "same_network": False,
            "debug": True,
        },
        "dry",
        ["--nnodes=2", "--nproc_per_node=2", "node-0.cluster"],
    ),
    (
        "multi-gpu-bad-gpu-ids-asked-again",
        [
            (MACHINE, DOWN * 2 + ENTER),
            (MACHINES, ENTER),
            (DEBUG, ENTER),
            (STRATEGY, ENTER),
            (DYNAMO, ENTER),
            (PROCS, CLEAR + "2" + ENTER),
            (GPUS, CLEAR + "0,x" + ENTER),
            ("must be 'all' or device numbers", ""),
            (GPUS, CLEAR + "0,1" + ENTER),
            (PRECISION, DOWN * 3 + ENTER),
            ("FP8 backend", ENTER),
            ("float8 scaling recipe", DOWN + ENTER),
            ("pad the inner dimension", "y"),
        ],
        {
            "distributed_type": "MULTI_GPU",
            "use_cpu": False,
            "gpu_ids": "0,1",
            "num_processes": 2,
            "mixed_precision": "fp8",
            "fp8_config.recipe": "rowwise",
            "fp8_config.pad_inner_dim": True,
        },
        "dry",
        ["--nproc_per_node=2", "CUDA_VISIBLE_DEVICES=0,1"],
    ),
    (
        "multi-gpu-deepspeed-zero3-offload-bf16",
        [
            (MACHINE, DOWN * 2 + ENTER),
            (MACHINES, ENTER),
            (DEBUG, ENTER),
            (STRATEGY, DOWN + ENTER),
            ("json file to a DeepSpeed config", ENTER),
            ("ZeRO optimization stage", DOWN + ENTER),
            ("offload optimizer states", DOWN + ENTER),
            ("offload parameters", DOWN + ENTER),
            ("gradient accumulation steps", CLEAR + "4" + ENTER),
            ("gradient clipping", ENTER),
            ("save 16-bit model weights", ENTER),
            ("deepspeed.zero.Init", "y"),
            (DYNAMO, ENTER),
            (PROCS, CLEAR + "4" + ENTER),
            (GPUS, ENTER),
            (PRECISION, DOWN * 2 + ENTER),
        ],
        {
            "distributed_type": "DEEPSPEED",
            "deepspeed_config.offload_optimizer_device": "cpu",
            "deepspeed_config.offload_param_device": "cpu",
            "deepspeed_config.gradient_accumulation_steps": 4,
            "gpu_ids": "all",
            "mixed_precision": "bf16",
        },
        "dry",
        ["deepspeed (strategy)", "--nproc_per_node=4"],
    ),
    (
        "multi-node-deepspeed-pdsh-hostfile-inclusion-filter",
        [
            (MACHINE, DOWN * 2 + ENTER),
            (MACHINES, CLEAR + "2" + ENTER),
            ("rank of this machine", ENTER),
            ("IP address of the machine", "10.0.0.1" + ENTER),
            ("What is the port", ENTER),
            ("same local network", ENTER),
            (DEBUG, ENTER),
            (STRATEGY, DOWN + ENTER),
            ("json file to a DeepSpeed config", ENTER),
            ("ZeRO optimization stage", ENTER),
            ("offload optimizer states", ENTER),
            ("gradient accumulation steps", ENTER),
            ("gradient clipping", ENTER),
            ("Which Type of launcher", DOWN + ENTER),
            ("location of hostfile", ENTER),
            ("exclusion or inclusion filter", DOWN * 2 + ENTER),
            ("inclusion filter string", ENTER),
            ("please enter a value", CLEAR + "node-0:0,1@node-1" + ENTER),
            (DYNAMO, ENTER),
            (PROCS, CLEAR + "4" + ENTER),
            (GPUS, ENTER),
            (PRECISION, ENTER),
        ],
        {
            "distributed_type": "DEEPSPEED",
            "main_process_ip": "10.0.0.1",
            "main_process_port": 29500,
            "deepspeed_config.deepspeed_multinode_launcher": "pdsh",
            "deepspeed_config.deepspeed_hostfile": "hostfile",
            "deepspeed_config.deepspeed_inclusion_filter": "node-0:0,1@node-1",
        },
        "dry",
        ["deepspeed (strategy)"],
    ),
    (
        "one-gpu-fsdp-layer-classes",
        [
            (MACHINE, ENTER),
            (CPU_ONLY, "n"),
            (STRATEGY, DOWN * 2 + ENTER),
            *FSDP_COMMON,
            ("auto wrap policy", ENTER),
            ("transformer layer class names", "Block, Layer" + ENTER),
            *FSDP_TAIL,
            (DYNAMO, ENTER),
            (PROCS, ENTER),
            (GPUS, ENTER),
            (PRECISION, DOWN * 2 + ENTER),
        ],
        {
            "distributed_type": "FSDP",
            "use_cpu": False,
            "fsdp_config.fsdp_transformer_layer_cls_to_wrap": ["Block", "Layer"],
            "mixed_precision": "bf16",
        },
        "dry",
        ["fsdp (strategy)"],
    ),
]


@pytest.fixture(scope="module")
def shadow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hide_plugins(tmp_path_factory.mktemp("shadow"), keep=VISIBLE)


@pytest.fixture(scope="module")
def missing_plugins() -> list[str]:
    """The VISIBLE plugins that do not import here: one Python start for the module, not five per test."""
    probe = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(f'accel_{name}')\n"
        "    except Exception:\n"
        "        print(name)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe, *VISIBLE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def _value(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        node = node[part]
    return node


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case_id, steps, expected, mode, shows", PATHS, ids=[p[0] for p in PATHS])
def test_every_branch_writes_a_file_that_launches(
    tmp_path: Path,
    shadow: Path,
    missing_plugins: list[str],
    case_id: str,
    steps: list[Step],
    expected: dict[str, Any],
    mode: str,
    shows: list[str],
) -> None:
    if missing_plugins:
        pytest.skip(f"accel-plugin-{missing_plugins[0]} is not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_", "MIXED_PRECISION"))}
    env.update(
        ACCEL_HOME=str(tmp_path / "home"),
        PROMPT_TOOLKIT_NO_CPR="1",
        TERM="xterm",
        COLUMNS="200",
        PYTHONPATH=str(shadow),
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
    )
    ds_json = tmp_path / "ds.json"
    ds_json.write_text('{"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}\n')
    target = tmp_path / "chosen.yaml"
    term = Terminal(env, ["--config_file", str(target)])
    for prompt, keys in steps:
        term.answer(prompt, keys.replace("{ds_json}", str(ds_json)))
    code, out = term.finish()
    transcript = "".join(term.transcript) + out
    assert code == 0, transcript
    assert "Traceback" not in transcript, transcript
    if not any("please enter a value" in prompt for prompt, _ in steps):  # asked only where no default is offered
        assert "please enter a value" not in transcript, transcript
    data = yaml.safe_load(target.read_text())
    for key, value in expected.items():
        want = value.replace("{ds_json}", str(ds_json)) if isinstance(value, str) else value
        assert _value(data, key) == want, (key, data)
    assert "not an ip" not in target.read_text() and "0,x" not in target.read_text()
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    (tmp_path / "hostfile").write_text("node-0 slots=2\nnode-1 slots=2\n")  # the default answer, relative to cwd
    flags = ["--dry-run"] if mode == "dry" else []
    result = subprocess.run(
        [sys.executable, "-m", "accel.commands.cli", "launch", "--config_file", str(target), *flags, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
        cwd=tmp_path,
    )
    assert result.returncode == 0, f"{data}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    for needle in shows:
        assert needle in result.stdout, (needle, result.stdout)
