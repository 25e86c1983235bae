"""accel-plugin-fsdp: FSDP2 training on 2 CPU processes (gloo) through ``accel launch --plugin fsdp``.

Each 2-process run is compared with a 1-process run of the same script through the kernel alone (no sharding).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).parent
WORKER = HERE / "fsdp_worker.py"
BIN = Path(sys.executable).parent
ACCEL = str(BIN / "accel")


def env_for(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_", "FSDP_"))}
    env.update(ACCEL_HOME=str(tmp / "accel_home"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def run(args: list[str], tmp: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env_for(tmp), capture_output=True, text=True, timeout=timeout)


def launch(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = run([ACCEL, "launch", "-q", *args], tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def result(out: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    return json.loads((out / "result.json").read_text()), load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One process, kernel only, whole batch: what sharded training must reproduce."""
    tmp = tmp_path_factory.mktemp("ref")
    proc = run([sys.executable, str(WORKER), "train", str(tmp / "out"), "--ref"], tmp)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res, params = result(tmp / "out")
    assert res["world"] == 1 and res["plugins"] == [] and res["param_type"] == "Parameter"
    return res, params


def assert_matches(
    res: dict[str, Any],
    params: dict[str, torch.Tensor],
    ref: tuple[dict[str, Any], dict[str, torch.Tensor]],
    tol: float,
) -> None:
    ref_res, ref_params = ref
    assert res["losses"] == pytest.approx(ref_res["losses"], rel=tol, abs=tol)
    assert res["norms"] == pytest.approx(ref_res["norms"], rel=tol, abs=tol)  # global norm over both shards
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=tol, atol=tol, msg=name)


