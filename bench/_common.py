"""Shared helpers of the benchmarks: alternating runs, medians, a scratch Accelerate venv, docs sections."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
ACCELERATE_VENV = Path(os.environ.get("ACCEL_BENCH_ACCELERATE_VENV", ROOT / "bench" / ".venv-accelerate"))


def accelerate_python(create: bool = True) -> str | None:
    """Python of a scratch venv with torch 2.13.0 and accelerate (created on first use; None if that fails)."""
    py = ACCELERATE_VENV / "bin" / "python"
    if py.exists():
        return str(py)
    if not create:
        return None
    try:
        subprocess.run([sys.executable, "-m", "venv", str(ACCELERATE_VENV)], check=True)
        pip = [str(py), "-m", "pip", "install", "-q"]
        subprocess.run(pip + ["torch==2.13.0"], check=True)  # first: never let pip choose torch
        subprocess.run(pip + ["numpy", "accelerate"], check=True)
    except (subprocess.CalledProcessError, OSError) as exc:
        print(f"bench: could not create the Accelerate venv ({exc}); comparing with raw PyTorch only", file=sys.stderr)
        return None
    return str(py)


def run_json(cmd: Sequence[str], env: dict[str, str] | None = None, timeout: float = 900) -> dict:
    """Run a command whose last stdout line is a JSON object; return it."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 and not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    if proc.returncode != 0:  # it measured and reported, then failed on the way out (e.g. gloo's abort at exit)
        print(f"bench: {' '.join(cmd[:3])}... exited {proc.returncode} after reporting; result kept", file=sys.stderr)
    return json.loads(lines[-1])


def segment_arguments() -> argparse.Namespace:
    """The options of a script that runs its loops in one process, in alternating segments of micro-steps."""
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=60, help="segments of each loop")
    p.add_argument("--steps", type=int, default=500, help="micro-steps per segment")
    p.add_argument("--json", action="store_true", help="print the raw figures (bench/run.py reads them)")
    return p.parse_args()


def alternate_runs(cmds: dict[str, list[str]], repeats: int) -> dict[str, list[dict]]:
    """Run the commands A B C A B C ... ``repeats`` times; every run's JSON result, by command name."""
    out: dict[str, list[dict]] = {name: [] for name in cmds}
    for _ in range(repeats):
        for name, cmd in cmds.items():
            out[name].append(run_json(cmd))
    return out


def med(values: Sequence[float]) -> float:
    return statistics.median(values)


def ddp_setting(precision: str, accum: int) -> str:
    """The label bench/instructions.py counts a one-process DDP loop under, for ``--mixed-precision``/``--accum``;
    bench/run.py's ddp-sizes rows name the same label to find that count."""
    return (
        "DDP (one process), tiny MLP"
        + (", bf16" if precision == "bf16" else "")
        + (f", accumulate({accum})" if accum > 1 else "")
    )


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or platform's guess: figures from different machines differ 2x."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    import importlib.metadata as md

    versions = []
    for dist in ("accel-kernel", "torch", "pluggy"):
        try:
            versions.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{date.today().isoformat()}; {platform.platform()}; {os.cpu_count()} CPU cores ({cpu_model()}); Python "
        f"{platform.python_version()}; {', '.join(versions)}; load average at start {load:.1f}"
    )


def block_class() -> type:
    """The residual block of the memory and pipeline benchmarks: ``x + fc2(relu(fc1(x)))``, two ``d``-wide linears."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.fc1 = nn.Linear(d, d)
            self.fc2 = nn.Linear(d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(torch.relu(self.fc1(x)))

    return Block


def write_section(name: str, body: str) -> None:
    """Replace (or append) the block between ``<!-- bench:name -->`` markers in docs/benchmarks.md."""
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = DOCS.read_text(encoding="utf-8") if DOCS.exists() else "# Benchmarks\n"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOCS.write_text(text, encoding="utf-8")


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


def worker_or_measure(worker: Callable[[], None], measure: Callable[[], dict[str, Any]]) -> None:
    """The entry point of a bench script that runs itself under valgrind: ``--worker`` runs ``worker`` (the measured
    process), otherwise ``measure()``'s result is printed as one JSON line (``run_json`` reads the last)."""
    if "--worker" in sys.argv[1:]:
        worker()
    else:
        print(json.dumps(measure()))


def callgrind(script: str, out_file: str, *options: str, env: dict[str, str] | None = None) -> str:
    """``python SCRIPT --worker`` under valgrind's callgrind, its counts dumped before every ``os.getppid()`` call
    (the scripts' phase marker) into files named after ``out_file``; its stdout. RuntimeError when the run fails."""
    cmd = ["valgrind", "--tool=callgrind", "--dump-before=os_getppid*", *options, f"--callgrind-out-file={out_file}"]
    proc = subprocess.run(
        [*cmd, sys.executable, script, "--worker"], capture_output=True, text=True, cwd=Path(__file__).parent, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"callgrind run failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return proc.stdout


def callgrind_total(path: Path) -> int | None:
    """The instructions one callgrind output file counted (None if it holds no total)."""
    found = re.search(r"^(?:summary|totals): (\d+)", path.read_text(encoding="utf-8", errors="replace"), re.M)
    return int(found.group(1)) if found else None


def free_port() -> int:
    """A port free on 127.0.0.1 now: each launch gets its own (a fixed 29500 collides with the previous run's)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
