"""accel-plugin-deepspeed and Accelerate's DeepSpeed idioms: a config file with ``optimizer``/``scheduler``
sections used through ``DummyOptim``/``DummyScheduler``, and a scheduler built before ``prepare()`` over an
optimizer with an empty parameter group (DeepSpeed drops the group inside ``prepare()``). Real DeepSpeed on 2 CPU
processes over gloo (ZeRO-2 and ZeRO-3), as plugins/deepspeed/tests/test_deepspeed.py; every launched case runs in one
launch (the ``launched`` fixture), each with its own Kernel, model and optimizer and its own records."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from dstools import deepspeed_env

from accel import UsageError

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = Path(__file__).parent / "scripts"
ACCEL = str(Path(sys.executable).parent / "accel")

SECTIONS = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True, "adam_w_mode": True},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
}


def write(tmp: Path, name: str, data: dict[str, Any]) -> str:
    (tmp / name).write_text(json.dumps(data))
    return str(tmp / name)


def test_config_sections_wait_for_prepare_and_autos_are_filled(tmp_path: Path) -> None:
    from accel import Settings
    from accel.options import resolve
    from accel.plugins import Plugins
    from accel_deepspeed import config

    path = write(tmp_path, "ds.json", SECTIONS)
    plugins = Plugins.load(env={})
    values, sources = resolve(plugins.options(), env={}, flags={"deepspeed_config_file": path})
    base, where = config.base_config(Settings(values, sources, world_size=2, phase="launch", env={}))
    filled = config.fill(base, config.KernelFacts(1, "no", 2, 4), where)  # at launch: sections' autos stay
    assert filled["optimizer"]["params"]["lr"] == "auto"
    config.fill_sections(
        filled,
        {
            "optimizer": {"lr": 0.5, "weight_decay": 0.1},
            "scheduler": {"warmup_min_lr": 0, "warmup_max_lr": 0.5, "warmup_num_steps": 2, "total_num_steps": 10},
        },
        where,
    )
    assert filled["optimizer"]["params"] == {"lr": 0.5, "weight_decay": 0.1, "torch_adam": True, "adam_w_mode": True}
    assert filled["scheduler"]["params"]["total_num_steps"] == 10
    with pytest.raises(UsageError, match=r'cannot fill "auto" for scheduler.params.warmup_max_lr'):
        config.fill_sections({"scheduler": {"params": {"warmup_max_lr": "auto"}}}, {}, where)


def test_dummy_scheduler_auto_values_follow_accelerate() -> None:
    import torch

    from accel_deepspeed import DummyOptim, DummyScheduler

    opt = DummyOptim(torch.nn.Linear(2, 2).parameters(), lr=0.3)
    assert DummyScheduler(opt, total_num_steps=25, warmup_num_steps=0).auto_values(2) == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 0.3,
        "warmup_num_steps": 1,
        "total_num_steps": 13,
    }


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first DeepSpeed process group of a clean workspace compiles an op
def test_dummy_mistakes_are_one_line_each(tmp_path: Path) -> None:
    with_sections = write(tmp_path, "with.json", SECTIONS)
    without = write(tmp_path, "without.json", {"train_micro_batch_size_per_gpu": "auto"})
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "deepspeed_dummy_refusals.py"), with_sections, without],
        env=deepspeed_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=850,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {
        "torch_optimizer_with_section": "UsageError: DeepSpeed config defines an optimizer section and the script "
        "passes its own optimizer; remove the section, or pass accel_deepspeed.DummyOptim(params, lr=...) to "
        "prepare()",
        "torch_scheduler_with_section": "UsageError: DeepSpeed config defines a scheduler section and the script "
        "passes its own scheduler; remove the section, or pass accel_deepspeed.DummyScheduler(optimizer, ...) to "
        "prepare()",
        "dummy_optimizer_without_section": "UsageError: DummyOptim needs an optimizer section in the DeepSpeed "
        "config; add one, or pass a torch optimizer",
        "dummy_scheduler_without_section": "UsageError: DummyScheduler needs a scheduler section in the DeepSpeed "
        "config, or lr_scheduler_callable=",
        "dummy_step": "UsageError: DummyOptim stands for the optimizer of the DeepSpeed config; pass it to "
        "kernel.prepare() and use what prepare() returns",
    }


#: The launched cases: name -> (script mode, the Kernel's options); "{config}" is the path of a file with SECTIONS.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "dummy_zero2": ("dummy", {"plugins": ["deepspeed"], "zero_stage": 2, "deepspeed_config_file": "{config}"}),
    "dummy_zero3": ("dummy", {"plugins": ["deepspeed"], "zero_stage": 3, "deepspeed_config_file": "{config}"}),
    "empty_zero2": ("empty", {"plugins": ["deepspeed"], "zero_stage": 2}),
    "empty_zero3": ("empty", {"plugins": ["deepspeed"], "zero_stage": 3}),
    "empty_ddp": ("empty", {"plugins": ["ddp"]}),
}


@dataclass
class Launch:
    out: Path
    proc: subprocess.CompletedProcess[str]
    last: str  # the last case: a launch that fails after it (at exit) fails its test

    def ranks(self, name: str) -> list[dict[str, Any]]:
        """The two processes' records of one case; a failure naming the case (and the launch's output) without."""
        files = [self.out / name / f"rank{r}.json" for r in (0, 1)]
        if not all(f.exists() for f in files) or (name == self.last and self.proc.returncode):
            pytest.fail(
                f"case {name}: no result, or the launch failed after it (launch exit {self.proc.returncode})\n"
                + self.proc.stdout[-3000:]
                + "\n"
                + self.proc.stderr[-6000:]
            )
        return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """Every case of CASES in one ``accel launch -n 2 --plugin deepspeed`` (the ddp case only where the ddp plugin
    is installed): each process imports torch and DeepSpeed once for all of them."""
    from accel.plugins import scan_entry_points

    tmp = tmp_path_factory.mktemp("dummy")
    config = write(tmp, "ds.json", SECTIONS)
    installed = {record.name for record in scan_entry_points()}
    cases = [
        [name, mode, {k: config if v == "{config}" else v for k, v in options.items()}]
        for name, (mode, options) in CASES.items()
        if set(options["plugins"]) <= installed
    ]
    out = tmp / "out"
    proc = subprocess.run(
        [ACCEL, "launch", "-q", "-n", "2", "--plugin", "deepspeed", str(SCRIPTS / "deepspeed_dummy.py"), str(out)]
        + [json.dumps(cases)],
        env=deepspeed_env(tmp),
        capture_output=True,
        text=True,
        timeout=850,
        cwd=tmp,
    )
    return Launch(out, proc, cases[-1][0])


def warmup_decay(steps: int) -> list[float]:
    """DeepSpeed's own WarmupDecayLR over a plain torch optimizer, with the values Accelerate fills in for the
    script's DummyScheduler: 24 steps counted over the whole dataset -> 12 per process, warm-up 3, peak 0.05."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.05)
    sched = WarmupDecayLR(opt, total_num_steps=12, warmup_min_lr=0, warmup_max_lr=0.05, warmup_num_steps=3)
    lrs = []
    for _ in range(steps):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    return lrs


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_config_optimizer_and_scheduler_through_dummies(launched: Launch, stage: int) -> None:
    ranks = launched.ranks(f"dummy_zero{stage}")
    expected = warmup_decay(12)
    for rec in ranks:
        assert rec["optimizer"] == "AdamW"  # built by the engine from the config (torch_adam)
        assert rec["weight_decay"] == [0.01, 0.0]  # the script's two groups, as given
        assert rec["restored"] == [True, True]  # save_state/load_state: the engine's scheduler and the lr
        assert [step[0][0] for step in rec["lrs"]] == pytest.approx(expected)  # scheduler.get_last_lr()
        assert [step[1] for step in rec["lrs"]] == [[lr, lr] for lr in [step[0][0] for step in rec["lrs"]]]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_scheduler_built_before_prepare_survives_the_dropped_empty_group(launched: Launch, stage: int) -> None:
    """Without the fix: `ValueError: zip() argument 2 is longer than argument 1` at the first scheduler.step()."""
    ranks = launched.ranks(f"empty_zero{stage}")
    # LambdaLR(1 / (1 + step)) under Accelerate's rule: 2 scheduler steps per optimizer step on 2 processes
    expected = [0.05 / (1 + 2 * step) for step in range(1, 13)]
    for rec in ranks:
        assert rec["groups"] == 1  # DeepSpeed dropped the empty group
        assert rec["local_sgd"] == (
            "UsageError: LocalSGD averages full parameter replicas; the active strategy (deepspeed) does not keep one "
            "per process (it provides no 'local_sgd'); use the ddp plugin"
        )
        assert rec["restored"] == [True, True]
        assert [step[0] for step in rec["lrs"]] == [pytest.approx([lr]) for lr in expected]
        assert [step[1] for step in rec["lrs"]] == [pytest.approx([lr]) for lr in expected]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.requires_plugins("ddp")
def test_the_same_script_under_ddp_has_the_same_learning_rates(launched: Launch) -> None:
    ranks = launched.ranks("empty_ddp")
    # LambdaLR(1 / (1 + step)) under Accelerate's rule: 2 scheduler steps per optimizer step on 2 processes
    expected = [0.05 / (1 + 2 * step) for step in range(1, 13)]
    for rec in ranks:
        assert rec["groups"] == 2
        assert rec["local_sgd"] == "accepted"
        assert rec["restored"] == [True, True]
        assert [step[0] for step in rec["lrs"]] == [pytest.approx([lr, lr]) for lr in expected]
