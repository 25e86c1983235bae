"""Every script of examples/ runs, as its docstring says to run it (2 processes where it is about distribution), and
prints what it promises. Synthetic or bundled data only: nothing is downloaded."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from clitools import ACCEL, deepspeed_env, launch_env

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(args: list[str], tmp: Path, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    env = env or {**launch_env(tmp), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(args, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def example(name: str) -> str:
    return str(EXAMPLES / name)


def test_every_example_has_a_test() -> None:
    source = Path(__file__).read_text() + '"train_digits.py"'  # run by tests/test_distributed.py
    missing = [p.name for p in EXAMPLES.glob("*.py") if f'"{p.name}"' not in source]
    assert not missing, missing


@pytest.mark.slow
@pytest.mark.multiprocess
def test_checkpoint_resume_continues_after_the_last_saved_epoch(tmp_path: Path) -> None:
    project = str(tmp_path / "ckpt")
    first = run([ACCEL, "launch", "-q", "-n", "2", example("checkpoint_resume.py"), "--project_dir", project], tmp_path)
    assert re.findall(r"^epoch (\d): loss", first, re.M) == ["0", "1"], first
    args = [example("checkpoint_resume.py"), "--project_dir", project, "--epochs", "3"]
    second = run([ACCEL, "launch", "-q", "-n", "2", *args], tmp_path)
    assert "resumed from checkpoint_1: epoch 2 is next" in second, second
    assert re.findall(r"^epoch (\d): loss", second, re.M) == ["2"], second


def test_tracking_writes_the_config_and_metrics(tmp_path: Path) -> None:
    out = run([sys.executable, example("tracking.py"), "--project_dir", str(tmp_path / "track")], tmp_path)
    assert "logged 24 steps to jsonl" in out, out
    text = (tmp_path / "track" / "jsonl" / "tracking_example.jsonl").read_text()
    assert '"lr": 0.05' in text and '"train/loss"' in text, text


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gradient_accumulation_steps_every_fourth_batch(tmp_path: Path) -> None:
    out = run([ACCEL, "launch", "-q", "-n", "2", example("gradient_accumulation.py")], tmp_path)
    # 320 samples / 2 processes / batches of 8 = 20 batches per epoch and process: 5 optimizer steps per epoch
    assert re.findall(r"(\d+) optimizer steps", out) == ["5", "10", "15"], out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp_shards_the_parameters(tmp_path: Path) -> None:
    out = run([ACCEL, "launch", "-q", "-n", "2", "--plugin", "fsdp", example("fsdp.py")], tmp_path)
    match = re.search(r"2 process\(es\): (\d+) of (\d+) parameters on each process", out)
    assert match and 2 * int(match[1]) <= int(match[2]) + 64, out  # about half each (uneven rows round up)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)  # the first DeepSpeed process group of a clean workspace compiles an op
def test_deepspeed_zero_2_trains(tmp_path: Path) -> None:
    args = [ACCEL, "launch", "-q", "-n", "2", "--plugin", "deepspeed", "--zero_stage", "2"]
    out = run([*args, example("deepspeed_zero.py")], tmp_path, env=deepspeed_env(tmp_path), timeout=900)
    assert re.findall(r"^epoch (\d): loss", out, re.M) == ["0", "1"], out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_nd_parallel_tensor_parallel_on_two_processes(tmp_path: Path) -> None:
    args = [ACCEL, "launch", "-q", "-n", "2", "--plugin", "parallel", "--parallelism_config_tp_size", "2"]
    out = run([*args, example("nd_parallel.py")], tmp_path)
    assert "2 processes: 1 data shard(s) x tensor parallel 2" in out, out


def test_big_model_inference_offloads_to_disk_with_the_same_output(tmp_path: Path) -> None:
    out = run([sys.executable, example("big_model_inference.py"), "--workdir", str(tmp_path / "big")], tmp_path)
    match = re.search(r"device map: (\d+) parts in CPU memory, (\d+) on disk", out)
    assert match and int(match[1]) > 0 and int(match[2]) > 0, out
    assert "same output as the fully loaded model: True" in out, out


@pytest.mark.multiprocess
def test_notebook_launcher_returns_results_in_process_order(tmp_path: Path) -> None:
    out = run([sys.executable, example("notebook_launcher.py")], tmp_path)
    assert "process 0 of 2: final loss" in out, out
    assert re.search(r"results, in process order: \[[\d.]+, [\d.]+\]", out), out
