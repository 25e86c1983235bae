"""transformers' ``Trainer`` on accel-accelerate against Hugging Face Accelerate 1.15: the same script
(compat/accelerate/tests/scripts/trainer_regression.py, transformers' own test model), the same process count, each
run in processes of its own (accel: ``accel launch``; Accelerate: ``python``/``torchrun`` with its package first on
the path, as ``accelerate launch`` runs it), alternated A B A B ..., optimizer steps per second after the first 10.

    python bench/trainer_step.py [--repeats 5] [--steps 300] [--processes 1 2] [--no-write]

Accelerate comes from ``.venv/accelerate-real`` (``make setup`` installs it). Writes the ``trainer-step`` section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import free_port, machine, write_section

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "compat" / "accelerate" / "tests" / "scripts" / "trainer_regression.py"
REAL = Path(sys.prefix) / "accelerate-real"


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the variables that choose an ``accelerate`` or a launch, warnings off, workers cold."""
    env = {k: v for k, v in os.environ.items() if k not in ("ACCEL_ACCELERATE", "ACCEL_CONFIG", "PYTHONPATH")}
    env.update(PYTHONWARNINGS="ignore", WARM_WORKERS="0", **extra)
    return env


def one_run(impl: str, processes: int, steps: int) -> float:
    """Optimizer steps per second of process 0 in one run of ``impl`` ("accel" or "accelerate")."""
    with tempfile.TemporaryDirectory() as out:
        env = clean_env()
        args = [
            str(SCRIPT),
            out,
            "--steps",
            str(steps),
            "--accumulate",
            "1",
            "--save-steps",
            str(10 * steps),
            "--length",
            str(4 * steps * processes),
            "--logging-steps",
            str(steps),
        ]
        if impl == "accel":
            cmd = [
                sys.executable,
                "-m",
                "accel.commands.cli",
                "launch",
                "-n",
                str(processes),
                "--main_process_port",
                str(free_port()),
                "-q",
                *args,
            ]
        else:
            env.update(PYTHONPATH=str(REAL), ACCEL_ACCELERATE="0")
            cmd = [sys.executable]
            if processes > 1:
                cmd += ["-m", "torch.distributed.run", f"--nproc_per_node={processes}", f"--master_port={free_port()}"]
            cmd += args
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode:
            raise SystemExit(f"{impl} on {processes} process(es) failed:\n{proc.stderr[-3000:]}")
        row = json.loads((Path(out) / "result-0.json").read_text())
        assert ("accel_accelerate" in row["accelerate"]) == (impl == "accel"), row["accelerate"]
        return float(row["steps_per_second"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()
    if not (REAL / "accelerate" / "__init__.py").is_file():
        raise SystemExit(f"Accelerate 1.15 is not installed in {REAL}: run `make setup`")
    rows = []
    for n in args.processes:
        rounds: dict[str, list[float]] = {"accel": [], "accelerate": []}
        for _ in range(args.repeats):
            for impl in rounds:  # alternated: the machine's drift hits both alike
                rounds[impl].append(one_run(impl, n, args.steps))
        ratios = sorted(a / b for a, b in zip(rounds["accel"], rounds["accelerate"], strict=True))
        rows.append(
            f"| {n} | {statistics.median(rounds['accelerate']):.0f} | {statistics.median(rounds['accel']):.0f} | "
            f"**{statistics.median(ratios):.3f}** | {ratios[0]:.3f}-{ratios[-1]:.3f} |"
        )
    body = "\n".join(
        [
            "### transformers' Trainer: accel-accelerate vs Accelerate 1.15",
            "",
            f"`python bench/trainer_step.py --repeats {args.repeats} --steps {args.steps}`: {machine()}. The same "
            "unchanged Trainer script (transformers' regression test model, batch 4, no accumulation), each run in "
            "its own processes, alternated; optimizer steps per second of process 0 after the first 2, medians; "
            "ratio = accel / Accelerate per round (median, then the range over rounds).",
            "",
            "| processes | Accelerate steps/s | accel steps/s | ratio | range |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    print(body)
    if not args.no_write:
        write_section("trainer-step", body)


if __name__ == "__main__":
    main()
