"""Launched, separate processes: each framework through its own launcher, as a user runs it.

    python bench/launched.py [--rounds 5] [--quick]      # prints the table; bench/run.py writes it to the docs

The same training script shape (bench/launched_train.py: a prepared DataLoader over a TensorDataset, AdamW,
cross-entropy) runs under ``torchrun`` (raw PyTorch), ``accel launch``, ``accelerate launch`` and ``fabric run``;
Accelerate and Fabric only where their venvs exist (``ACCEL_BENCH_ACCELERATE_VENV``, default
bench/.venv-accelerate; ``ACCEL_BENCH_FABRIC_VENV``, default bench/.venv-fabric), otherwise a line says they were
skipped. Each round runs every framework once per workload, in an order that rotates from round to round; a
framework's figure is the median over rounds of its ratio to the raw run *of the same round*, with the lowest and
highest round ratio beside it (separate processes of one script differ by ±10-30 % on a shared machine, which the
spread shows). The rows with a target also run the raw torchrun command a second time in the rotation ("torchrun
again"): its ratio to the first raw run is what the comparison reads when nothing differs, the noise beside each
figure. Within a run, the script times its steps in ten parts and reports the median part's rate. Launch
rows time a script whose first statement prints a line (bench/launch_probe.py): seconds from starting the launcher
to that line, and to the launcher's exit, minus torchrun's in the same round.

bench/run.py's ``ddp-overhead`` and ``step-overhead`` sections are the in-process paired comparison (the framework's
loop and a raw loop interleaved in the same processes); this one is what a user comparing launchers sees.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from _common import free_port

HERE = Path(__file__).resolve().parent
PY = sys.executable
TRAIN = str(HERE / "launched_train.py")
PROBE = str(HERE / "launch_probe.py")
VENVS = {
    "accelerate": Path(os.environ.get("ACCEL_BENCH_ACCELERATE_VENV", HERE / ".venv-accelerate")),
    "fabric": Path(os.environ.get("ACCEL_BENCH_FABRIC_VENV", HERE / ".venv-fabric")),
}
#: label, processes, model, accumulation steps, clip norm
WORKLOADS: tuple[tuple[str, int, str, int, float], ...] = (
    ("1 process, tiny MLP", 1, "tiny", 1, 0.0),
    ("1 process, tiny, accumulate 4 + clip", 1, "tiny", 4, 1.0),
    ("1 process, medium MLP (1024-4096-1024)", 1, "medium", 1, 0.0),
    ("1 process, medium, accumulate 4 + clip", 1, "medium", 4, 1.0),
    ("2 processes DDP, tiny", 2, "tiny", 1, 0.0),
    ("2 processes DDP, tiny, accumulate 4 + clip", 2, "tiny", 4, 1.0),
    ("2 processes DDP, medium", 2, "medium", 1, 0.0),
    ("2 processes DDP, medium, accumulate 4 + clip", 2, "medium", 4, 1.0),
)
#: the issue's bar for accel per workload (its "done when"); rows not listed have no target
STEP_TARGETS = {label: 0.98 for label, n, *_ in WORKLOADS if n == 2} | {"1 process, tiny, accumulate 4 + clip": 0.99}
LAUNCH_TARGET_S = 0.05
#: the launch row that compares CPU seconds (the launcher's and its workers', to their exit) instead of wall time
LAUNCH_CPU = "launch -> exit, CPU seconds of the launcher and its workers"
#: the raw command run a second time in each round of the rows with a target: a comparison of raw with itself
AGAIN = "raw again"


def launchers() -> tuple[dict[str, Callable[[int, list[str]], list[str]]], list[str]]:
    """Each framework's own launcher, as a function of the process count and the script's command; and a line for
    each framework that is skipped (no venv)."""
    accel = str(Path(PY).with_name("accel"))
    found: dict[str, Callable[[int, list[str]], list[str]]] = {
        "raw": lambda n, script: [
            PY,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(n),
            f"--master_port={free_port()}",
            *script,
        ],
        "accel": lambda n, script: [
            accel,
            "launch",
            "-q",
            "-n",
            str(n),
            "--main_process_port",
            str(free_port()),
            *script,
        ],
    }
    skipped = []
    acc = VENVS["accelerate"] / "bin" / "accelerate"
    if acc.exists():
        found["accelerate"] = lambda n, script: [
            str(acc), "launch", "--num_processes", str(n), "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", str(free_port()),
            *(["--multi_gpu"] if n > 1 else ["--cpu"]), *script,
        ]  # fmt: skip
    else:
        skipped.append(f"Accelerate: skipped, no venv at {VENVS['accelerate']} (ACCEL_BENCH_ACCELERATE_VENV)")
    fab = VENVS["fabric"] / "bin" / "fabric"
    if fab.exists():
        found["fabric"] = lambda n, script: [
            str(fab), "run", "--accelerator", "cpu", "--devices", str(n), "--main-port", str(free_port()),
            *(["--strategy", "ddp"] if n > 1 else []), *script,
        ]  # fmt: skip
    else:
        skipped.append(f"Lightning Fabric: skipped, no venv at {VENVS['fabric']} (ACCEL_BENCH_FABRIC_VENV)")
    return found, skipped


def run_once(cmd: list[str], timeout: float = 120) -> tuple[float, float, float, dict[str, float]]:
    """Seconds from starting ``cmd`` to its first stdout line and to its exit, the CPU seconds it and its children
    used, and its last JSON line ({} if none). The environment is the caller's without the test suite's warm-worker
    switches: what users get, with a temp directory of its own, removed afterwards (torchrun leaves its run records
    there). A run still going after ``timeout`` seconds (a launcher whose worker died while the other waits in a
    collective) is killed with its whole process group and raises."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARM_WORKERS")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    with tempfile.TemporaryDirectory(prefix="accel-bench-") as temp:
        return _run_once(cmd, timeout, dict(env, TMPDIR=temp), Path(temp, "stderr"))


