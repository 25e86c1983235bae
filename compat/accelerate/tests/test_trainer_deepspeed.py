"""transformers' ``Trainer`` with ``TrainingArguments(deepspeed={ZeRO config})`` on accel-accelerate, 2 CPU processes
(gloo, ``accel launch -n 2``): ZeRO-2 and ZeRO-3 partition for real (accel-plugin-deepspeed's engine), train as the
DDP run of the same script, resume exactly from the Trainer's own DeepSpeed checkpoint (``checkpoint-N/global_stepN``)
and log what Hugging Face Accelerate 1.15 logs with the same DeepSpeed 0.19.8 under torchrun.

DeepSpeed's CPU communication op is loaded from the workspace's ``.cache/torch_extensions`` (``TORCH_EXTENSIONS_DIR``,
as the deepspeed plugin's tests keep it; built there on first use)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_accelerate_facade import HERE, launched, loads_without_accel

SCRIPT = HERE / "scripts" / "trainer_deepspeed.py"
ROOT = HERE.parents[2]
EXTENSIONS = os.environ.get("TORCH_EXTENSIONS_DIR") or str(ROOT / ".cache" / "torch_extensions")
#: parameters of the script's network: Linear(8, 32) and Linear(32, 1)
PARAMETERS = 8 * 32 + 32 + 32 + 1


class Runs:
    """``runs(name, real, *args)``: the rows of the script's 2-process run under that name in ``root``, launched once
    per module (the DDP run and each ZeRO run serve several tests)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[str, list[dict[str, Any]]] = {}

    def __call__(self, name: str, real: bool, *args: str) -> list[dict[str, Any]]:
        if name not in self.done:
            self.done[name] = launched(SCRIPT, self.root, name, 2, real, *args)
        return self.done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    with pytest.MonkeyPatch.context() as patch:  # what launched() hands the processes (it copies os.environ)
        patch.setenv("TORCH_EXTENSIONS_DIR", EXTENSIONS)
        patch.setenv("OMP_NUM_THREADS", "1")
        yield Runs(tmp_path_factory.mktemp("trainer_deepspeed"))


def test_deepspeed_plugin_reads_its_configuration(tmp_path: Path) -> None:
    """``DeepSpeedPlugin(hf_ds_config=...)`` has Accelerate's members: ``deepspeed_config`` is the dict given (the
    one transformers fills), the fields the configuration sets are read from it, and the configuration as it is at
    ``prepare`` is what accel-plugin-deepspeed reads."""
    from accelerate.utils import DeepSpeedPlugin

    config: dict[str, Any] = {
        "gradient_accumulation_steps": 2,
        "train_micro_batch_size_per_gpu": "auto",
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    }
    plugin = DeepSpeedPlugin(hf_ds_config=config)
    assert plugin.deepspeed_config is config and plugin.hf_ds_config.is_zero3()
    assert (plugin.zero_stage, plugin.gradient_accumulation_steps, plugin.zero3_save_16bit_model) == (3, 2, True)
    assert plugin.is_auto("train_micro_batch_size_per_gpu") and plugin.get_value("zero_optimization.stage") == 3
    options = DeepSpeedPlugin.options_of(plugin)
    assert options["zero_stage"] == 3 and options["zero3_save_16bit_model"] is True
    path = Path(options["deepspeed_config_file"])
    assert json.loads(path.read_text()) == config
    config["train_micro_batch_size_per_gpu"] = 4  # what the Trainer does between the Accelerator and prepare()
    plugin.write_config()
    assert json.loads(path.read_text())["train_micro_batch_size_per_gpu"] == 4
    given = tmp_path / "ds.json"  # a JSON file given by its path is read where it is
    given.write_text(json.dumps(config))
    from_file = DeepSpeedPlugin(hf_ds_config=str(given))
    assert from_file.zero_stage == 3 and from_file.deepspeed_config == config
    assert DeepSpeedPlugin.options_of(from_file)["deepspeed_config_file"] == str(given)


