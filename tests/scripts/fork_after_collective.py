"""Rounds of allreduce and all_gather, each followed at once by a DataLoader pass with 2 worker processes (forked
beside the gloo threads that are still releasing the collectives' tensors): run by
tests/test_forksafe.py with ``accel launch -n 2``. ``--unguarded`` leaves out accel's before-fork hook
(:mod:`accel.forksafe`), to measure how often a worker hangs without it. Prints ``<rank> done <rounds>``."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import accel.forksafe
from accel import Kernel


def main() -> None:
    rounds = int(sys.argv[1])
    if "--unguarded" in sys.argv:
        accel.forksafe.install = lambda: False  # type: ignore[assignment]
    kernel = Kernel(cpu=True)
    dataset = TensorDataset(torch.arange(64.0))
    start = time.monotonic()
    for _ in range(rounds):
        total = torch.ones(4096)
        dist.all_reduce(total)
        parts = [torch.zeros(8) for _ in range(kernel.num_processes)]
        dist.all_gather(parts, torch.ones(8))
        for _batch in DataLoader(dataset, batch_size=16, num_workers=2):
            pass
    # One write of the whole line: `accel launch` runs its processes unbuffered, where print() writes its parts
    # apart, and the two processes' lines on one pipe could run together ("0 done 150 13.2s1").
    sys.stdout.write(f"{kernel.process_index} done {rounds} {time.monotonic() - start:.1f}s\n")
    sys.stdout.flush()
    kernel.end_training()


if __name__ == "__main__":
    main()