def assert_sharded_in_two(res: dict[str, Any]) -> None:
    assert res["world"] == 2 and res["plugins"][0] == "fsdp" and "ddp" not in res["plugins"]
    assert res["param_type"] == "DTensor"
    # every dimension-0 size of this model is even: each rank holds exactly half of the parameters
    assert res["local_numel"] == [res["total_numel"] // 2] * 2
    assert res["optimizer_params_are_model_params"], "the optimizer must step the sharded parameters"
    # accumulate() on non-sync steps: no reduce-scatter, so the sharded .grad stays empty until the sync step
    assert res["nosync_grads_none"] == [True, True, True]


@pytest.mark.smoke
@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp_two_processes_match_one_process(tmp_path: Path, reference: Any) -> None:
    launch(tmp_path, "-n", "2", "--plugin", "fsdp", str(WORKER), "train", str(tmp_path / "out"))
    res, params = result(tmp_path / "out")
    assert_sharded_in_two(res)
    assert res["shard_units"] == 4  # the three Blocks (model._no_split_modules) and the root
    assert res["checkpointed"] == 0
    assert res["forward"] == {"weight_dtype": "torch.float32", "input_dtype": "torch.float32", "autocast": False}
    assert_matches(res, params, reference, tol=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp_options_from_accelerate_config_file(tmp_path: Path, reference: Any) -> None:
    """distributed_type: FSDP selects the plugin; fsdp_config keys (Accelerate's names) reach fully_shard:
    size-based wrapping, CPU offload (pin_memory=False on CPU), activation checkpointing, no reshard after forward,
    and cpu_ram_efficient_loading with rank 1 building its model on the meta device. FSDP1-only keys are accepted."""
    config = tmp_path / "fsdp.yaml"
    config.write_text(
        "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n"
        "  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_min_num_params: 2000\n  fsdp_reshard_after_forward: false\n"
        "  fsdp_offload_params: true\n  fsdp_activation_checkpointing: true\n  fsdp_cpu_ram_efficient_loading: true\n"
        "  fsdp_state_dict_type: SHARDED_STATE_DICT\n  fsdp_use_orig_params: true\n  fsdp_sync_module_states: true\n"
    )
    launch(tmp_path, "--config_file", str(config), str(WORKER), "train", str(tmp_path / "out"))
    res, params = result(tmp_path / "out")
    assert_sharded_in_two(res)
    assert res["shard_units"] == 7  # fc1 and fc2 of each Block have >= 2000 parameters, plus the root
    assert res["checkpointed"] == 6
    assert res["offload"] == "CPUOffloadPolicy(pin_memory=False)"
    assert_matches(res, params, reference, tol=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp_bf16_through_mixed_precision_policy(tmp_path: Path, reference: Any) -> None:
    launch(
        tmp_path,
        "-n",
        "2",
        "--plugin",
        "fsdp",
        "--mixed_precision",
        "bf16",
        str(WORKER),
        "train",
        str(tmp_path / "out"),
    )
    res, params = result(tmp_path / "out")
    assert_sharded_in_two(res)
    # FSDP casts the gathered parameters and the inputs to bf16 for compute; the shards stay fp32 and the prepared
    # model returns fp32 outputs; no autocast runs (a precision plugin, if installed, stays out)
    assert res["forward"] == {"weight_dtype": "torch.bfloat16", "input_dtype": "torch.bfloat16", "autocast": False}
    assert res["param_dtype"] == "torch.float32" and res["output_dtype"] == "torch.float32"
    assert res["losses"] != reference[0]["losses"]  # bf16 compute really happened...
    assert_matches(res, params, reference, tol=3e-2)  # ...and trains like fp32


def test_fsdp_version_1_and_fp16_are_clear_errors(tmp_path: Path) -> None:
    config = tmp_path / "v1.yaml"
    config.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 1\n")
    script = tmp_path / "noop.py"
    script.write_text("raise SystemExit('must not run')\n")
    proc = run([ACCEL, "launch", "-q", "--config_file", str(config), str(script)], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "accel: error: plugin 'fsdp': fsdp_version 1 (FSDP1) is not supported: accel-plugin-fsdp implements FSDP2 "
        "(torch fully_shard); set fsdp_version: 2 or drop the key"
    ]
    proc = run([ACCEL, "launch", "-q", "--plugin", "fsdp", "--mixed_precision", "fp16", str(script)], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "mixed_precision=fp16 is not supported with --plugin fsdp" in proc.stderr
    proc = run(
        [ACCEL, "launch", "-q", "--plugin", "fsdp", "--fsdp_auto_wrap_policy", "BY_MAGIC", str(script)], tmp_path
    )
    assert proc.returncode == 2 and "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP" in proc.stderr


@pytest.mark.requires_plugins("ddp")
def test_fsdp_selected_over_ddp_and_launched_by_torchrun(tmp_path: Path) -> None:
    """With accel-plugin-ddp installed too, both are strategies; --plugin fsdp makes fsdp the one that answers."""
    script = tmp_path / "noop.py"
    script.write_text("")
    proc = run([ACCEL, "launch", "-q", "-n", "2", "--plugin", "fsdp", "--dry-run", "--verbose", str(script)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "active plugins: fsdp (strategy)" in out
    assert "launcher: fsdp (torchrun):" in out and "--nproc_per_node=2" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("accel_prepare_training:"))
    assert line.split(":", 1)[1].split()[0] == "fsdp:strategy", line  # fsdp answers first, not ddp


def test_wrap_units_follow_the_policy() -> None:
    sys.path.insert(0, str(HERE))
    from fsdp_worker import Net

    from accel import UsageError
    from accel_fsdp.sharding import ShardConfig, wrap_units

    model = Net()
    assert wrap_units(model, ShardConfig()) == list(model.blocks)  # _no_split_modules
    named = wrap_units(model, ShardConfig(layer_classes=("Linear",)))
    assert named == [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert wrap_units(model, ShardConfig(auto_wrap_policy="NO_WRAP")) == []
    big = wrap_units(model, ShardConfig(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=4000))
    assert big == list(model.blocks)  # each Block has 4256 parameters; no single Linear reaches 4000
    with pytest.raises(UsageError, match="no module of class Nope in Net"):
        wrap_units(model, ShardConfig(layer_classes=("Nope",)))


def test_accel_config_asks_accelerates_fsdp_questions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accel.commands.questionnaire import Questionnaire
    from accel.plugins import Plugins
    from accel.testing.shadow import hide_plugins

    monkeypatch.syspath_prepend(str(hide_plugins(tmp_path / "shadow", keep=("ddp", "fsdp"))))
    plugins = Plugins.load(env={})
    answers = {
        "distributed_type": "MULTI_GPU",
        "strategy": "FSDP",
        "num_processes": "2",
        "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
        "fsdp_min_num_params": "5000",
        "fsdp_offload_params": True,
    }
    asked: list[str] = []

    def ask(q: Any, disabled: Any) -> Any:
        asked.append(q.key)
        return answers.get(q.key, q.default)

    questionnaire = Questionnaire(plugins, ask, env={})
    questionnaire.run()
    data = questionnaire.config_data()
    assert "fsdp_transformer_layer_cls_to_wrap" not in asked  # only the follow-up of the chosen policy
    assert data["distributed_type"] == "FSDP"
    assert data["fsdp_config"] == {
        "fsdp_reshard_after_forward": True,
        "fsdp_offload_params": True,
        "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
        "fsdp_min_num_params": 5000,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": False,
        "fsdp_activation_checkpointing": False,
    }