def close(ours: list[tuple[int, float]], reference: list[tuple[int, float]]) -> bool:
    return [s for s, _ in ours] == [s for s, _ in reference] and [v for _, v in ours] == pytest.approx(
        [v for _, v in reference], rel=1e-5
    )


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_partitions_trains_as_ddp_and_resumes_exactly(runs: Runs, stage: int) -> None:
    """Accumulation 2, six optimizer steps, a checkpoint every two: ZeRO-3 leaves every parameter empty on its
    process (``ds_numel`` holds the full size), ZeRO-2 keeps them whole and splits the optimizer states; the logged
    losses and gradient norms, the trained weights and the evaluation loss are the DDP run's to float rounding (the
    gradients are averaged in another order); ``resume_from_checkpoint=checkpoint-2`` (the engine's own checkpoint,
    which the Trainer writes and loads) logs the uninterrupted run's steps 3-6 exactly; the checkpoint's
    ``training_args.bin`` loads where only Hugging Face's Accelerate is installed."""
    zero = runs(f"zero{stage}", False, "--zero", str(stage))
    ddp = runs("ddp", False)
    for row, plain in zip(zero, ddp, strict=True):
        assert plain["param_numel_local"] == plain["exp_avg_numel"] == PARAMETERS and plain["zero_optimizer"] is None
        assert row["param_numel_full"] == PARAMETERS
        assert row["exp_avg_numel"] <= PARAMETERS // 2 + 4  # this process's half of Adam's states (padded)
        if stage == 3:
            assert row["zero_optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
            assert row["ds_params"] == row["params"] == 4 and row["param_numel_local"] == 0
        else:
            assert row["zero_optimizer"] == "DeepSpeedZeroOptimizer"
            assert row["ds_params"] == 0 and row["param_numel_local"] == PARAMETERS
        assert close(row["losses"], plain["losses"]) and close(row["grad_norms"], plain["grad_norms"])
        assert row["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5)
    assert PARAMETERS <= sum(row["exp_avg_numel"] for row in zero) <= PARAMETERS + 8  # the halves make the whole
    assert zero[0]["weight_norm"] == pytest.approx(ddp[0]["weight_norm"], rel=1e-5)
    assert len(zero[0]["losses"]) == 6 and zero[0]["checkpoints"] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]

    checkpoint = runs.root / f"zero{stage}" / "trainer" / "checkpoint-2"
    files = sorted(p.name for p in (checkpoint / "global_step2").iterdir())
    assert [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)] == [f for f in files if "optim" in f]
    loads_without_accel(checkpoint / "training_args.bin", checkpoint)  # its DeepSpeedPlugin pickled as Accelerate's
    again = runs(f"zero{stage}-again", False, "--zero", str(stage), "--resume-from", str(checkpoint))
    for row, whole in zip(again, zero, strict=True):
        assert row["losses"] == whole["losses"][2:] and row["grad_norms"] == whole["grad_norms"][2:]
        assert (row["weight_norm"], row["eval_loss"]) == (whole["weight_norm"], whole["eval_loss"])


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "precision"), [(2, "no"), (3, "no"), (3, "bf16")])
def test_zero_trains_as_on_accelerate(runs: Runs, stage: int, precision: str) -> None:
    """The same script under Hugging Face Accelerate 1.15 (torchrun, DeepSpeed on CPU/gloo there too): every logged
    loss and gradient norm, the trained weights, the evaluation loss, the checkpoints and what each process holds
    of the parameters and optimizer states are Accelerate's, bit for bit."""
    args = ("--zero", str(stage), "--mixed-precision", precision)
    suffix = "" if precision == "no" else f"-{precision}"
    ours = runs(f"zero{stage}{suffix}", False, *args)
    theirs = runs(f"accelerate-zero{stage}{suffix}", True, *args)
    same = [{k: v for k, v in row.items() if k != "accelerate"} for row in ours]
    assert same == [{k: v for k, v in row.items() if k != "accelerate"} for row in theirs]
