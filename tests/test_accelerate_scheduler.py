"""A prepared LR scheduler steps as under Accelerate: the same curve on 2 real processes (gloo) for StepLR,
OneCycleLR and LambdaLR built from ``len(dataloader) * epochs`` before ``prepare``, with accumulation,
``split_batches`` and ``step_scheduler_with_optimizer=False``; ``scheduler_steps="per_optimizer_step"`` steps once
per optimizer step.

The reference curves (tests/data/accelerate_lr_curves.json) were recorded by running tests/scripts/lr_curves.py
under Accelerate 1.15 itself; where that Accelerate is installed (/work/venvs/acc), a test runs it again live.
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

from accel.testing import free_port, isolated_env, make_kernel, run_launch

TESTS = Path(__file__).parent
SCRIPT = TESTS / "scripts" / "lr_curves.py"
RANKS = json.loads((TESTS / "data" / "accelerate_lr_curves.json").read_text())["ranks"]
RECORDED = RANKS[0]
ACCELERATE_PYTHON = Path(os.environ.get("ACCEL_TEST_ACCELERATE_PYTHON", "/work/venvs/acc/bin/python"))
sys.path.insert(0, str(SCRIPT.parent))
import lr_curves  # noqa: E402  (the worker's scheduler and case definitions)


def read(out: Path, framework: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"{framework}_rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def accel_curves(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("lr")
    run_launch(
        ["-q", str(SCRIPT), str(tmp / "out")],
        num_processes=2,
        registered=["ddp"],
        home=tmp / "home",
        cwd=tmp,
        timeout=300,
    )
    return read(tmp / "out", "accel")


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(RECORDED))
def test_two_processes_follow_accelerates_curve_and_shards(accel_curves: list[dict[str, Any]], case: str) -> None:
    """Exact: the same scheduler calls in the same order, and each process got the same samples in the same batches
    (dealt, or split with ``split_batches``; the last batches completed from the start with ``even_batches``)."""
    for rank, recorded in zip(accel_curves, RANKS, strict=True):
        assert rank[case]["lrs"] == recorded[case]["lrs"]
        assert rank[case]["optimizer_steps"] == recorded[case]["optimizer_steps"]
        assert rank[case]["batches"] == recorded[case]["batches"]
        assert rank[case]["inputs"] == recorded[case]["inputs"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("scheduler", sorted(lr_curves.SCHEDULERS))
def test_per_optimizer_step_steps_once_per_optimizer_step(accel_curves: list[dict[str, Any]], scheduler: str) -> None:
    """The option keeps accel's former rule: one scheduler step per optimizer step, whatever the process count."""
    got = accel_curves[0][f"{scheduler}/per_optimizer_step"]
    assert accel_curves[1][f"{scheduler}/per_optimizer_step"]["lrs"] == got["lrs"]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = lr_curves.SCHEDULERS[scheduler](optimizer, 11 * lr_curves.EPOCHS)  # 42 samples / 4 = 11 batches
    expected = []
    for _ in range(got["optimizer_steps"]):
        optimizer.step()
        sched.step()
        expected.append(sched.get_last_lr()[0])
    assert got["lrs"] == expected
    # ... which is half of Accelerate's pace on 2 processes (the schedule of "default" ends on time, this one not)
    assert RECORDED[f"{scheduler}/default"]["lrs"] != got["lrs"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.skipif(not ACCELERATE_PYTHON.exists(), reason=f"needs a Python with Accelerate: {ACCELERATE_PYTHON}")
def test_recorded_curves_are_accelerates_own(tmp_path: Path, accel_curves: list[dict[str, Any]]) -> None:
    """Run the same worker under Accelerate on 2 CPU processes now: it gives the recorded curves, and accel's."""
    env = isolated_env(tmp_path / "home", extra={"ACCELERATE_USE_CPU": "1"})
    env.pop("PYTHONPATH", None)
    subprocess.run(
        [
            str(ACCELERATE_PYTHON),
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            str(SCRIPT),
            str(tmp_path / "out"),
            "--framework",
            "accelerate",
        ],
        env=env,
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=300,
    )
    live = read(tmp_path / "out", "accelerate")
    assert live == RANKS
    assert [{k: v for k, v in rank.items() if k in RECORDED} for rank in accel_curves] == RANKS


# ---- one process: the rule's parts ---------------------------------------------------------------------------


def parts(batches: int = 8) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(2 * batches, 3), torch.randn(2 * batches, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    return model, opt, loader


def run(kernel: Any, sched_of: Any, batches: int = 8) -> tuple[list[float], Any]:
    model, opt, loader = parts(batches)
    sched = sched_of(opt)
    model, opt, loader, sched = kernel.prepare(model, opt, loader, sched)
    lrs = []
    for x, y in loader:
        with kernel.accumulate(model):
            kernel.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
    kernel.end_training()
    return lrs, sched


def test_not_stepping_with_the_optimizer_steps_on_every_call() -> None:
    kernel = make_kernel(gradient_accumulation_steps=4, step_scheduler_with_optimizer=False)
    lrs, _ = run(kernel, lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    assert lrs == pytest.approx([0.1 * 0.5 ** (i + 1) for i in range(8)])  # accumulation steps included


def test_accumulation_steps_count_in_step_count_unless_adjust_scheduler_is_off() -> None:
    from accel import GradientAccumulationPlugin

    make = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # noqa: E731
    lrs, sched = run(make_kernel(gradient_accumulation_steps=4), make)
    assert lrs == pytest.approx([0.1] * 3 + [0.05] * 4 + [0.025])
    assert sched._step_count == 1 + 8  # Accelerate's adjust_scheduler: every micro-batch counts
    plugin = GradientAccumulationPlugin(num_steps=4, adjust_scheduler=False)
    lrs, sched = run(make_kernel(gradient_accumulation_plugin=plugin), make)
    assert lrs == pytest.approx([0.1] * 3 + [0.05] * 4 + [0.025]) and sched._step_count == 1 + 2


def test_one_cycle_stops_at_its_end_instead_of_raising() -> None:
    lrs, sched = run(make_kernel(), lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=5))
    assert len(lrs) == 8 and sched._step_count == 6  # 5 steps, then Accelerate's rule stops calling it


def test_scheduler_steps_option_is_validated_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    from accel.errors import UsageError

    with pytest.raises(UsageError, match="scheduler_steps.*must be one of accelerate, per_optimizer_step"):
        make_kernel(scheduler_steps="per_step")
    monkeypatch.setenv("ACCEL_SCHEDULER_STEPS", "per_optimizer_step")
    kernel = make_kernel()
    assert kernel.settings["scheduler_steps"] == "per_optimizer_step"
    kernel.end_training()
