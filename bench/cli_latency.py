"""Wall time of accel's informational commands next to Accelerate's equivalents.

    python bench/cli_latency.py --accelerate /tmp/venv-accelerate/bin/accelerate [--runs 9]

Each command runs as a fresh process, round-robin (one run of every command, then the next round) so a busy
machine slows all of them alike; a warm-up round is not counted. Config lookups point at empty directories
(ACCEL_HOME, HF_HOME). Prints a Markdown table: median, min and max in seconds.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def commands(
    accel: str, accelerate: str | None, python: str, accelerate_python: str | None
) -> list[tuple[str, list[str]]]:
    rows = [
        ("accel --help", [accel, "--help"]),
        ("accel launch --help", [accel, "launch", "--help"]),
        ("accel plugins", [accel, "plugins"]),
        ("accel env", [accel, "env"]),
        ("python -c 'import torch' (accel's venv)", [python, "-c", "import torch"]),
    ]
    if accelerate:
        rows += [
            ("accelerate --help", [accelerate, "--help"]),
            ("accelerate launch --help", [accelerate, "launch", "--help"]),
            ("accelerate env", [accelerate, "env"]),
        ]
    if accelerate_python:
        rows.append(("python -c 'import torch' (Accelerate's venv)", [accelerate_python, "-c", "import torch"]))
    return rows


def measure(rows: list[tuple[str, list[str]]], runs: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds of each command over ``runs`` round-robin rounds (after one warm-up round)."""
    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, ACCEL_HOME=home, HF_HOME=home, XDG_CACHE_HOME=home)
        times: dict[str, list[float]] = {name: [] for name, _ in rows}
        cpu: dict[str, list[float]] = {name: [] for name, _ in rows}
        for round_ in range(runs + 1):
            for name, cmd in rows:
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                start = time.perf_counter()
                proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                elapsed = time.perf_counter() - start
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                if proc.returncode != 0:
                    raise SystemExit(f"{name} failed ({proc.returncode}): {proc.stderr.decode()[-500:]}")
                if round_:  # round 0 is the warm-up
                    times[name].append(elapsed)
                    cpu[name].append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return times, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accel", default=str(Path(sys.executable).with_name("accel")))
    parser.add_argument("--accelerate", default=None, help="path of the `accelerate` script of a scratch venv")
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    accelerate_python = str(Path(args.accelerate).with_name("python")) if args.accelerate else None
    rows = commands(args.accel, args.accelerate, sys.executable, accelerate_python)
    times, cpu = measure(rows, args.runs)
    print(
        f"{platform.platform()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}; "
        f"{args.runs} runs each after one warm-up, round-robin\n"
    )
    print("| command | wall median (s) | wall min (s) | wall max (s) | CPU median (s) |")
    print("|---|---|---|---|---|")
    for name, _ in rows:
        values = times[name]
        print(
            f"| `{name}` | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} "
            f"| {statistics.median(cpu[name]):.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
