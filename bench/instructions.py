"""Instructions per training step, raw loop vs accel, counted by valgrind (callgrind): a measure of the framework's
own per-step work that the machine's timing noise does not touch.

    python bench/instructions.py            # runs itself under valgrind; prints JSON

The worker (``--worker``) builds the loops of step_loop.py and runs each for N steps between two calls of
``os.getppid()``; callgrind (``--dump-before=os_getppid*``) writes one profile per phase, so each phase's count is
its own. Only the training thread is counted. Instructions are not time (a cache miss costs more than an add), but
the difference between two loops doing the same tensor work is the Python the framework adds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _common import callgrind, callgrind_total, ddp_setting, worker_or_measure

STEPS = 256  # per phase, after 64 warm-up steps; four passes over the tiny model's 64-batch loader


def phases() -> dict[str, Callable[[int], Any]]:
    import step_loop
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    class Stream(IterableDataset):  # type: ignore[type-arg]
        """An iterable dataset over the samples of a map-style one."""

        def __init__(self, data: Any):
            self.data = data

        def __iter__(self) -> Iterator[Any]:
            return iter(self.data)

    torch.set_num_threads(1)
    out: dict[str, Callable[[int], Any]] = {}
    for label, accum, clip in (("tiny MLP", 1, 0.0), ("tiny MLP, accumulate(2) + clip_grad_norm_", 2, 1.0)):
        args = argparse.Namespace(model="tiny", accum=accum, clip=clip, device="cpu", impl="accel")
        step, loader, given = step_loop.framework_loop(args)
        out[f"{label}|raw"] = step_loop.runner(*step_loop.raw_loop(args, 1, given), False)
        out[f"{label}|accel"] = step_loop.runner(step, loader, False)
        if accum > 1:  # where the difference goes: the dataloaders alone, and the accumulate() context alone
            from accel import Kernel

            kernel = Kernel(cpu=True, gradient_accumulation_steps=2)
            model, plain = step_loop.build("tiny")
            prepared = kernel.prepare(step_loop.build("tiny")[1])
            unplaced = kernel.prepare(step_loop.build("tiny")[1], device_placement=False)

            def nothing(i: int, x: Any, y: Any) -> None:
                pass

            def context(i: int, x: Any, y: Any, kernel: Any = kernel, model: Any = model) -> None:  # bound now:
                with kernel.accumulate(model):  # the runner calls this after the loop
                    pass

            out["parts|iterate the user's DataLoader"] = step_loop.runner(nothing, plain, False)
            out["parts|iterate a prepared DataLoader"] = step_loop.runner(nothing, prepared, False)
            out["parts|iterate a prepared DataLoader, device_placement=False"] = step_loop.runner(
                nothing, unplaced, False
            )
            out["parts|the user's DataLoader inside accumulate()"] = step_loop.runner(context, plain, False)
            stream = DataLoader(Stream(plain.dataset), batch_size=plain.batch_size)
            out["parts|iterate the user's iterable DataLoader"] = step_loop.runner(nothing, stream, False)
            out["parts|iterate a prepared iterable DataLoader"] = step_loop.runner(
                nothing, Kernel(cpu=True).prepare(DataLoader(Stream(plain.dataset), batch_size=plain.batch_size)), False
            )
    # bench/feature_cost.py's loops (tiny MLP, accumulate(4) + clip, passes of 64 batches): the hand-written loop, accel,
    # the featureless wrapper with accel's API, and accel with its parts swapped for the featureless ones
    import feature_cost

    for name, (step, loader) in feature_cost.loops().items():
        out[f"feature cost|{name}"] = step_loop.runner(step, loader, False)
    # DDP: the ddp plugin in a world of one process (gloo), so with accumulation its no_sync path runs on every other
    # micro-step; the raw loop is a DistributedDataParallel on the same process group (no_sync() itself), in fp32
    # and under bf16 autocast (accel: mixed_precision="bf16"), the settings of the ddp-sizes wall-time rows
    for precision in ("no", "bf16"):
        for accum in (1, 2):
            args = argparse.Namespace(
                model="tiny",
                accum=accum,
                clip=0.0,
                device="cpu",
                impl="accel",
                plugins=["ddp"],
                mixed_precision=precision,
            )
            label = ddp_setting(precision, accum)
            step, loader, _ = step_loop.framework_loop(args)
            out[f"{label}|raw"] = step_loop.runner(*step_loop.raw_loop(args, 2), False)
            out[f"{label}|accel"] = step_loop.runner(step, loader, False)
    return out


def worker() -> None:
    runs = phases()
    for run in runs.values():
        run(64)
    for run in runs.values():
        os.getppid()  # callgrind dumps the counts so far: each phase lies between two of these
        run(STEPS)
    os.getppid()
    print(json.dumps(list(runs)))


def measure() -> dict[str, Any]:
    if shutil.which("valgrind") is None:
        return {"skipped": "valgrind is not installed"}
    with tempfile.TemporaryDirectory() as tmp:
        stdout = callgrind(__file__, f"{tmp}/cg", "--separate-threads=yes")
        names = json.loads([line for line in stdout.splitlines() if line.startswith("[")][-1])
        counts: dict[int, int] = {}
        for path in Path(tmp).glob("cg.*-01"):  # <file>.<dump>-<thread>; thread 01 is the training thread
            total = callgrind_total(path)
            if total is not None:
                counts[int(path.name.split(".")[1].split("-")[0])] = total
        # dump 1 ends at the first getppid (start-up and warm-up); dump k+1 is phase k
        per_step = {name: counts[i + 2] / STEPS for i, name in enumerate(names)}
    return {"steps": STEPS, "instructions_per_step": per_step}


def main() -> None:
    worker_or_measure(worker, measure)


if __name__ == "__main__":
    main()
