"""accel.commands.test_cmd and accel.commands.selfcheck, the ``accel test`` group: the verdict printed from the
processes' reports names the failed check and the process it failed on, and its exit code is the run's; the
self-check script passes every check in one process with the kernel alone and writes its report. The real runs on
1, 2 and more processes, with each strategy and precision, are in tests/test_accel_test_command.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from accel.commands.selfcheck import Checks
from accel.testing import isolated_env


def test_summary_names_the_failed_check_and_process(capsys: pytest.CaptureFixture[str]) -> None:
    from accel.commands.test_cmd import summarize

    ok = {"name": "world", "ok": True, "detail": "2 process(es)"}
    bad = {"name": "training", "ok": False, "detail": "parameters differ between processes by 0.5"}
    report = {
        "ok": False,
        "num_processes": 2,
        "device": "cpu",
        "mixed_precision": "no",
        "plugins": ["ddp:strategy"],
        "processes": [{"process": 0, "results": [ok]}, {"process": 1, "results": [ok, bad]}],
    }
    assert summarize(1, report, 3.0) == 1
    err = capsys.readouterr().err
    assert "accel test: FAILED on process 1: training: parameters differ between processes by 0.5" in err


def test_a_failing_check_is_recorded_and_the_others_still_run() -> None:
    checks = Checks()
    checks.run("first", lambda: "fine")
    checks.run("second", lambda: str(1 // 0))
    checks.run("third", lambda: "also fine")
    assert [(r["name"], r["ok"], r["detail"]) for r in checks.results] == [
        ("first", True, "fine"),
        ("second", False, "ZeroDivisionError: integer division or modulo by zero"),
        ("third", True, "also fine"),
    ]


@pytest.mark.slow  # a real short run: 10 s on the shared 2-core machine
def test_the_self_check_passes_in_one_process_with_the_kernel_alone(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "accel.commands.selfcheck", "--report", str(tmp_path / "report"), "--steps", "4"],
        env=isolated_env(tmp_path / "home", registered=[]),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["ok"] and report["num_processes"] == 1 and report["plugins"] == []
    (only,) = report["processes"]
    names = [r["name"] for r in only["results"]]
    assert all(r["ok"] for r in only["results"]) and {"world", "training"} <= set(names), only
    assert len([line for line in proc.stdout.splitlines() if line.startswith("accel test [process 0] ok ")]) == len(
        names
    )