def _run_once(
    cmd: list[str], timeout: float, env: dict[str, str], stderr: Path
) -> tuple[float, float, float, dict[str, float]]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    # stderr goes to a file, so stdout is read whole through one reader: communicate() after readline() would miss
    # what the reader had already taken in with the first line
    with stderr.open("w") as errors:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True, env=env, start_new_session=True)
    killer = threading.Timer(timeout, kill_tree, (proc.pid,))  # also ends a read that waits
    killer.start()
    try:
        assert proc.stdout is not None
        with proc.stdout:
            proc.stdout.readline()
            first = time.perf_counter() - start
            out = proc.stdout.read()
        proc.wait()
    finally:
        killer.cancel()
    done = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if proc.returncode != 0:
        why = f"killed after {timeout:.0f} s" if done >= timeout else f"exit {proc.returncode}"
        raise RuntimeError(f"{' '.join(cmd)} failed ({why}):\n{stderr.read_text()[-2000:]}")
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return first, done, cpu, json.loads(lines[-1]) if lines else {}


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it: a launcher's workers may sit in process groups of their own
    (torch elastic starts them so) and would keep the output pipe open."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo = [pid]
    while todo:
        one = todo.pop()
        todo.extend(children.get(one, []))
        try:
            os.kill(one, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_retried(cmd: list[str]) -> tuple[float, float, float, dict[str, float]]:
    """``run_once``, tried a second time when the first fails: one launcher's rare crash or hang (a worker lost at
    start) does not throw away the other frameworks' rounds. The retry is printed; a second failure raises."""
    try:
        return run_once(cmd)
    except RuntimeError as e:
        print(f"bench: retrying once: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
        return run_once(cmd)


def spread(values: list[float], fmt: str) -> str:
    """The median, then the lowest..highest value (``fmt`` "rate": 3 significant digits below 100)."""

    def one(v: float) -> str:
        return (f"{v:.0f}" if v >= 100 else f"{v:.3g}") if fmt == "rate" else format(v, fmt)

    if not values:
        return "- (every run lost)"
    return f"{one(statistics.median(values))} ({one(min(values))}..{one(max(values))})"


def measure(rounds: int, quick: bool = False) -> dict[str, dict[str, list[dict[str, float]]]]:
    """Per workload (and the launch rows), per framework: one result per round (``steps_per_s`` and
    ``cpu_ms_per_step`` of rank 0; ``seconds`` for the launch rows)."""
    found, _ = launchers()
    names = [*found, AGAIN]
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    LOST.clear()
    for r in range(rounds):
        print(f"bench: launched, round {r + 1} of {rounds}", file=sys.stderr, flush=True)
        order = names[r % len(names) :] + names[: r % len(names)]  # who goes first rotates
        for label, n, model, accum, clip in WORKLOADS:
            steps = ["--steps", "200" if model == "tiny" else "8"] if quick else []
            args = [TRAIN, "--model", model, "--accum", str(accum), "--clip", str(clip), *steps]
            row = results.setdefault(label, {})
            for name in order:
                if name == AGAIN and label not in STEP_TARGETS:
                    continue
                impl = "raw" if name == AGAIN else name
                got = run_peer(name, found[impl](n, [*args, "--impl", impl]))
                row.setdefault(name, []).append(got[3] if got else {})  # a lost run is {}
        for name in (name for name in order if name != AGAIN):
            got = run_peer(name, found[name](2, [PROBE]))
            seconds = got[:3] if got else (None, None, None)
            for label, value in zip(("launch -> first line", "launch -> exit", LAUNCH_CPU), seconds, strict=True):
                results.setdefault(label, {}).setdefault(name, []).append({} if value is None else {"seconds": value})
    return results


#: per peer framework, the runs lost this measurement (it failed twice): its rounds leave them out
LOST: dict[str, list[str]] = {}


def run_peer(name: str, cmd: list[str]) -> tuple[float, float, float, dict[str, float]] | None:
    """``run_retried`` for raw and accel (a second failure ends the section); for a peer framework (Accelerate,
    Fabric), whose columns are context and not targets, a second failure loses that one run: None, counted in
    ``LOST`` (the table says so), and its round is left out of that framework's figures."""
    if name in ("raw", "accel", AGAIN):
        return run_retried(cmd)
    try:
        return run_retried(cmd)
    except RuntimeError as e:
        first_line = str(e).splitlines()[0]
        print(f"bench: {name}'s run lost: {first_line}", file=sys.stderr, flush=True)
        LOST.setdefault(name, []).append(first_line.rsplit(" failed ", 1)[-1].rstrip(":"))
        return None


def ratios(row: dict[str, list[dict[str, float]]], name: str, key: str = "steps_per_s") -> list[float]:
    """``name``'s speed relative to raw's in each round (above 1: faster); ``key`` "cpu_ms_per_step" compares the
    CPU time per step of rank 0 instead (raw's / the framework's)."""
    pairs = [(ours, raw) for ours, raw in zip(row[name], row["raw"], strict=True) if ours]  # lost runs are {}
    if key == "steps_per_s":
        return [ours[key] / raw[key] for ours, raw in pairs]
    return [raw[key] / ours[key] for ours, raw in pairs]


def table(results: dict[str, dict[str, list[dict[str, float]]]], target: Callable[..., None] | None = None) -> str:
    """The markdown table: per-round ratios to raw (median, lowest..highest round) and launch differences."""
    found, skipped = launchers()
    names = [n for n in found if n != "raw"]
    head = {"accel": "accel launch", "accelerate": "accelerate launch", "fabric": "fabric run"}
    rows = [
        f"| workload | raw (torchrun), steps/s | {' | '.join(head[n] + ' / raw' for n in names)} "
        "| accel launch / raw, by CPU time per step | torchrun again / raw (the noise) |",
        "|---|---|" + "---|" * len(names) + "---|---|",
    ]
    for label, *_ in WORKLOADS:
        row = results[label]
        again = spread(ratios(row, AGAIN), ".3f") if AGAIN in row else "-"
        cells = []
        for name in names:
            by_rate = ratios(row, name)
            cells.append(spread(by_rate, ".3f"))
            if name == "accel" and target is not None and label in STEP_TARGETS:
                goal = STEP_TARGETS[label]
                target(
                    f"launched: {label}, accel launch / torchrun",
                    f">= {goal}x torchrun (median of rounds)",
                    f"{spread(by_rate, '.3f')}; by CPU per step {spread(ratios(row, name, 'cpu_ms_per_step'), '.3f')}; "
                    f"torchrun again / torchrun {again}",
                    statistics.median(by_rate) >= goal,
                )
        cells.append(spread(ratios(row, "accel", "cpu_ms_per_step"), ".3f"))
        cells.append(again)
        rate = spread([r["steps_per_s"] for r in row["raw"]], "rate")
        rows.append(f"| {label} | {rate} | {' | '.join(cells)} |")
    for label in ("launch -> first line", "launch -> exit", LAUNCH_CPU):
        row = results[label]
        cells = []
        for name in names:
            deltas = [a["seconds"] - b["seconds"] for a, b in zip(row[name], row["raw"], strict=True) if a]
            cells.append(f"{spread(deltas, '+.3f')} s")
            if name == "accel" and target is not None and label != LAUNCH_CPU:
                target(
                    f"launched: {label}, `accel launch -n 2` minus torchrun",
                    f"<= +{LAUNCH_TARGET_S} s",
                    f"{spread(deltas, '+.3f')} s",
                    statistics.median(deltas) <= LAUNCH_TARGET_S,
                )
        raw_s = spread([r["seconds"] for r in row["raw"]], ".3f")
        rows.append(f"| {label}, 2 processes, minus torchrun | {raw_s} s | {' | '.join(cells)} | | |")
    rounds = len(next(iter(results.values()))["raw"])
    notes = [
        f"{rounds} round(s). Each cell: the median over rounds of the ratio to the raw run of the same round, then the "
        "lowest..highest round; the raw column is steps/s (median, lowest..highest). Launch rows: seconds to the "
        "script's first line and to the launcher's exit (the raw column: torchrun's own; the others: minus "
        "torchrun's in the same round); the CPU row adds up the launcher's and its workers' CPU time, which the "
        "machine's load affects less than the wall time. \"By CPU time per step\": rank 0's CPU seconds per step (all its threads), "
        "raw's over accel's, per round: less sensitive to the machine's load than steps/s. \"Torchrun again\": the raw "
        "torchrun command run a second time in the same rounds (rows with a target), over the first raw run: the "
        "same command compared with itself, so how far it lies from 1.000 is what this comparison reads when nothing "
        "differs.",
        *skipped,
        *(
            f"{head[name]}: {len(why)} run(s) lost, each failing twice: {', '.join(sorted(set(why)))}; their rounds "
            "are left out of its figures."
            for name, why in LOST.items()
        ),
    ]
    return "\n".join(rows) + "\n\n" + "\n\n".join(notes)


def section(rounds: int, target: Callable[..., None] | None = None, quick: bool = False) -> str:
    return table(measure(rounds, quick), target)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="few steps per run: checks that everything runs")
    args = p.parse_args()
    print(section(args.rounds, quick=args.quick))


if __name__ == "__main__":
    main()
