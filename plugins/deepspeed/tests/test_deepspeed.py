"""accel-plugin-deepspeed: configuration, launch commands and ZeRO training on 2 CPU processes over gloo.

Fast tests check the DeepSpeed config (``"auto"`` filling, mismatch errors), the launch commands built for each
multi-machine launcher (fed through DeepSpeed's own runner classes, short of running pdsh/mpirun/srun) and the CLI.
Slow tests start real processes: ``accel launch -n 2 --plugin deepspeed`` (torchrun) runs the same DDP-style loop
under DDP and ZeRO-1/2/3 (with offload, bf16, a frozen teacher) and compares them; a plain ``python`` process
builds a model under ``zero.Init``.

DeepSpeed JIT-compiles its shared-memory op once per machine (~20-200 s here, depending on load); the tests keep it
in ``.cache/torch_extensions`` of the workspace (TORCH_EXTENSIONS_DIR) so later runs reuse it. No other op is built:
the scripts bring torch optimizers.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from dstools import deepspeed_env

from accel import Settings, UsageError
from accel.options import resolve
from accel.plugins import Plugins

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = Path(__file__).parent / "scripts"
ACCEL = str(Path(sys.executable).parent / "accel")


def run(args: list[str], tmp: Path, timeout: float = 850) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=deepspeed_env(tmp), capture_output=True, text=True, timeout=timeout, cwd=tmp)


def settings(**values: Any) -> Settings:
    """Settings as `accel launch` resolves them, for these flag values."""
    plugins = Plugins.load(env={})
    resolved, sources = resolve(plugins.options(), env={}, flags=values)
    return Settings(resolved, sources, world_size=resolved["num_processes"], phase="launch", env={})


# ---------------------------------------------------------------------------------------------------------------
# Configuration


def ds_config(tmp: Path, data: dict[str, Any]) -> str:
    path = tmp / "ds.json"
    path.write_text(json.dumps(data))
    return str(path)


def filled(
    s: Settings, gas: int = 1, precision: str = "no", world: int = 2, micro: int | None = 8, hidden: int | None = None
) -> dict[str, Any]:
    from accel_deepspeed import config

    base, where = config.base_config(s)
    return config.fill(base, config.KernelFacts(gas, precision, world, micro, hidden), where)


def test_auto_values_are_filled_from_the_kernel(tmp_path: Path) -> None:
    path = ds_config(
        tmp_path,
        {
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"},
            "fp16": {"enabled": "auto"},
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": "auto",
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
            },
        },
    )
    cfg = filled(
        settings(deepspeed_config_file=path, gradient_clipping=1.5), gas=4, precision="bf16", micro=8, hidden=64
    )
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == (
        8,
        4,
        64,
    )
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}
    assert cfg["gradient_clipping"] == 1.5
    zero = cfg["zero_optimization"]
    assert (
        zero["reduce_bucket_size"],
        zero["stage3_prefetch_bucket_size"],
        zero["stage3_param_persistence_threshold"],
    ) == (64 * 64, int(0.9 * 64 * 64), 640)
    # without a hidden size the bucket sizes are left to DeepSpeed's defaults
    assert "reduce_bucket_size" not in filled(settings(deepspeed_config_file=path), micro=8)["zero_optimization"]


def test_options_without_a_file_build_the_config() -> None:
    cfg = filled(
        settings(
            zero_stage=3,
            offload_optimizer_device="cpu",
            offload_param_device="cpu",
            deepspeed_gradient_accumulation_steps=2,
            zero3_save_16bit_model=True,
        ),
        gas=2,
        micro=4,
    )
    assert cfg["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    assert cfg["train_batch_size"] == 16 and cfg["zero_force_ds_cpu_optimizer"] is False
    assert filled(settings())["zero_optimization"] == {"stage": 2}  # Accelerate's default stage


@pytest.mark.parametrize(
    "data,kwargs,message",
    [
        (
            {"gradient_accumulation_steps": 4},
            dict(gas=2),
            "gradient_accumulation_steps is 4 but the Kernel's gradient_accumulation_steps is 2",
        ),
        (
            {"train_micro_batch_size_per_gpu": 16},
            dict(micro=8),
            "train_micro_batch_size_per_gpu is 16 but the batch size of the training DataLoader is 8",
        ),
        ({"train_batch_size": 100}, dict(micro=8), "train_batch_size is 100 but train_micro_batch_size_per_gpu x"),
        (
            {"bf16": {"enabled": True}},
            dict(precision="no"),
            "bf16.enabled is true but the Kernel's mixed_precision is 'no'",
        ),
        (
            {"fp16": {"enabled": False}},
            dict(precision="fp16"),
            "fp16.enabled is false but the Kernel's mixed_precision",
        ),
        ({"optimizer": {"type": "Adam"}, "sub_group_size": "auto"}, {}, 'cannot fill "auto" for sub_group_size'),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, {}, "needs ZeRO stage 3"),
        (
            {"zero_optimization": {"stage": 2, "sub_group_size": "auto"}},
            {},
            'cannot fill "auto" for zero_optimization.sub_group_size',
        ),
        ({}, dict(micro=None), "pass the training DataLoader to the same prepare() call"),
    ],
)
def test_mismatches_are_clear_errors(
    tmp_path: Path, data: dict[str, Any], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(UsageError, match=None) as info:
        filled(settings(deepspeed_config_file=ds_config(tmp_path, data)), **kwargs)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_option_and_file_must_agree(tmp_path: Path) -> None:
    path = ds_config(tmp_path, {"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"})
    with pytest.raises(
        UsageError,
        match=r"sets zero_optimization.stage=2 but --zero_stage \(deepspeed_config."
        r"zero_stage\) is 3",
    ):
        filled(settings(deepspeed_config_file=path, zero_stage=3))
    assert filled(settings(deepspeed_config_file=path, zero_stage=2, gradient_clipping=0.3))["gradient_clipping"] == 0.3
    with pytest.raises(UsageError, match="does not exist"):
        filled(settings(deepspeed_config_file=str(tmp_path / "missing.json")))


def test_config_questions_follow_accelerate() -> None:
    """`accel config` asks Accelerate's DeepSpeed questions; each stored answer is valid for the option whose
    Accelerate config key it is written under."""
    import accel_deepspeed as plugin

    assert plugin.accel_config_questions({"distributed_type": "MULTI_CPU"}) is None
    script = {
        "deepspeed_use_json": False,
        "zero_stage": 3,
        "offload_optimizer_device": "nvme",
        "offload_param_device": "cpu",
        "offload_optimizer_nvme_path": "/nvme",
        "deepspeed_gradient_accumulation_steps": 4,
        "deepspeed_use_clipping": True,
        "gradient_clipping": 1.0,
        "zero3_save_16bit_model": True,
        "zero3_init_flag": True,
        "deepspeed_multinode_launcher": "pdsh",
        "deepspeed_hostfile": "/etc/hosts",
        "deepspeed_filter": "inclusion",
        "deepspeed_inclusion_filter": "node-a@node-b",
    }
    answers: dict[str, Any] = {"distributed_type": "DEEPSPEED", "num_machines": 2}
    asked, stored = [], {}
    while True:
        pending = [q for q in plugin.accel_config_questions(answers) or [] if q.key not in answers]
        if not pending:
            break
        asked.append(pending[0].key)
        answers[pending[0].key] = script[pending[0].key]
        if pending[0].store:
            stored[pending[0].key] = script[pending[0].key]
    assert asked == list(script)
    options = Plugins.load(env={}).options()
    for key, value in stored.items():
        opt = options[key]
        assert opt.plugin == "deepspeed" and opt.dotted.startswith("deepspeed_config."), key
        assert opt.coerce(value, key) == value
    # with a JSON file: only its path (and zero.Init) are asked
    answers = {"distributed_type": "DEEPSPEED", "deepspeed_use_json": True}
    assert [q.key for q in plugin.accel_config_questions(answers)] == [
        "deepspeed_use_json",
        "deepspeed_config_file",
        "zero3_init_flag",
    ]


# ---------------------------------------------------------------------------------------------------------------
# Launch commands


def hostfile(tmp: Path, text: str = "node-a slots=2\n# a comment\nnode-b slots=2\n") -> str:
    path = tmp / "hostfile"
    path.write_text(text)
    return str(path)


def runner_settings(tmp: Path, launcher: str, **extra: Any) -> Settings:
    values = dict(
        num_processes=4,
        num_machines=2,
        main_process_ip="10.1.2.3",
        main_process_port=29555,
        plugins=["deepspeed"],
        deepspeed_multinode_launcher=launcher,
        deepspeed_hostfile=hostfile(tmp),
    )
    values.update(extra)
    return settings(**values)


WORKER_ENV = {
    "ACCEL_CONFIG": json.dumps({"num_processes": 4, "plugins": ["deepspeed"], "zero_stage": 3}),
    "ACCEL_DISABLE_PLUGINS": "wandb",
    "OMP_NUM_THREADS": "2",
    "PATH": "/usr/bin",
    "HOME": "/home/u",
}


@pytest.mark.parametrize("launcher", ["pdsh", "openmpi", "mvapich", "mpich", "slurm", "nossh"])
def test_runner_command_line_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launcher: str) -> None:
    from deepspeed.launcher import multinode_runner as mnr
    from deepspeed.launcher import runner as ds

    from accel_deepspeed.launcher import runner_plan

    s = runner_settings(tmp_path, launcher, machine_rank=1)
    plan = runner_plan(s, ["train.py", "--num", "0.1"], "/venv/bin/python", WORKER_ENV)  # --num: not the runner's
    limits = ["--num_nodes", "2", "--num_gpus", "2"] if launcher in ("pdsh", "slurm", "nossh") else []
    how = ["--no_ssh", "--node_rank", "1"] if launcher == "nossh" else ["--launcher", launcher]
    assert plan.argv == [
        "/venv/bin/python",
        "-u",
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        s["deepspeed_hostfile"],
        *how,
        "--master_addr",
        "10.1.2.3",
        "--master_port",
        "29555",
        "--no_local_rank",
        *limits,
        "--",
        "train.py",
        "--num",
        "0.1",
    ]
    encoded = "base64:" + base64.b64encode(WORKER_ENV["ACCEL_CONFIG"].encode()).decode()
    assert plan.exports == {
        "ACCEL_CONFIG": encoded,
        "ACCEL_DISABLE_PLUGINS": "wandb",
        "OMP_NUM_THREADS": "2",
        "MASTER_ADDR": "10.1.2.3",
        "MASTER_PORT": "29555",
    }
    assert plan.env_file_text().splitlines()[0] == f"ACCEL_CONFIG={encoded}"

    # DeepSpeed's runner accepts the command, and its backend turns the exports into the remote command line.
    args = ds.parse_args(plan.argv[4:])
    pool = ds.fetch_hostfile(args.hostfile)
    active = ds.apply_num_nodes_and_gpus(
        ds.parse_inclusion_exclusion(pool, args.include, args.exclude), args.num_nodes, args.num_gpus
    )
    assert active == {"node-a": [0, 1], "node-b": [0, 1]}
    world = ds.encode_world_info(active)
    if launcher == "nossh":  # started on every machine: the runner launches this machine's processes itself
        assert args.no_ssh and args.node_rank == 1 and args.no_local_rank
        assert plan.env == WORKER_ENV  # its local processes inherit the runner's environment as it is
        return
    monkeypatch.setattr(mnr, "MVAPICH_TMP_HOSTFILE", str(tmp_path / "mvapich_hosts"))
    backend = {
        "pdsh": lambda: mnr.PDSHRunner(args, world),
        "openmpi": lambda: mnr.OpenMPIRunner(args, world, pool),
        "mpich": lambda: mnr.MPICHRunner(args, world, pool),
        "mvapich": lambda: mnr.MVAPICHRunner(args, world, pool),
        "slurm": lambda: mnr.SlurmRunner(args, world, pool),
    }[launcher]()
    for line in plan.env_file_text().splitlines():  # what the runner does with the DS_ENV_FILE
        key, value = line.split("=", 1)
        backend.add_export(key, value)
    cmd = backend.get_cmd(dict(os.environ), active)
    cmd = cmd[0] if launcher == "pdsh" else cmd
    if launcher == "pdsh":
        assert cmd[:6] == ["pdsh", "-S", "-f", "1024", "-w", "node-a,node-b"]
        exports = cmd[6]
        launch = cmd[cmd.index("deepspeed.launcher.launch") + 1 :]
        assert "--no_local_rank" in launch and "--master_addr=10.1.2.3" in launch and "--master_port=29555" in launch
        assert launch[-3:] == ["train.py", "--num", "0.1"]
        # the remote shell evaluates the exports: every value must come through unchanged
        shown = subprocess.run(["bash", "-c", exports + " env"], capture_output=True, text=True).stdout.splitlines()
        assert f"ACCEL_CONFIG={encoded}" in shown and "MASTER_ADDR=10.1.2.3" in shown
    elif launcher == "slurm":
        assert cmd[:3] == ["srun", "-n", "4"] and cmd[-3:] == ["train.py", "--num", "0.1"]
        assert f"ACCEL_CONFIG={encoded}" in next(c for c in cmd if c.startswith("--export=ALL")).split(",")
    else:
        flag = {"openmpi": "-x", "mvapich": "-env", "mpich": "-genv"}[launcher]
        pairs = {cmd[i + 1] for i, c in enumerate(cmd) if c == flag}
        assert {f"ACCEL_CONFIG={encoded}", "MASTER_ADDR=10.1.2.3", "MASTER_PORT=29555"} <= pairs
        assert cmd[0] == "mpirun" and cmd[-3:] == ["train.py", "--num", "0.1"]
        assert cmd[cmd.index("-n" if launcher != "mvapich" else "-np") + 1] == "4"


def test_runner_filters_and_refusals(tmp_path: Path) -> None:
    from accel_deepspeed.launcher import runner_plan

    plan = runner_plan(
        runner_settings(tmp_path, "pdsh", deepspeed_inclusion_filter="node-a:0,1@node-b:0,1"),
        ["-m", "pkg.train"],
        "/py",
        {},
    )
    assert plan.argv[-5:] == ["--include", "node-a:0,1@node-b:0,1", "--module", "--", "pkg.train"]
    plan = runner_plan(runner_settings(tmp_path, "slurm", deepspeed_exclusion_filter="node-b"), ["t.py"], "/py", {})
    assert "--exclude" in plan.argv and "--num_gpus" not in plan.argv
    with pytest.raises(UsageError, match="takes no inclusion/exclusion filter"):
        runner_plan(runner_settings(tmp_path, "openmpi", deepspeed_exclusion_filter="node-b"), ["t.py"], "/py", {})
    with pytest.raises(UsageError, match="starts one process per slot"):
        runner_plan(runner_settings(tmp_path, "openmpi", num_processes=6), ["t.py"], "/py", {})
    with pytest.raises(UsageError, match="needs --deepspeed_hostfile"):
        runner_plan(runner_settings(tmp_path, "pdsh", deepspeed_hostfile=None), ["t.py"], "/py", {})
    with pytest.raises(UsageError, match="does not exist"):
        runner_plan(runner_settings(tmp_path, "pdsh", deepspeed_hostfile=str(tmp_path / "nope")), ["t.py"], "/py", {})
    with pytest.raises(UsageError, match="expected 'HOST slots=N'"):
        (tmp_path / "bad").write_text("node-a 2\n")
        runner_plan(runner_settings(tmp_path, "pdsh", deepspeed_hostfile=str(tmp_path / "bad")), ["t.py"], "/py", {})


def test_base64_launch_config_reaches_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from accel import Kernel

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("ACCEL_CONFIG", "base64:" + base64.b64encode(b'{"gradient_accumulation_steps": 5}').decode())
    kernel = Kernel()
    try:
        assert (
            kernel.gradient_accumulation_steps == 5
            and kernel.settings.sources["gradient_accumulation_steps"] == "launch"
        )
    finally:
        kernel.end_training()


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.touch, (Path(self.marker),))


def test_deepspeed_files_are_loaded_weights_only(tmp_path: Path) -> None:
    """DeepSpeed loads its checkpoint files with weights_only=False; under accel every such load is weights-only
    (plus DeepSpeed's own enums/records), so a crafted file is refused and never runs code."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from accel import CheckpointError
    from accel_deepspeed.state import weights_only_loads

    good, bad, marker = tmp_path / "good.pt", tmp_path / "bad.pt", tmp_path / "pwned"
    torch.save({"zero_stage": ZeroStageEnum.gradients, "w": torch.ones(2)}, good)
    torch.save({"w": _Exploit(str(marker))}, bad)
    with weights_only_loads():
        assert torch.load(good, weights_only=False)["zero_stage"] == ZeroStageEnum.gradients
        with pytest.raises(CheckpointError, match="refusing to load .*bad.pt: it holds more than weights"):
            torch.load(bad, weights_only=False)
    assert not marker.exists()
    assert torch.load.__module__ == "torch.serialization"  # restored afterwards


# ---------------------------------------------------------------------------------------------------------------
# CLI


@pytest.fixture()
def script(tmp_path: Path) -> str:
    (tmp_path / "train.py").write_text("print('hello')\n")
    return "train.py"


def cli(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run([ACCEL, "launch", "-q", *args], tmp, timeout=120)


def test_cli_plans_torchrun_and_runner(tmp_path: Path, script: str) -> None:
    args = ("--dry-run", "--verbose", "-n", "2", "--plugin", "deepspeed", "--zero_stage", "3", script, "--start", "1")
    proc = cli(tmp_path, *args)  # --verbose: the hook table
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("launcher:"))
    assert line.startswith("launcher: deepspeed (torchrun): ") and "--nproc_per_node=2" in line
    # the command as a user would type it (the workers' parent-death prelude is left out of the dry run), the
    # script after "--": a script option is never read as torchrun's --start-method
    assert line.endswith(f" -- {script} --start 1"), line
    assert "accel_backward: deepspeed:strategy" in proc.stdout  # the engine answers before the kernel
    hosts = hostfile(tmp_path)
    proc = cli(
        tmp_path,
        "--dry-run",
        "-n",
        "4",
        "--num_machines",
        "2",
        "--main_process_ip",
        "10.0.0.1",
        "--plugin",
        "deepspeed",
        "--deepspeed_multinode_launcher",
        "openmpi",
        "--deepspeed_hostfile",
        hosts,
        script,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"deepspeed.launcher.runner --hostfile {hosts} --launcher openmpi --master_addr 10.0.0.1" in proc.stdout
    assert "  MASTER_ADDR=10.0.0.1" in proc.stdout.splitlines()


def test_cli_hands_the_json_accumulation_to_the_kernel(tmp_path: Path, script: str) -> None:
    path = ds_config(tmp_path, {"gradient_accumulation_steps": 4, "bf16": {"enabled": True}})
    proc = cli(tmp_path, "--dry-run", "--plugin", "deepspeed", "--deepspeed_config_file", path, script)
    assert proc.returncode == 0, proc.stderr
    assert (
        "from the DeepSpeed config to the Kernel: ACCEL_GRADIENT_ACCUMULATION_STEPS=4 ACCEL_MIXED_PRECISION=bf16"
    ) in proc.stdout


@pytest.mark.parametrize("case", ["mismatch", "fp16", "unselected", "filter", "yaml"])
def test_cli_errors_are_one_line(tmp_path: Path, script: str, case: str) -> None:
    if case == "mismatch":
        path = ds_config(tmp_path, {"bf16": {"enabled": True}})
        args = ["--plugin", "deepspeed", "--deepspeed_config_file", path, "--mixed_precision", "no", script]
        expected = "bf16.enabled is true but the Kernel's mixed_precision is 'no'"
    elif case == "fp16":
        if torch.ops.mkldnn._is_mkldnn_fp16_supported():
            pytest.skip("this CPU supports fp16")
        args = ["-n", "2", "--plugin", "deepspeed", "--mixed_precision", "fp16", script]
        expected = "DeepSpeed refuses fp16 on this CPU"
    elif case == "unselected":
        args = ["-n", "2", "--zero_stage", "3", script]
        expected = "DeepSpeed option(s) --zero_stage given, but DeepSpeed is not selected"
    elif case == "filter":
        args = ["-n", "2", "--plugin", "deepspeed", "--deepspeed_inclusion_filter", "localhost:0", script]
        expected = "need --num_machines > 1 and a --deepspeed_multinode_launcher other than standard"
    else:  # Accelerate-style YAML: the Kernel's accumulation and DeepSpeed's disagree (Accelerate #3369, #1830)
        (tmp_path / "cfg.yaml").write_text(
            "distributed_type: DEEPSPEED\nnum_processes: 2\n"
            "gradient_accumulation_steps: 2\n"
            "deepspeed_config:\n  zero_stage: 2\n  gradient_accumulation_steps: 4\n"
        )
        args = ["--config_file", "cfg.yaml", script]
        expected = "gradient_accumulation_steps is 4 but the Kernel's gradient_accumulation_steps is 2"
    proc = cli(tmp_path, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "hello" not in proc.stdout  # nothing started


# ---------------------------------------------------------------------------------------------------------------
# Training on real processes


def load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


class Launch:
    """One ``accel launch -n 2 --plugin deepspeed scripts/deepspeed_cases.py``: the worker scripts of several tests
    one after another in the same two processes (one import of torch and DeepSpeed each), each under OUT/<name>."""

    def __init__(self, tmp: Path, names: list[str]) -> None:
        self.out, self.last = tmp / "out", names[-1]
        self.proc = run(
            [ACCEL, "launch", "-q", "-n", "2", "--plugin", "deepspeed", str(SCRIPTS / "deepspeed_cases.py")]
            + [str(self.out), ",".join(names)],
            tmp,
        )

    def result(self, name: str) -> tuple[Path, dict[str, Any]]:
        """The output folder and result.json of one script; a failure naming it (and the launch's output) unless both
        processes finished it (and, for the last one, the launch exited 0)."""
        path = self.out / name / "result.json"
        finished = all((self.out / name / f"done{rank}").exists() for rank in (0, 1))
        if not (path.exists() and finished) or (name == self.last and self.proc.returncode):
            pytest.fail(
                f"case {name}: no result, or the launch failed after it (launch exit {self.proc.returncode})\n"
                + self.proc.stdout[-3000:]
                + "\n"
                + self.proc.stderr[-6000:]
            )
        return self.out / name, json.loads(path.read_text())


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """The resume script, then the ZeRO/DDP matrix (only where the ddp plugin is installed: its DDP reference)."""
    from accel.plugins import scan_entry_points

    with_ddp = "ddp" in {record.name for record in scan_entry_points()}
    return Launch(tmp_path_factory.mktemp("deepspeed"), ["resume", "matrix"] if with_ddp else ["resume"])


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first DeepSpeed process group of a clean workspace compiles an op
@pytest.mark.multiprocess
@pytest.mark.requires_plugins("ddp")
def test_zero_stages_match_ddp(launched: Launch) -> None:
    """ZeRO-1/2/3 (and with offload) reproduce the DDP run of the same loop: gradient accumulation 3 with the short
    end-of-epoch cycle, clipping at 0.5, StepLR; the exported weights load into a plain torch module."""
    out, res = launched.result("matrix")
    ddp, ddp_weights = res["ddp"], load(out / "ddp.safetensors")
    assert len(ddp["losses"]) == 16 and len(ddp["norms"]) == 6  # 2 epochs x (3 + 3 + 2 micro-batches)
    # StepLR(step_size=2) under Accelerate's rule: 6 optimizer steps x 2 processes = 12 scheduler steps
    assert ddp["lrs"][-1] == pytest.approx(0.02 * 0.7**6)
    assert max(ddp["norms"]) > 0.5  # clipping was active
    for name in ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"):
        run_ = res[name]
        assert run_["losses"] == pytest.approx(ddp["losses"], rel=1e-5, abs=1e-6), name
        assert run_["norms"] == pytest.approx(ddp["norms"], rel=1e-5), name
        assert run_["lrs"] == pytest.approx(ddp["lrs"]), name
        weights = load(out / f"{name}.safetensors")
        assert weights.keys() == ddp_weights.keys()
        for key, value in ddp_weights.items():
            torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
    # the ZeRO-3 export is a plain state dict: it loads into the user's module without DeepSpeed
    module = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    )
    module.load_state_dict(load(out / "zero3.safetensors"), strict=True)
    # bf16: DeepSpeed's bf16 weights and fp32 master weights; close to fp32, exported as fp32 masters
    bf16 = res["zero2_bf16"]
    assert bf16["dtypes"] == ["torch.float32"]
    assert bf16["losses"] == pytest.approx(ddp["losses"], abs=3e-2)
    assert bf16["losses"] != pytest.approx(ddp["losses"], abs=1e-6)  # it did run in bf16
    # ZeRO-3 bf16 with zero3_save_16bit_model: the export holds the bf16 training weights instead
    assert res["zero3_bf16_16bit"]["dtypes"] == ["torch.bfloat16"]
    assert res["zero3_bf16_16bit"]["losses"] == pytest.approx(ddp["losses"], abs=3e-2)
    # student + frozen teacher: ZeRO-3 partitions the teacher in its own engine and matches DDP
    assert res["teacher_zero3"]["teacher_type"] == "DeepSpeedEngine"
    assert res["teacher_zero3"]["teacher_unchanged"] and res["teacher_zero3"]["teacher_export"] == ["torch.float32"]
    assert res["teacher_ddp"]["teacher_type"] == "Sequential"
    bf16_teacher = res["teacher_zero3_bf16"]
    assert bf16_teacher["teacher_export"] == ["torch.float32"] and not bf16_teacher["teacher_unchanged"]  # bf16-rounded
    assert bf16_teacher["losses"] == pytest.approx(res["teacher_ddp"]["losses"], abs=2e-2)
    assert res["teacher_zero3"]["losses"] == pytest.approx(res["teacher_ddp"]["losses"], rel=1e-4, abs=1e-6)
    assert "DeepSpeed trains one model per Kernel" in res["two_trained"]


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first DeepSpeed process group of a clean workspace compiles an op
def test_single_process_zero_init(tmp_path: Path) -> None:
    """A plain `python script.py` (no launcher variables: no mpi4py needed) with ZeRO-3 and zero3_init_flag: the
    model is partitioned as it is built and trains exactly like the kernel alone."""
    out = tmp_path / "out"
    proc = run([sys.executable, str(SCRIPTS / "deepspeed_single.py"), str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads((out / "result.json").read_text())
    ds, plain = res["deepspeed"], res["plain"]
    assert ds["partitioned"] and not plain["partitioned"]
    assert ds["first"] == plain["first"]  # zero.Init initialised the same weights
    assert ds["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert plain["inputs_refused"] is None  # the kernel alone passes inputs= on to Tensor.backward
    assert "kernel.backward(inputs=...) is not supported with DeepSpeed" in ds["inputs_refused"]
    for key, value in load(out / "plain.safetensors").items():
        torch.testing.assert_close(load(out / "zero_init.safetensors")[key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first DeepSpeed process group of a clean workspace compiles an op
@pytest.mark.multiprocess
def test_example_runs_unchanged_with_a_json_config(tmp_path: Path) -> None:
    """examples/train_digits.py, unchanged, under ZeRO-3 + bf16 from a JSON file full of "auto" values."""
    path = ds_config(
        tmp_path,
        {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"},
        },
    )
    proc = run(
        [
            ACCEL,
            "launch",
            "-q",
            "-n",
            "2",
            "--plugin",
            "deepspeed",
            "--deepspeed_config_file",
            path,
            "--mixed_precision",
            "bf16",
            str(ROOT / "examples" / "train_digits.py"),
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("epoch 0: accuracy"))
    assert float(line.split()[3]) > 0.5 and "on 297 test images (2 processes)" in line


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first DeepSpeed process group of a clean workspace compiles an op
@pytest.mark.multiprocess
def test_save_state_resumes_exactly(launched: Launch) -> None:
    """kernel.save_state/load_state with DeepSpeed's checkpoint inside accel's: resuming is bitwise exact (fp32
    and bf16: DeepSpeed stores the fp32 master weights and optimizer states as they are), into a fresh engine and
    into the same engine; save_model exports the gathered ZeRO-3 weights."""
    from accel import Kernel

    if not hasattr(Kernel, "save_state"):
        pytest.skip("this kernel has no save_state yet")
    out, res = launched.result("resume")
    assert "save_state in the middle of gradient accumulation" in res.pop("mid_cycle")
    assert "does not fit this optimizer" in res.pop("ddp_into_zero")
    assert not (out / "mid_cycle").exists()
    for name, stage in (("zero2", 2), ("zero3", 3), ("zero2_bf16", 2)):
        r = res[name]
        assert len(r["after_save"]) == 10  # 2 epochs x 8 batches per process, minus the 6 before the save
        assert r["resumed"] == r["after_save"], name  # exactly, not approximately
        assert r["again"] == r["after_save"], name
        assert r["final_equal"] and r["again_equal"] and r["init_differs"], name
        assert r["same_as_zero_to_fp32"], name  # get_state_dict == DeepSpeed's zero_to_fp32 of the checkpoint
        for key in ("model", "optimizer"):
            item = r["items"][key]
            assert (item["plugin"], item["format"]) == ("deepspeed", "deepspeed-checkpoint")
            assert item["extra"]["zero_stage"] == stage and item["extra"]["world_size"] == 2
        assert r["items"]["scheduler"]["plugin"] == "accel"
    teacher = res["zero3_teacher"]
    assert teacher["resumed"] == teacher["after_save"] and teacher["final_equal"]
    assert (teacher["items"]["model_1"]["plugin"], teacher["items"]["model_1"]["format"]) == (
        "deepspeed",
        "deepspeed-zero3-frozen",
    )
    exported = load(out / "export_zero3" / "model.safetensors")
    for key, value in res["zero3"]["final"].items():
        assert exported[key].tolist() == value, key
