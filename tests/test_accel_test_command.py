"""`accel test`: a real short run on N processes through `accel launch`, with a clear verdict."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_shadow import hide_plugins


def accel_test(args: list[str], tmp_path: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    """`accel test` with only the kernel and the ddp plugin visible (other installed plugins hidden)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_"))}
    shadow = hide_plugins(tmp_path / "shadow", keep=("ddp",))
    env.update(ACCEL_HOME=str(tmp_path), PYTHONPATH=str(shadow), **extra)
    return subprocess.run([sys.executable, "-m", "accel.commands.cli", "test", *args], env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_accel_test_two_cpu_processes_succeeds(tmp_path: Path) -> None:
    result = accel_test(["-n", "2"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "accel test: success: 5 checks passed on each of 2 process(es)" in result.stdout
    assert "plugins: ddp:strategy" in result.stdout
    for process in (0, 1):
        assert f"[process {process}] ok   training" in result.stdout
        assert f"[process {process}] ok   gather_for_metrics" in result.stdout


def test_accel_test_uses_the_config_file(tmp_path: Path) -> None:
    """The default config asks for fp16; no precision plugin is installed, so the launch is refused clearly."""
    (tmp_path / "default_config.yaml").write_text("mixed_precision: fp16\nnum_processes: 1\n")
    result = accel_test([], tmp_path)
    assert result.returncode == 2
    assert "needs a plugin that provides 'precision:fp16'" in result.stderr
    assert "accel test: FAILED: `accel launch` refused these settings" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_accel_test_reports_processes_that_die_before_reporting(tmp_path: Path) -> None:
    """A process-group backend this torch build does not have: the workers fail in Kernel() setup."""
    result = accel_test(["-n", "2", "--ddp_backend", "mpi"], tmp_path)
    assert result.returncode == 1
    assert "accel test: FAILED: the processes exited with code" in result.stderr
    assert "before reporting" in result.stderr


def test_summary_names_the_failed_check_and_process(capsys: pytest.CaptureFixture[str]) -> None:
    from accel.commands.test_cmd import summarize

    ok = {"name": "world", "ok": True, "detail": "2 process(es)"}
    bad = {"name": "training", "ok": False, "detail": "parameters differ between processes by 0.5"}
    report = {"ok": False, "num_processes": 2, "device": "cpu", "mixed_precision": "no", "plugins": ["ddp:strategy"],
              "processes": [{"process": 0, "results": [ok]}, {"process": 1, "results": [ok, bad]}]}
    assert summarize(1, report, 3.0) == 1
    err = capsys.readouterr().err
    assert "accel test: FAILED on process 1: training: parameters differ between processes by 0.5" in err
