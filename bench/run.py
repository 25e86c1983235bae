"""All of issue 9's benchmarks in one run; results go to docs/benchmarks.md (sections between bench markers).

    python bench/run.py [--repeats 5] [--no-accelerate]

Every comparison alternates its implementations (A B C A B C ...) and reports medians and ratios. CPU here; on a
CUDA machine the same scripts run (drop --cpu in step_loop.py's Kernel/Accelerator to use the GPU).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, accelerate_python, alternate, machine, med, run_json, write_section

PY = sys.executable
ACCEL = str(Path(PY).with_name("accel"))
HERE = Path(__file__).resolve().parent


def step_overhead(acc_py: str | None, repeats: int) -> str:
    rows = ["| workload | raw (steps/s) | accel | Accelerate | accel / raw | accel / Accelerate |", "|---|---|---|---|---|---|"]
    for label, extra in (("tiny MLP", ["--model", "tiny"]), ("medium MLP", ["--model", "medium"]),
                         ("tiny MLP, accumulate(2) + clip_grad_norm_", ["--model", "tiny", "--accum", "2", "--clip", "1.0"])):
        cmds = {impl: [PY, str(HERE / "step_loop.py"), "--impl", impl, *extra] for impl in ("raw", "accel")}
        if acc_py:
            cmds["accelerate"] = [acc_py, str(HERE / "step_loop.py"), "--impl", "accelerate", *extra]
        res = {k: med(v) for k, v in alternate(cmds, "steps_per_s", repeats).items()}
        acc = res.get("accelerate")
        rows.append(f"| {label} | {res['raw']:.0f} | {res['accel']:.0f} | {acc and f'{acc:.0f}' or '-'} | "
                    f"{res['accel'] / res['raw']:.3f} | {acc and f'{res['accel'] / acc:.3f}' or '-'} |")
    return "\n".join(rows)


def ddp_overhead(acc_py: str | None, repeats: int) -> str:
    rows = ["| workload | raw torchrun DDP (steps/s) | accel launch --plugin ddp | Accelerate (torchrun) | accel / raw |", "|---|---|---|---|---|"]
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    for label, extra in (("tiny MLP", ["--model", "tiny", "--steps", "1500"]), ("medium MLP", ["--model", "medium", "--steps", "60"])):
        cmds = {"raw": [PY, *torchrun, str(HERE / "step_loop.py"), "--impl", "raw", *extra],
                "accel": [ACCEL, "launch", "-q", "-n", "2", "--plugin", "ddp", str(HERE / "step_loop.py"), "--impl", "accel", *extra]}
        if acc_py:
            cmds["accelerate"] = [acc_py, *torchrun, str(HERE / "step_loop.py"), "--impl", "accelerate", *extra]
        res = {k: med(v) for k, v in alternate(cmds, "steps_per_s", repeats).items()}
        acc = res.get("accelerate")
        rows.append(f"| {label} | {res['raw']:.0f} | {res['accel']:.0f} | {acc and f'{acc:.0f}' or '-'} | {res['accel'] / res['raw']:.3f} |")
    return "\n".join(rows)


def first_line_seconds(cmd: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    proc.stdout.readline()
    elapsed = time.perf_counter() - start
    proc.wait()
    return elapsed


def launch_latency(repeats: int) -> str:
    probe = str(HERE / "launch_probe.py")
    cmds = {"torchrun -n 2": [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", probe],
            "accel launch -n 2": [ACCEL, "launch", "-q", "-n", "2", probe]}
    times: dict[str, list[float]] = {k: [] for k in cmds}
    for _ in range(repeats):
        for name, cmd in cmds.items():
            times[name].append(first_line_seconds(cmd))
    a, b = med(times["accel launch -n 2"]), med(times["torchrun -n 2"])
    return (f"| command | median seconds to the script's first line |\n|---|---|\n| `torchrun --nproc_per_node 2` | {b:.3f} |\n"
            f"| `accel launch -n 2` | {a:.3f} |\n\naccel launch adds **{a - b:+.3f} s** (target: at most +0.3 s).")


def import_cost(python: str, module: str, repeats: int) -> float:
    """Milliseconds ``import module`` costs on top of ``import torch`` (from -X importtime, cumulative)."""
    values = []
    for _ in range(repeats):
        proc = subprocess.run([python, "-X", "importtime", "-c", f"import torch; import {module}"],
                              capture_output=True, text=True, check=True)
        for line in proc.stderr.splitlines():
            m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\s*)(\S+)$", line)
            if m and m.group(3) == module and m.group(2) == " ":
                values.append(int(m.group(1)) / 1000)
    return med(values)


def import_overhead(acc_py: str | None, repeats: int) -> str:
    ours = import_cost(PY, "accel.kernel", repeats)
    text = f"`import accel.kernel` (the Kernel and everything it needs) after `import torch`: **{ours:.1f} ms** (target ≤ 15 ms)."
    if acc_py:
        theirs = import_cost(acc_py, "accelerate", repeats)
        text += f" `import accelerate` after `import torch`: {theirs:.1f} ms."
    return text


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-accelerate", action="store_true")
    args = p.parse_args()
    acc_py = None if args.no_accelerate else accelerate_python()
    with tempfile.TemporaryDirectory() as home:
        os.environ.update(ACCEL_HOME=home, HF_HOME=home)
        sections = {
            "step-overhead": ("### Step overhead, one process", step_overhead(acc_py, args.repeats)),
            "ddp-overhead": ("### DDP, 2 processes on gloo", ddp_overhead(acc_py, max(3, args.repeats // 2))),
            "launch-latency": ("### Launch latency", launch_latency(args.repeats)),
            "import-overhead": ("### Import overhead", import_overhead(acc_py, args.repeats)),
        }
        hooks = run_json([PY, str(HERE / "hook_cost.py")])
    calls = ", ".join(f"`{k}` {v:g}" for k, v in hooks["calls_per_step"].items())
    sections["hook-cost"] = ("### Hook dispatch per step",
                             f"Hook calls per training step (accumulate + backward + step + zero_grad): {calls}. "
                             f"A pluggy call costs {hooks['zero_grad_via_hook_us']:.2f} µs against "
                             f"{hooks['zero_grad_direct_us']:.2f} µs for the same call made directly.")
    for name, (title, body) in sections.items():
        write_section(name, f"{title}\n\n{machine()}\n\n{body}\n")
        print(title, body, sep="\n", end="\n\n")


if __name__ == "__main__":
    main()
