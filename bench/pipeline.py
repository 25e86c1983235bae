"""Pipeline parallelism (accel-plugin-parallel, ``parallelism_config_pp_size``): the bubble of each schedule measured
against its theoretical bubble, and memory per rank against DDP.

    python bench/pipeline.py [--write]    # print the tables (and update the pipeline section of docs/benchmarks.md)

Model: ``--layers`` residual blocks of two ``--hidden``-wide linear layers (an ``nn.Sequential``, split evenly over
the stages), MSE loss, AdamW. Each configuration runs this file as a worker under ``accel launch`` (gloo, CPU, one
torch thread per process) and times ``--steps`` training steps after a warm-up.

Bubble: with ``p`` stages the work of a step is ``T1 / p`` per process when nothing waits, where ``T1`` is the step
time of the same model, batch and ``m`` microbatches (one after the other) in 1 process, kernel alone, launched
alternately with the pipeline run. The measured bubble is ``1 - (T1 / p) / T_pp``: the share of a pipeline step not
spent on this process's share of the work (waiting, and the sends and receives between stages); the theoretical
bubble is ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B, and ``(p - 1) / (v m + p - 1)`` for interleaved 1F1B with
``v`` stages per process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import block_class, machine, write_section  # noqa: E402

MB = 1024 * 1024
#: schedule -> stages per process (v)
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved1f1b": 2}
SHARED = "the machine is shared with other jobs, so the timings carry their noise."
TITLE = "## Pipeline parallelism: bubble and memory per rank"


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    from accel import Kernel

    torch.set_num_threads(1)

    Block = block_class()

    class Net(nn.Sequential):
        def loss_function(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(out, labels)

    kernel = Kernel(cpu=True)
    torch.manual_seed(0)
    model = Net(*(Block(args.hidden) for _ in range(args.layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = kernel.prepare(model, optimizer)
    x = torch.randn(args.batch, args.hidden)
    y = torch.randn(args.batch, args.hidden)
    pipelined = hasattr(model, "pipeline")  # the prepared model runs the pipeline step itself

    def step() -> None:
        if pipelined:
            kernel.backward(model(x, labels=y).loss)
        else:  # the same microbatches one after the other, as the pipeline computes them
            for xb, yb in zip(x.chunk(args.split), y.chunk(args.split), strict=True):
                kernel.backward(nn.functional.mse_loss(model(xb), yb) / args.split)
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        kernel.wait_for_everyone()
        start = time.perf_counter()
        step()
        kernel.wait_for_everyone()
        times.append(time.perf_counter() - start)

    def nbytes(tensors: list[torch.Tensor]) -> int:
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
        return sum(t.numel() * t.element_size() for t in local)

    params = list(kernel.unwrap_model(model).parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    row = {
        "rank": kernel.process_index,
        "step_s": statistics.median(times),
        "param_bytes": nbytes(params),
        "optim_bytes": nbytes(state),
    }
    rows = kernel.gather_object([row])
    if kernel.is_main_process:
        Path(args.worker).write_text(json.dumps(rows))
    kernel.end_training()


def run(launch_args: list[str], args: argparse.Namespace, split: int = 1) -> list[dict]:
    accel = str(Path(sys.executable).with_name("accel"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "ACCEL_HOME": tmp, "OMP_NUM_THREADS": "1"}
        cmd = [accel, "launch", "-q", *launch_args, __file__, "--worker", str(out)]
        cmd += [f"--{k}={getattr(args, k)}" for k in ("hidden", "layers", "batch", "steps", "warmup")]
        cmd.append(f"--split={split}")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0 and not out.exists():
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())  # type: ignore[no-any-return]


def pp_args(p: int, schedule: str, m: int) -> list[str]:
    return [
        "-n",
        str(p),
        "--plugin",
        "parallel",
        "--parallelism_config_pp_size",
        str(p),
        "--parallelism_config_pp_schedule",
        schedule,
        "--pp_microbatches",
        str(m),
    ]


def report(args: argparse.Namespace) -> tuple[str, float]:
    """The section's text (without the machine line) and pp / DDP memory per rank."""
    p = args.pp
    rows = [
        "| schedule | stages per process (v) | microbatches (m) | step (ms) | 1 process, same microbatches (ms) | measured bubble "
        "| theoretical (p-1)/(vm+p-1) |",
        "|---|---|---|---|---|---|---|",
    ]
    for schedule, v in SCHEDULES.items():
        for m in args.microbatches:
            one, got = [], []
            for _ in range(args.repeats):  # alternating, so both see the same load
                one.append(run(["-n", "1"], args, split=m)[0]["step_s"])
                got.append(max(r["step_s"] for r in run(pp_args(p, schedule, m), args)))
            t1, t = statistics.median(one), statistics.median(got)
            measured = 1 - (t1 / p) / t
            theory = (p - 1) / (v * m + p - 1)
            rows.append(f"| {schedule} | {v} | {m} | {t * 1e3:.1f} | {t1 * 1e3:.1f} | {measured:.1%} | {theory:.1%} |")
    mem = [
        "| strategy | rank | parameters (MiB) | optimizer state (MiB) | params + optimizer (MiB) |",
        "|---|---|---|---|---|",
    ]
    largest: dict[str, float] = {}
    for label, launch in (
        ("ddp", ["-n", str(p), "--plugin", "ddp"]),
        (f"parallel, pp={p} (1f1b)", pp_args(p, "1f1b", args.microbatches[0])),
    ):
        for r in sorted(run(launch, args), key=lambda r: r["rank"]):
            total = (r["param_bytes"] + r["optim_bytes"]) / MB
            largest[label] = max(largest.get(label, 0.0), total)
            mem.append(
                f"| {label} | {r['rank']} | {r['param_bytes'] / MB:.2f} | {r['optim_bytes'] / MB:.2f} | {total:.2f} |"
            )
    ratio = largest[f"parallel, pp={p} (1f1b)"] / largest["ddp"]
    return (
        f"Model: {args.layers} residual blocks of two {args.hidden}-wide linear layers (an nn.Sequential, split "
        f"evenly), MSE loss, AdamW, batch {args.batch}; {p} CPU processes (gloo, 1 torch thread each); median of "
        f"{args.repeats} launches, each the median of {args.steps} timed steps after {args.warmup} warm-up steps (a "
        "pipeline step: the slowest rank).\n\n"
        "### Bubble\n\nMeasured bubble = 1 - (1-process step / p) / pipeline step: the share of a step a process "
        "does not spend on its part of the work (waiting, and the activations and gradients sent between stages "
        "over gloo, which the theory leaves out).\n\n"
        + "\n".join(rows)
        + "\n\n### Memory per rank: pipeline vs DDP\n\nBytes of the parameters and AdamW state each rank holds "
        "after the timed steps.\n\n"
        + "\n".join(mem)
        + f"\n\npp={p} / DDP, parameters + optimizer state per rank (largest rank): **{ratio:.3f}x** (ideal "
        f"{1 / p:.3f}x).\n",
        ratio,
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--split", type=int, default=1, help=argparse.SUPPRESS)  # worker: microbatches, 1 process
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    return ap.parse_args(argv)


def main() -> None:
    args = parse()
    if args.worker:
        worker(args)
        return
    header = machine()
    text, _ = report(args)
    text = f"`python bench/pipeline.py --write`; {header}, at the end {os.getloadavg()[0]:.1f}; {SHARED}\n\n{text}"
    print(text)
    if args.write:
        write_section("pipeline", f"{TITLE}\n\n{text}")


if __name__ == "__main__":
    main()
