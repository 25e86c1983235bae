"""What accel's features cost a tiny training step: accel's loop against the same loop over a featureless wrapper
with accel's API, with accel's parts swapped in one at a time, in one process.

    python bench/feature_cost.py [--rounds 60] [--steps 500]    # prints the table; bench/run.py writes it to the docs

The loop is bench/launched_train.py's (tiny MLP, AdamW, cross-entropy, ``accumulate(4)`` and
``clip_grad_norm_(1.0)``, one intra-op thread, passes of 64 batches of 16 random samples), written as accel's docs
write it, over six
implementations: the hand-written loop; accel; the featureless wrapper below (the same calls, each doing only what
the step needs); and accel with its prepared dataloader, its prepared optimizer, or both, replaced by the
featureless ones. The loops run in alternating segments of ``--steps`` micro-steps, each round in another order;
each figure is the median over rounds of the step rate per round relative to the hand-written loop. The
differences between rows are what each part's features cost (``Kernel`` alone: the featureless loader and
optimizer with accel's ``accumulate``, ``backward``, ``sync_gradients`` and ``clip_grad_norm_``). A second table
runs accel's ``Kernel`` with and without the prepared dataloader over passes of 8, 64 and 640 batches, which tells
its cost once a pass from its cost per batch.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from _common import run_json, segment_arguments

Step = Callable[[int, Any, Any], None]


class FeaturelessState:
    """Whether this step syncs, the accumulation count, and whether the loader handed out its epoch's last batch."""

    def __init__(self) -> None:
        self.sync_gradients = True
        self.step = 0
        self.end_of_dataloader = False


class FeaturelessAccumulate:
    """``accumulate()``'s context: counts micro-steps, syncs every ``steps``-th and on the epoch's last batch."""

    __slots__ = ("state", "steps")

    def __init__(self, state: Any, steps: int):
        self.state, self.steps = state, steps

    def __enter__(self) -> None:
        state = self.state
        if state.end_of_dataloader:
            state.step = 0
            state.sync_gradients = True
            return
        step = state.step = state.step + 1
        state.sync_gradients = step % self.steps == 0

    def __exit__(self, *exc: object) -> None:
        pass


class Featureless:
    """accel's per-step API with nothing else: no plugins, no checks, no missing-member lines."""

    def __init__(self, steps: int):
        import torch

        self.steps = steps
        self.gradient_state = FeaturelessState()
        self._context = FeaturelessAccumulate(self.gradient_state, steps)
        self._clip = torch.nn.utils.clip_grad_norm_

    def accumulate(self, model: Any) -> FeaturelessAccumulate:
        return self._context

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    def backward(self, loss: Any) -> None:
        (loss / self.steps if self.steps > 1 else loss).backward()

    def clip_grad_norm_(self, parameters: Any, max_norm: float) -> Any:
        if not self.gradient_state.sync_gradients:
            return None
        return self._clip(parameters, max_norm)


class FeaturelessOptimizer:
    """``step`` and ``zero_grad`` on sync steps only; nothing read through, no plugin's step."""

    def __init__(self, state: Any, optimizer: Any):
        self.state, self.optimizer = state, optimizer

    def step(self) -> None:
        if self.state.sync_gradients:
            self.optimizer.step()

    def zero_grad(self) -> None:
        if self.state.sync_gradients:
            self.optimizer.zero_grad()


class FeaturelessLoader:
    """The user's loader, counted so that its last batch is flagged as the epoch's end; no position, resume, device
    placement or sampler checks."""

    def __init__(self, state: Any, loader: Any):
        self.state, self.loader = state, loader

    def __iter__(self) -> Iterator[Any]:
        state, total = self.state, len(self.loader)
        state.end_of_dataloader = False
        batches = iter(self.loader)
        for _, batch in zip(range(1, total), batches, strict=False):
            yield batch
        last = next(batches)
        state.end_of_dataloader = True
        yield last
        state.end_of_dataloader = False


#: the loops, each with what in it is accel's
LOOPS = (
    ("hand-written", "nothing"),
    ("accel", "everything"),
    ("accel, featureless loader", "`Kernel` and the prepared optimizer"),
    ("accel, featureless optimizer", "`Kernel` and the prepared dataloader"),
    ("accel `Kernel` alone", "`accumulate`, `backward`, `sync_gradients`, `clip_grad_norm_`"),
    ("featureless wrapper", "nothing (the same calls, none of accel's features)"),
)


#: batches a pass in the pass-length rows (the main table's passes are 64 batches)
PASS_LENGTHS = (8, 64, 640)


