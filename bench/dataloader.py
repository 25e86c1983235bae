"""Benchmark: a prepared DataLoader against the raw DataLoader it was made from, in one process.

    python bench/dataloader.py [--rounds 5] [--workers 0 2 4] [--json]

For each case (map-style or iterable dataset; with or without random augmentation in the dataset; ``num_workers``
0, 2 or 4) one process runs rounds of one whole pass of the raw loader, of the prepared loader (``Kernel(cpu=True)``,
one process), and of the prepared loader with ``Kernel(reseed_workers=False)`` (no per-batch worker seeds; with
``num_workers=0`` or an iterable dataset it is the same loader). Without workers the passes are interleaved batch by
batch (see :func:`interleaved_pass`); with workers each loader makes its pass alone (its workers started afresh,
``persistent_workers=False``) over 4x the samples, the loaders taking turns in every order from round to round, and
the CPU seconds of the process and its workers are counted too. Reported: samples/s medians, the median of the
per-round ratios to raw with their range and middle half, and the median ratio of CPU time per sample.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SAMPLES, BATCH = 4096, 64
#: samples of a pass with worker processes: 4x, so that starting and joining the workers, and the machine's drift, weigh
#: less in a pass's time (a pass of 4096 samples took 0.2-0.4 s with 2-4 workers)
WORKER_SAMPLES = 4 * SAMPLES


def sample(i: int, augment: bool) -> tuple[torch.Tensor, int]:
    """An image-like sample (3x32x32); augmented: random crop of a padded image, random flip, noise."""
    g = torch.Generator().manual_seed(i)
    x = torch.rand(3, 32, 32, generator=g)
    if augment:
        x = torch.nn.functional.pad(x, (4, 4, 4, 4))
        dx, dy = (int(v) for v in torch.randint(0, 9, (2,)))
        x = x[:, dy : dy + 32, dx : dx + 32]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        x = x + 0.01 * torch.randn_like(x)
    return x, i % 10


class MapData(Dataset):  # type: ignore[type-arg]
    def __init__(self, augment: bool, samples: int = SAMPLES):
        self.augment, self.samples = augment, samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return sample(i, self.augment)


class StreamData(IterableDataset):  # type: ignore[type-arg]
    """A stream that splits itself over worker processes, as the torch docs write one."""

    def __init__(self, augment: bool, samples: int = SAMPLES):
        self.augment, self.samples = augment, samples

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.samples, step):
            yield sample(i, self.augment)


def one_pass(loader: Any) -> tuple[float, float]:
    """One whole pass: samples/s, and CPU seconds per sample of this process and its (joined) worker processes."""
    start, before = time.perf_counter(), _cpu_seconds()
    n = 0
    for x, _ in loader:
        n += len(x)
    return n / (time.perf_counter() - start), (_cpu_seconds() - before) / n


def _cpu_seconds() -> float:
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def interleaved_pass(loaders: dict[str, Any]) -> dict[str, float]:
    """One whole pass of every loader, their batches taken in turn (the order flips every batch), each loader's
    samples/s from the time spent in its own ``iter()`` and ``next()`` calls. Over windows of 50 ms or more this
    machine's speed drifts by +-30 % (a loader timed against itself in alternate passes); batch by batch, both
    loaders see the same drift. For loaders without workers: with workers, the loaders' worker processes would
    compete for the cores (see :func:`case`)."""
    seconds = dict.fromkeys(loaders, 0.0)
    samples = dict.fromkeys(loaders, 0)
    iterators = {}
    for name, loader in loaders.items():
        start = time.perf_counter()
        iterators[name] = iter(loader)
        seconds[name] += time.perf_counter() - start
    active, turn = list(loaders), 0
    while active:
        for name in active if turn % 2 == 0 else active[::-1]:
            start = time.perf_counter()
            batch = next(iterators[name], None)
            seconds[name] += time.perf_counter() - start
            if batch is None:
                active.remove(name)
            else:
                samples[name] += len(batch[0])
        turn += 1
    return {name: samples[name] / seconds[name] for name in loaders}


def case(kind: str, augment: bool, workers: int, rounds: int) -> dict[str, Any]:
    from accel import Kernel

    samples = WORKER_SAMPLES if workers else SAMPLES
    data = MapData(augment, samples) if kind == "map" else StreamData(augment, samples)
    shuffle = {"shuffle": True} if kind == "map" else {}
    raw = DataLoader(data, batch_size=BATCH, num_workers=workers, **shuffle)
    loaders = {
        "raw": raw,
        "prepared": Kernel(cpu=True).prepare(DataLoader(data, batch_size=BATCH, num_workers=workers, **shuffle)),
    }
    if workers and kind == "map":  # per-batch worker seeds exist only for map-style loaders with workers
        off = Kernel(cpu=True, reseed_workers=False)
        loaders["no reseed"] = off.prepare(DataLoader(data, batch_size=BATCH, num_workers=workers, **shuffle))
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    cpu: dict[str, list[float]] = {name: [] for name in loaders}
    for loader in loaders.values():
        one_pass(loader)  # warm-up
    # every order of the loaders in turn (with three, each takes each place alike)
    orders = list(itertools.permutations(loaders))
    for r in range(rounds):
        names = list(orders[r % len(orders)])
        if workers:  # each loader alone with its workers, one pass after the other
            for name in names:
                rate, cpu_s = one_pass(loaders[name])
                rates[name].append(rate)
                cpu[name].append(cpu_s)
        else:
            for name, rate in interleaved_pass({name: loaders[name] for name in names}).items():
                rates[name].append(rate)
    out: dict[str, Any] = {"raw samples/s": statistics.median(rates["raw"])}
    for name in loaders:
        if name == "raw":
            continue
        ratios = sorted(a / b for a, b in zip(rates[name], rates["raw"], strict=True))
        quartiles = statistics.quantiles(ratios, n=4)
        cpu_ratios = [b / a for a, b in zip(cpu[name], cpu["raw"], strict=True)]
        out[name] = {
            "cpu ratio": statistics.median(cpu_ratios) if cpu_ratios else None,
            "ratio": statistics.median(ratios),
            "min": ratios[0],
            "max": ratios[-1],
            "q1": quartiles[0],
            "q3": quartiles[2],
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workers", type=int, nargs="*", default=[0, 2, 4])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    results = {}
    for kind in ("map", "iterable"):
        for augment in (False, True):
            for workers in args.workers:
                name = f"{kind}|{'augmented' if augment else 'plain'}|{workers}"
                results[name] = case(kind, augment, workers, args.rounds)
                if not args.json:
                    print(name, results[name], flush=True)
    if args.json:
        print(json.dumps({"rounds": args.rounds, "cases": results}))


if __name__ == "__main__":
    main()
