"""``accel test``: a short real end-to-end check of the installation with the current config.

It runs ``accel launch [your flags] <accel>/commands/selfcheck.py`` in a child process (so the processes really
start the way a training script would), then reads the report the main process wrote and prints one clear line:
success, or which check failed on which process, or that the processes died before reporting. No torch import here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from accel.commands.launch import Parser

SCRIPT = Path(__file__).with_name("selfcheck.py")


def test_command(argv: Sequence[str]) -> int:
    argv = list(argv)
    if any(a in ("-h", "--help") for a in argv):
        parser = Parser(
            prog="accel test",
            description="Run a short real check (a few training steps, collectives, "
            "gather_for_metrics) on every process with the current config. Every `accel launch` option is "
            "accepted, e.g. `accel test -n 2`, `accel test --config_file my.yaml`.",
        )
        parser.add_argument("--timeout", type=float, default=600, help="seconds before giving up [default: 600]")
        parser.parse_args(argv)
    timeout = 600.0
    if "--timeout" in argv:
        i = argv.index("--timeout")
        try:
            timeout = float(argv[i + 1])
        except (IndexError, ValueError):
            from accel.errors import UsageError

            raise UsageError("--timeout expects a number of seconds") from None
        del argv[i : i + 2]
    with tempfile.TemporaryDirectory(prefix="accel-test-") as report_dir:
        cmd = [sys.executable, "-m", "accel.commands.launch", *argv, str(SCRIPT), "--report", report_dir]
        print(f"accel test: running accel launch {' '.join(argv)} {SCRIPT.name}".replace("  ", " "), flush=True)
        start = time.perf_counter()
        try:
            code = subprocess.call(cmd, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(
                f"accel test: FAILED: the processes did not finish within {timeout:g} s (a hang in a collective?)",
                file=sys.stderr,
            )
            return 1
        seconds = time.perf_counter() - start
        report_file = Path(report_dir) / "report.json"
        report = json.loads(report_file.read_text(encoding="utf-8")) if report_file.is_file() else None
    return summarize(code, report, seconds)


def summarize(code: int, report: dict[str, Any] | None, seconds: float) -> int:
    """Print the verdict; return the exit code of ``accel test``."""
    if code == 2 and report is None:
        print("accel test: FAILED: `accel launch` refused these settings (see the error above)", file=sys.stderr)
        return 2
    if report is None:
        print(
            f"accel test: FAILED: the processes exited with code {code} before reporting; see the output above",
            file=sys.stderr,
        )
        return 1
    failures = [(p["process"], r) for p in report["processes"] for r in p["results"] if not r["ok"]]
    if failures or code != 0 or not report["ok"]:
        for proc, r in failures:
            print(f"accel test: FAILED on process {proc}: {r['name']}: {r['detail']}", file=sys.stderr)
        if not failures:
            print(f"accel test: FAILED: the processes exited with code {code}", file=sys.stderr)
        return 1
    plugins = ", ".join(report["plugins"]) or "none (kernel only)"
    checks = len(report["processes"][0]["results"]) if report["processes"] else 0
    print(
        f"accel test: success: {checks} checks passed on each of {report['num_processes']} process(es) "
        f"(device {report['device']}, mixed precision {report['mixed_precision']}, plugins: {plugins}) "
        f"in {seconds:.1f} s. You are ready for distributed training!"
    )
    return 0


__all__ = ["test_command", "summarize", "SCRIPT"]
