"""Benchmark: a prepared DataLoader against the raw DataLoader it was made from, in one process (issue 30).

    python bench/dataloader.py [--rounds 5] [--workers 0 2 4] [--json]

For each case (map-style or iterable dataset; with or without random augmentation in the dataset; ``num_workers``
0, 2 or 4) one process iterates whole passes of the raw loader, of the prepared loader (``Kernel(cpu=True)``, one
process), and of the prepared loader with ``Kernel(reseed_workers=False)`` (no per-batch worker
seeds; with ``num_workers=0`` it is the same loader), alternating which goes first from round to round, so machine
load falls on all alike. Reported: samples/s medians and the median of the per-round ratios to raw, with their
range. A pass starts its worker processes afresh (``persistent_workers=False``, the default) in every variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SAMPLES, BATCH = 4096, 64


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
    def __init__(self, augment: bool):
        self.augment = augment

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return sample(i, self.augment)


class StreamData(IterableDataset):  # type: ignore[type-arg]
    """A stream that splits itself over worker processes, as the torch docs write one."""

    def __init__(self, augment: bool):
        self.augment = augment

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, SAMPLES, step):
            yield sample(i, self.augment)


def one_pass(loader: Any) -> float:
    start = time.perf_counter()
    n = 0
    for x, _ in loader:
        n += len(x)
    return n / (time.perf_counter() - start)


def case(kind: str, augment: bool, workers: int, rounds: int) -> dict[str, Any]:
    from accel import Kernel

    data = MapData(augment) if kind == "map" else StreamData(augment)
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
    for loader in loaders.values():
        one_pass(loader)  # warm-up
    for r in range(rounds):
        order = list(loaders) if r % 2 == 0 else list(reversed(loaders))
        for name in order:
            rates[name].append(one_pass(loaders[name]))
    out: dict[str, Any] = {"raw samples/s": statistics.median(rates["raw"])}
    for name in loaders:
        if name == "raw":
            continue
        ratios = sorted(a / b for a, b in zip(rates[name], rates["raw"], strict=True))
        out[name] = {"ratio": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}
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
