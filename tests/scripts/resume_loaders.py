"""Training script of tests/test_resume_real_loaders.py: a run with realistic dataloaders that saves in the middle of
an epoch, and its resumption in a new process (one process or `accel launch -n 2`).

Every sample is augmented in ``__getitem__`` (or ``__iter__``) with draws from python's, numpy's and torch's global
generators: in this process with ``--workers 0``, through torch's worker seeding otherwise. The model has dropout,
so the training loop draws from torch's generator between batches too.

    --steps N --save-at K --ckpt D --out F     train N steps, save_state(D) after step K (and go on)
    --resume --ckpt D --out F                  load_state(D), train up to step N
Each process writes F.rank<r>.json: the sample ids and augmented sums of every batch it trained on, from the
first step of this run, and a digest of the final parameters.

    --variants V.json ...                      one run per variant of V.json ({name: [args]}), one after the other
                                               in this process, each with D-<name> and F-<name> and its own seeds
Several variants in one process, or in each process of one launch (tests/test_resume_real_loaders.py: two
start-ups in all instead of two per variant). Each starts from the same seeds, as a new process would, with a Kernel
(and process group) of its own, under a fresh ``warnings.catch_warnings()`` (its warnings are printed again, not once
per process), after a line ``=== variant <name>`` on stderr; an exception is printed there and the next variant runs
(exit status 1 at the end).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    WeightedRandomSampler,
    get_worker_info,
)

import accel
from accel import Kernel

SIZE = 50


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    gen = torch.Generator().manual_seed(i)
    x, y = torch.randn(6, generator=gen), torch.randn(1, generator=gen)
    noise = 0.1 * torch.rand(6) + 0.01 * random.random() + 0.01 * float(np.random.rand())
    return x + noise, y, i


class Augmented(Dataset):
    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return sample(int(i))


class AugmentedStream(IterableDataset):
    """Shuffled by epoch (``set_epoch``), split between the loader's workers."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        # 48 samples: no last batch completed with the epoch's first samples (in this process, their augmentation
        # would be that of the re-read batches; the warning at save_state says so)
        order = torch.randperm(SIZE - 2, generator=torch.Generator().manual_seed(100 + self.epoch)).tolist()
        info = get_worker_info()
        if info is not None:
            order = order[info.id :: info.num_workers]
        for i in order:
            yield sample(i)


class Progress:
    def __init__(self) -> None:
        self.step = 0
        self.epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.epoch = int(state["step"]), int(state["epoch"])


def make_loader(args: argparse.Namespace, kernel: Kernel) -> DataLoader:
    extra: dict[str, Any] = {"num_workers": args.workers, "batch_size": 4}
    if args.workers:
        extra["persistent_workers"] = args.persistent
    if args.kind == "iterable":
        return DataLoader(AugmentedStream(), **extra)
    dataset = Augmented()
    if args.sampler == "shuffle":
        return DataLoader(dataset, shuffle=True, **extra)
    if args.sampler == "weighted":
        weights = torch.linspace(0.2, 1.0, SIZE)
        return DataLoader(dataset, sampler=WeightedRandomSampler(weights, SIZE), **extra)
    if args.sampler == "distributed":
        sampler = DistributedSampler(dataset, num_replicas=kernel.num_processes, rank=kernel.process_index, seed=7)
        return DataLoader(dataset, sampler=sampler, **extra)
    return DataLoader(dataset, **extra)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--kind", choices=("map", "iterable"), default="map")
    parser.add_argument("--sampler", choices=("shuffle", "weighted", "distributed", "sequential"), default="shuffle")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument(
        "--skip-call",
        action="store_true",
        help="after load_state, call skip_first_batches with the position, as Accelerate documents",
    )
    parser.add_argument(
        "--disturb", action="store_true", help="draw from torch's generator after load_state (negative control)"
    )
    parser.add_argument("--variants", help="JSON file {name: [args]}: run each variant in turn in this process")
    return parser


def main() -> None:
    args = parser().parse_args()
    if not args.variants:
        train(args)
        return
    failed = []
    with open(args.variants) as f:
        variants: dict[str, list[str]] = json.load(f)
    at = sys.argv.index("--variants")
    common = sys.argv[1:at] + sys.argv[at + 2 :]
    for name, extra in variants.items():
        # one write of the whole line: print() writes the text and the newline apart, and the two processes of a
        # launch share the pipe, so their lines interleaved ("=== variant a=== variant a\n\n")
        sys.stderr.write(f"=== variant {name}\n")
        sys.stderr.flush()
        one = parser().parse_args([*common, *extra])
        one.ckpt, one.out = f"{one.ckpt}-{name}", f"{one.out}-{name}"
        try:
            with warnings.catch_warnings():  # a fresh registry: this variant's warnings are shown again
                train(one)
        except Exception:
            traceback.print_exc()
            failed.append(name)
        sys.stderr.flush()
    if failed:
        sys.exit(f"variants that failed: {', '.join(failed)}")


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    kernel = Kernel(gradient_accumulation_steps=2)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, dl = kernel.prepare(model, opt, make_loader(args, kernel))
    progress = Progress()
    kernel.register_for_checkpointing(progress)
    resume_step = None
    if args.resume:
        kernel.load_state(args.ckpt)
        if args.disturb:
            torch.rand(1)
        if args.skip_call:  # Accelerate's examples/by_feature/checkpointing.py: the batches of this epoch seen
            resume_step = progress.step - progress.epoch * len(dl)
    seen: list[tuple[list[int], float]] = []
    while progress.step < args.steps:
        dl.set_epoch(progress.epoch)
        active = dl
        if args.skip_call and resume_step is not None:
            active = accel.skip_first_batches(dl, resume_step)
            resume_step = None
        for xb, yb, ids in active:
            with kernel.accumulate(model):
                loss = nn.functional.mse_loss(model(xb), yb) if len(xb) else (model(torch.zeros(1, 6)) * 0).sum()
                kernel.backward(loss)
                opt.step()
                opt.zero_grad()
            seen.append((ids.tolist(), float(xb.double().sum())))
            progress.step += 1
            if progress.step == args.save_at:
                kernel.save_state(args.ckpt)
            if progress.step == args.steps:
                break
        else:
            progress.epoch += 1
    digest = hashlib.sha256()
    for name, p in kernel.unwrap_model(model).state_dict().items():
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    with open(f"{args.out}.rank{kernel.process_index}.json", "w") as f:
        json.dump({"batches": seen, "params": digest.hexdigest()}, f)
    kernel.end_training()


if __name__ == "__main__":
    main()
