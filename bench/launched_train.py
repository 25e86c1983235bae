"""The training script of bench/launched.py, one shape for every framework: a DataLoader over a TensorDataset (prepared
by the framework), AdamW, cross-entropy, an MLP; run through each framework's own launcher. Rank 0 prints steps/s and
CPU milliseconds per step as its last line (JSON): those of the median of ten equal parts of the timed steps, so a
burst of load from another process moves one part, not the figure.

    python bench/launched_train.py --impl raw|accel|accelerate|fabric --model tiny|medium [--accum 4 --clip 1.0]
"""

print("ready", flush=True)  # the first statement: bench/launched.py times the launch until this line

import argparse  # noqa: E402 - after the first line on purpose
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

#: in, hidden, out, batch (the medium MLP is 1024-4096-1024)
SIZES = {"tiny": (32, 64, 10, 16), "medium": (1024, 4096, 1024, 64)}
#: the timed steps are timed in this many equal parts (see main)
SEGMENTS = 10

Step = Callable[[int, torch.Tensor, torch.Tensor], None]


def build(size: str) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    d_in, hidden, d_out, batch = SIZES[size]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, d_out)
    )
    n = batch * 64
    data = TensorDataset(torch.randn(n, d_in), torch.randint(0, d_out, (n,)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), DataLoader(data, batch_size=batch)


def raw(args: argparse.Namespace, world: int) -> tuple[Step, Any, Callable[[], None]]:
    """The hand-written loop (DistributedDataParallel and a DistributedSampler on several processes)."""
    import torch.distributed as dist

    net, opt, loader = build(args.model)
    model: Any = net
    if world > 1:
        dist.init_process_group("gloo")
        model = nn.parallel.DistributedDataParallel(net)
        sampler: Any = torch.utils.data.DistributedSampler(loader.dataset, shuffle=False)
        loader = DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler)

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        sync = (i + 1) % args.accum == 0
        if world > 1 and not sync:
            with model.no_sync():
                (nn.functional.cross_entropy(model(x), y) / args.accum).backward()
        else:
            loss = nn.functional.cross_entropy(model(x), y)
            (loss / args.accum if args.accum > 1 else loss).backward()
        if sync:
            if args.clip:
                nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad()

    def end() -> None:
        nonlocal model
        if world > 1:  # the DDP model first (it holds the group), then the group
            del model
            dist.destroy_process_group()

    return step, loader, end


def framework(args: argparse.Namespace) -> tuple[Step, Any, Callable[[], None]]:
    """accel's Kernel or Accelerate's Accelerator: the same loop, written as their docs write it."""
    model, opt, loader = build(args.model)
    if args.impl == "accel":
        from accel import Kernel

        k: Any = Kernel(cpu=True, gradient_accumulation_steps=args.accum)
    else:
        from accelerate import Accelerator

        k = Accelerator(cpu=True, gradient_accumulation_steps=args.accum)
    model, opt, loader = k.prepare(model, opt, loader)

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        with k.accumulate(model):
            loss = nn.functional.cross_entropy(model(x), y)
            k.backward(loss)
            if args.clip and k.sync_gradients:
                k.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad()

    return step, loader, k.end_training


def fabric(args: argparse.Namespace) -> tuple[Step, Any, Callable[[], None]]:
    """Lightning Fabric's loop as its docs write accumulation and clipping (settings from ``fabric run``)."""
    from lightning.fabric import Fabric

    f = Fabric()
    model, opt, loader = build(args.model)
    model, opt = f.setup(model, opt)
    loader = f.setup_dataloaders(loader)

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        sync = (i + 1) % args.accum == 0
        with f.no_backward_sync(model, enabled=not sync):
            loss = nn.functional.cross_entropy(model(x), y)
            f.backward(loss / args.accum if args.accum > 1 else loss)
        if sync:
            if args.clip:
                f.clip_gradients(model, opt, max_norm=args.clip)
            opt.step()
            opt.zero_grad()

    return step, loader, lambda: None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=("raw", "accel", "accelerate", "fabric"), required=True)
    p.add_argument("--model", choices=tuple(SIZES), default="tiny")
    p.add_argument("--steps", type=int, default=0, help="timed micro-steps (default: by model size)")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0)
    args = p.parse_args()
    steps = args.steps or {"tiny": 6000, "medium": 40}[args.model]
    world = int(os.environ.get("WORLD_SIZE", 1))
    # one intra-op thread, as the launchers give each of several processes (OMP_NUM_THREADS=1): a 1-process run on
    # a shared machine would otherwise time OpenMP's thread hand-offs more than the frameworks
    torch.set_num_threads(1)
    make = {"raw": lambda: raw(args, world), "fabric": lambda: fabric(args)}.get(args.impl, lambda: framework(args))
    step, loader, end = make()

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from loader

    it = batches()
    warm = max(8, steps // 10)
    for i in range(warm):
        step(i, *next(it))
    # The timed steps run in SEGMENTS equal parts, each timed on its own; the rate is the median part's. A burst of
    # another process's load on the shared machine then moves one part's time, not the figure (the whole run's rate
    # is reported beside it).
    per = max(1, steps // SEGMENTS)
    walls, cpus = [], []
    for start in range(warm, warm + per * SEGMENTS, per):
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(start, start + per):
            step(i, *next(it))
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    if int(os.environ.get("RANK", 0)) == 0:
        result = {
            "impl": args.impl,
            "steps_per_s": per / statistics.median(walls),
            "cpu_ms_per_step": 1e3 * statistics.median(cpus) / per,
            "steps_per_s_whole_run": per * SEGMENTS / sum(walls),
        }
        print(json.dumps(result))
    end()


if __name__ == "__main__":
    main()