def loops(batches_a_pass: int = 64, names: Iterable[str] | None = None) -> dict[str, tuple[Step, Any]]:
    """The loops of ``LOOPS`` (or those ``names``), over passes of ``batches_a_pass`` batches of the same data."""
    names = None if names is None else set(names)
    import launched_train
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from accel import Kernel

    torch.set_num_threads(1)
    loss_of = nn.functional.cross_entropy

    def build() -> tuple[Any, Any, Any]:
        model, optimizer, loader = launched_train.build("tiny")
        n = loader.batch_size * batches_a_pass
        samples = TensorDataset(torch.randn(n, model[0].in_features), torch.randint(0, model[-1].out_features, (n,)))
        return model, optimizer, DataLoader(samples, batch_size=loader.batch_size)

    def framework(accel: bool, own_loader: bool, own_optimizer: bool) -> tuple[Step, Any]:
        model, optimizer, loader = build()
        kernel: Any = Kernel(cpu=True, gradient_accumulation_steps=4) if accel else Featureless(4)
        prepared_optimizer, prepared_loader = optimizer, loader
        if accel:
            model, prepared_optimizer, prepared_loader = kernel.prepare(model, optimizer, loader)
        state = kernel.gradient_state
        opt = prepared_optimizer if own_optimizer else FeaturelessOptimizer(state, optimizer)
        batches = prepared_loader if own_loader else FeaturelessLoader(state, loader)

        def step(i: int, x: Any, y: Any) -> None:
            with kernel.accumulate(model):
                loss = loss_of(model(x), y)
                kernel.backward(loss)
                if kernel.sync_gradients:
                    kernel.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()

        return step, batches

    def hand_written() -> tuple[Step, Any]:
        model, opt, loader = build()

        def step(i: int, x: Any, y: Any) -> None:
            sync = (i + 1) % 4 == 0
            (loss_of(model(x), y) / 4).backward()
            if sync:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()

        return step, loader

    makers: dict[str, Callable[[], tuple[Step, Any]]] = {
        LOOPS[0][0]: hand_written,
        LOOPS[1][0]: lambda: framework(True, True, True),
        LOOPS[2][0]: lambda: framework(True, False, True),
        LOOPS[3][0]: lambda: framework(True, True, False),
        LOOPS[4][0]: lambda: framework(True, False, False),
        LOOPS[5][0]: lambda: framework(False, False, False),
    }
    return {name: make() for name, make in makers.items() if names is None or name in names}


def measure(built: dict[str, tuple[Step, Any]], rounds: int, steps: int) -> dict[str, list[float]]:
    """Per loop, per round: the mean nanoseconds per micro-step of its segment."""
    clock = time.perf_counter_ns

    def endless(loader: Any) -> Iterator[Any]:
        while True:
            yield from loader

    feeds = {name: (step, endless(loader)) for name, (step, loader) in built.items()}
    done = dict.fromkeys(feeds, 0)

    def segment(name: str) -> float:
        step, feed = feeds[name]
        start = clock()
        for i in range(done[name], done[name] + steps):
            x, y = next(feed)
            step(i, x, y)
        done[name] += steps
        return (clock() - start) / steps

    names = list(feeds)
    for name in names:  # warm up
        segment(name)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            out[name].append(segment(name))
    return out


def table(result: dict[str, list[float]]) -> str:
    raw = result[LOOPS[0][0]]
    rows = [
        "| loop | what in it is accel's | us per micro-step | step rate / hand-written (middle half) |",
        "|---|---|---|---|",
    ]
    for name, what in LOOPS:
        ratios = sorted(r / t for r, t in zip(raw, result[name], strict=True))
        rows.append(
            f"| {name} | {what} | {statistics.median(result[name]) / 1000:.1f} | {statistics.median(ratios):.3f} "
            f"({ratios[len(ratios) // 4]:.3f}-{ratios[3 * len(ratios) // 4]:.3f}) |"
        )
    rows.append("")
    rows.append(
        f"{len(raw)} rounds of each loop, one process (bench/feature_cost.py). The featureless wrapper makes the "
        "same calls as accel's loop and does only what the step needs: it has no plugins, no checks and no "
        "missing-member lines, and its loader keeps no position for exact resume. The rows between accel and the "
        "wrapper put accel's parts into the wrapper one at a time, so the differences between rows are what each "
        "part's features cost."
    )
    return "\n".join(rows)


#: the pass-length rows' two loops: accel's Kernel with the prepared dataloader, and with the featureless one
PASS_LOOPS = (LOOPS[3][0], LOOPS[4][0])


def measure_passes(rounds: int, steps: int) -> dict[str, list[float]]:
    """The pass-length rows' loops for every length in ``PASS_LENGTHS``, interleaved as one set ("64|name")."""
    built = {f"{n}|{name}": loop for n in PASS_LENGTHS for name, loop in loops(n, PASS_LOOPS).items()}
    return measure(built, rounds, steps)


def pass_table(result: dict[str, list[float]]) -> str:
    rows = [
        "| batches a pass | prepared dataloader minus featureless loader, us per micro-step (middle half) | us per pass |",
        "|---|---|---|",
    ]
    for n in PASS_LENGTHS:
        prepared, featureless = (result[f"{n}|{name}"] for name in PASS_LOOPS)
        extra = sorted((p - f) / 1000 for p, f in zip(prepared, featureless, strict=True))
        middle = statistics.median(extra)
        rows.append(
            f"| {n} | {middle:+.2f} ({extra[len(extra) // 4]:+.2f} to {extra[3 * len(extra) // 4]:+.2f}) "
            f"| {middle * n:+.1f} |"
        )
    rows.append("")
    rows.append(
        "The same two loops (accel's `Kernel`, the featureless optimizer) over passes of 8, 64 and 640 batches of "
        "the same data, all six interleaved: what the prepared dataloader adds over the featureless one. A cost "
        "per batch would stay the same in the middle column whatever the pass length; a cost per pass (its start "
        "keeps the sampler's and torch's random states for exact resume and checks where batches go, its end "
        "flags the epoch's last batch and checks the sampler's length) stays the same in the last column."
    )
    return "\n".join(rows)


def section(rounds: int) -> str:
    """Runs this file in a fresh interpreter (bench/run.py's process has imported other frameworks' code)."""
    got = run_json([sys.executable, __file__, "--rounds", str(rounds), "--json"], timeout=3600)
    return table(got["loops"]) + "\n\n" + pass_table(got["passes"])


def main() -> None:
    args = segment_arguments()
    result = {
        "loops": measure(loops(), args.rounds, args.steps),
        "passes": measure_passes(args.rounds, args.steps),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(table(result["loops"]), pass_table(result["passes"]), sep="\n\n")


if __name__ == "__main__":
    main()
