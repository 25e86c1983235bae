"""Where accel's per-micro-step time goes: each part of a training step timed apart, accel's loop against the
hand-written one, in one process, and in each of two DDP processes.

    python bench/step_parts.py [--rounds 60] [--steps 500]    # prints the table; bench/run.py writes it to the docs
    accel launch -n 2 bench/step_parts.py                      # the same in two processes (rank 0 prints)

The loops are bench/launched_train.py's (tiny MLP, AdamW, cross-entropy, ``accumulate(4)`` and
``clip_grad_norm_(1.0)``, one intra-op thread), run in one process in alternating segments of ``--steps``
micro-steps. A clock read (``time.perf_counter_ns``) at each boundary splits a micro-step into the parts below; each
part's figure is the median over segments of its mean per micro-step, and the difference is accel's minus raw's.
The clock reads cost the same in both loops, so the differences are accel's own. This is the breakdown behind the
launched 1-process accumulate + clip row; the instruction count of the same loops is in the ``instructions``
section. Under a launcher (``WORLD_SIZE`` above 1) accel's loop gets the launcher's strategy (DDP) and the hand-written
one wraps its model in ``DistributedDataParallel``, reads through a ``DistributedSampler`` and enters ``no_sync()`` on
the steps that do not synchronise; both loops run on the one process group, in the same segments on every process:
the breakdown behind the launched 2-process accumulate + clip row.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _common import free_port, run_json, segment_arguments

#: the parts of a micro-step, in order, with what each one runs in accel's loop
PARTS = (
    ("next batch", "the prepared dataloader's next batch"),
    ("enter accumulate", "`kernel.accumulate(model)` and entering it"),
    ("forward", "the model and the loss"),
    ("backward", "`kernel.backward(loss)`"),
    ("sync check + clip", "`kernel.sync_gradients` and, on a sync step, `kernel.clip_grad_norm_`"),
    ("optimizer", "`optimizer.step()` and `optimizer.zero_grad()` (they act on sync steps)"),
    ("leave accumulate", "leaving `accumulate`"),
)
Step = Callable[[int, Any, Any, list[int]], None]


def add(totals: list[int], marks: tuple[int, ...]) -> None:
    """Adds the spans between consecutive clock readings to the parts' totals (``totals[0]`` is the batch's)."""
    for k, (begin, end) in enumerate(itertools.pairwise(marks), 1):
        totals[k] += end - begin


def loops(world: int = 1) -> dict[str, tuple[Step, Any]]:
    """accel's loop and the hand-written one; ``world`` above 1: on the launcher's process group (raw with DDP)."""
    import launched_train
    import torch
    from torch import nn

    from accel import Kernel

    torch.set_num_threads(1)
    clock = time.perf_counter_ns
    loss_of = nn.functional.cross_entropy

    def accel_loop() -> tuple[Step, Any]:
        kernel = Kernel(cpu=True, gradient_accumulation_steps=4)
        model, opt, loader = kernel.prepare(*launched_train.build("tiny"))

        def step(i: int, x: Any, y: Any, t: list[int]) -> None:
            a = clock()
            with kernel.accumulate(model):
                b = clock()
                loss = loss_of(model(x), y)
                c = clock()
                kernel.backward(loss)
                d = clock()
                if kernel.sync_gradients:
                    kernel.clip_grad_norm_(model.parameters(), 1.0)
                e = clock()
                opt.step()
                opt.zero_grad()
                f = clock()
            add(t, (a, b, c, d, e, f, clock()))

        return step, loader

    def raw_loop() -> tuple[Step, Any]:
        model, opt, loader = launched_train.build("tiny")
        ddp = world > 1
        if ddp:  # what a hand-written DDP loop does: the model wrapped, a DistributedSampler, no_sync() to accumulate
            model = nn.parallel.DistributedDataParallel(model)
            sampler = torch.utils.data.DistributedSampler(loader.dataset, shuffle=False)
            loader = torch.utils.data.DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler)

        def step(i: int, x: Any, y: Any, t: list[int]) -> None:
            a = clock()
            sync = (i + 1) % 4 == 0
            skip = model.no_sync() if ddp and not sync else None
            if skip is not None:
                skip.__enter__()
            b = clock()
            loss = loss_of(model(x), y)
            c = clock()
            (loss / 4).backward()
            d = clock()
            if sync:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            e = clock()
            if sync:
                opt.step()
                opt.zero_grad()
            f = clock()
            if skip is not None:
                skip.__exit__(None, None, None)
            add(t, (a, b, c, d, e, f, clock()))

        return step, loader

    accel = accel_loop()  # first: under a launcher its Kernel sets up the process group that raw's DDP then uses
    return {"raw": raw_loop(), "accel": accel}


def measure(rounds: int, steps: int, world: int = 1) -> dict[str, list[list[float]]]:
    """Per loop, per segment: the mean nanoseconds per micro-step of each part, then of the whole micro-step."""
    clock = time.perf_counter_ns
    built = loops(world)

    def batches(loader: Any) -> Iterator[Any]:
        while True:
            yield from loader

    feeds = {name: (step, batches(loader)) for name, (step, loader) in built.items()}
    done = dict.fromkeys(feeds, 0)

    def segment(name: str) -> list[float]:
        step, feed = feeds[name]
        t = [0] * (len(PARTS) + 1)
        start = clock()
        for i in range(done[name], done[name] + steps):
            a = clock()
            x, y = next(feed)
            t[0] += clock() - a
            step(i, x, y, t)
        whole = clock() - start
        done[name] += steps
        return [v / steps for v in t[: len(PARTS)]] + [whole / steps]

    for name in feeds:  # warm up
        segment(name)
    out: dict[str, list[list[float]]] = {name: [] for name in feeds}
    for r in range(rounds):
        for name in feeds if r % 2 else reversed(feeds):
            out[name].append(segment(name))
    return out


def table(result: dict[str, list[list[float]]], world: int = 1) -> str:
    raw, accel = result["raw"], result["accel"]
    rows = [
        f"| part | what accel runs there | raw{' DDP' if world > 1 else ''}, us | accel, us | accel - raw, us |",
        "|---|---|---|---|---|",
    ]
    for k, (part, what) in enumerate((*PARTS, ("whole micro-step", "with the clock reads"))):
        r = statistics.median(seg[k] for seg in raw) / 1000
        a = statistics.median(seg[k] for seg in accel) / 1000
        rows.append(f"| {part} | {what} | {r:.2f} | {a:.2f} | {a - r:+.2f} |")
    ratios = sorted(r[-1] / a[-1] for r, a in zip(raw, accel, strict=True))
    if world == 1:
        where = (
            "One process. The raw loop's own parts (a modulo for the sync step, no context entered) stand where "
            "accel's run, so the enter and leave rows are accel's context and little else."
        )
    else:
        where = (
            f"{world} processes (`accel launch -n {world}`, DDP on gloo, both loops on the one process group), rank "
            "0's figures. The raw loop enters DDP's `no_sync()` in its enter row and leaves it in its leave row. The "
            "backward row holds the gradient all-reduce of the sync steps, and with it the wait for the other "
            "process, which the machine's load moves by more than accel's part, and so does the whole micro-step: "
            "the other rows are accel's own."
        )
    rows.append("")
    rows.append(
        f"{where} {len(raw)} segments of each loop. Step rate, accel / raw, per pair of segments: median "
        f"{statistics.median(ratios):.3f} (middle half {ratios[len(ratios) // 4]:.3f}-"
        f"{ratios[3 * len(ratios) // 4]:.3f})."
    )
    return "\n".join(rows)


def section(rounds: int) -> str:
    """Runs this file in fresh interpreters (bench/run.py's process has imported other frameworks' code): one
    process, then two under ``accel launch``."""
    one = table(run_json([sys.executable, __file__, "--rounds", str(rounds), "--json"], timeout=1800))
    accel = str(Path(sys.executable).with_name("accel"))
    launch = [accel, "launch", "-q", "-n", "2", "--main_process_port", str(free_port())]
    two = table(run_json([*launch, __file__, "--rounds", str(rounds), "--json"], timeout=1800), world=2)
    return f"{one}\n\n{two}"


def main() -> None:
    args = segment_arguments()
    world = int(os.environ.get("WORLD_SIZE", 1))
    result = measure(args.rounds, args.steps, world)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(result) if args.json else table(result, world))


if __name__ == "__main__":
    main()
