"""One training loop, four ways: raw PyTorch, accel's Kernel, Accelerate's Accelerator, Lightning Fabric. Prints
steps/s as JSON.

    python bench/step_loop.py --impl raw|accel|accelerate|fabric --model tiny|medium [--accum 2 --clip 1.0] [--device cuda]
    python bench/step_loop.py --impl accel --paired ...    # also a raw loop in the same process, interleaved

Run under torchrun (or accel launch) for the 2-process DDP variant: raw then wraps the model in DDP itself.

``--paired`` measures the framework against a hand-written raw loop *in the same process*: rounds of a block of
framework steps and a block of raw steps (a few milliseconds each), alternating which goes first, and reports the
median of the per-round ratios. Separate processes of the same script differ by up to ±10 % in steps/s on this
machine (memory layout, CPU placement), more than the overhead being measured; within one process, both loops share
those conditions. The blocks are short because the machine's speed also drifts within a process: over 50 ms windows
the ratio of a loop to *itself* ranged from 0.75 to 1.5, and 8-step blocks brought that A/A comparison to 1.00 ± 0.01.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

#: in, hidden, out, batch; parameters: tiny 7k, medium 6.3M, 8m 8.4M, 30m 33.6M (the DDP-by-size rows)
SIZES = {
    "tiny": (32, 64, 10, 16),
    "medium": (512, 2048, 512, 64),
    "8m": (1024, 2048, 1024, 64),
    "30m": (2048, 4096, 2048, 64),
}


def build(size: str) -> tuple[nn.Module, DataLoader]:
    d_in, hidden, d_out, batch = SIZES[size]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, d_out)
    )
    n = batch * 64
    data = TensorDataset(torch.randn(n, d_in), torch.randint(0, d_out, (n,)))
    return model, DataLoader(data, batch_size=batch, shuffle=False)


Step = Callable[[int, torch.Tensor, torch.Tensor], None]


Shared = tuple[nn.Module, torch.optim.Optimizer, DataLoader]


def raw_loop(args: argparse.Namespace, world: int, shared: Shared | None = None) -> tuple[Step, DataLoader]:
    """The hand-written loop; ``shared``: the very model, optimizer and loader a framework loop was given."""
    if shared is not None:
        model, opt, loader = shared
    else:
        model, loader = build(args.model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model.to(device)
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():  # paired with a framework, it already made the process group
            dist.init_process_group("nccl" if cuda else "gloo")
        model = nn.parallel.DistributedDataParallel(model)
        sampler = torch.utils.data.DistributedSampler(loader.dataset, shuffle=False)
        loader = DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler)

    bf16 = getattr(args, "mixed_precision", "no") == "bf16"

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if bf16:  # what a hand-written bf16 loop does: the forward and the loss under autocast
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return nn.functional.cross_entropy(model(x), y)
        return nn.functional.cross_entropy(model(x), y)

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        if cuda:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        sync = (i + 1) % args.accum == 0
        if world > 1 and not sync:
            with model.no_sync():
                (loss_of(x, y) / args.accum).backward()
        else:  # what a hand-written loop does: no context it does not need, no division by 1
            loss = loss_of(x, y)
            (loss / args.accum if args.accum > 1 else loss).backward()
        if sync:
            if args.clip:
                nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad()

    return step, loader


def out_of_time(mine: bool, world: int) -> bool:
    """Whether any process is past its time budget: every process of a DDP group must stop after the same round
    (the next round's all-reduce would wait for a process that stopped)."""
    if world == 1:
        return mine
    import torch.distributed as dist

    flag = torch.tensor([1.0 if mine else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def framework_loop(args: argparse.Namespace) -> tuple[Step, Any, Shared]:
    """The framework's loop, and the model, optimizer and loader it prepared (as the user built them)."""
    model, loader = build(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    given = (model, opt, loader)
    cpu = args.device != "cuda"
    if args.impl == "fabric":
        return fabric_loop(args, model, opt, loader, given)
    if args.impl == "accel":
        from accel import Kernel

        extra: dict[str, Any] = {}  # only what differs from the defaults: the default run builds Kernel as before
        if getattr(args, "mixed_precision", "no") != "no":
            extra["mixed_precision"] = args.mixed_precision
        if getattr(
            args, "ddp", ""
        ):  # DistributedDataParallel settings other than the defaults (the ddp plugin's options)
            from accel import DistributedDataParallelKwargs

            extra["kwargs_handlers"] = [DistributedDataParallelKwargs(**json.loads(args.ddp))]
        if getattr(args, "plugins", None):  # bench/instructions.py: the ddp plugin in a world of one process
            extra["plugins"] = args.plugins
        k: Any = Kernel(cpu=cpu, gradient_accumulation_steps=args.accum, **extra)
    else:
        from accelerate import Accelerator

        k = Accelerator(cpu=cpu, gradient_accumulation_steps=args.accum, mixed_precision=args.mixed_precision)
    model, opt, loader = k.prepare(model, opt, loader)

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        with k.accumulate(model):
            loss = nn.functional.cross_entropy(model(x), y)
            k.backward(loss)
            if args.clip and k.sync_gradients:
                k.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad()

    return step, loader, given


def fabric_loop(
    args: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer, loader: DataLoader, given: Shared
) -> tuple[Step, Any, Shared]:
    """Lightning Fabric's loop, written the way its docs write gradient accumulation and clipping."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu" if args.device != "cuda" else "cuda", devices=1)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(loader)

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        sync = (i + 1) % args.accum == 0
        with fabric.no_backward_sync(model, enabled=not sync):
            loss = nn.functional.cross_entropy(model(x), y)
            fabric.backward(loss / args.accum if args.accum > 1 else loss)
        if sync:
            if args.clip:
                fabric.clip_gradients(model, opt, max_norm=args.clip)
            opt.step()
            opt.zero_grad()

    return step, loader, given


def runner(step: Step, loader: Any, cuda: bool) -> Callable[[int], float]:
    """``run(n)``: n more steps (the pass continues where the last call stopped); returns the seconds taken."""

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from loader

    it = batches()
    done = 0

    def run(n: int) -> float:
        nonlocal done
        start = time.perf_counter()
        for _ in range(n):
            x, y = next(it)
            step(done, x, y)
            done += 1
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=("raw", "accel", "accelerate", "fabric"), required=True)
    p.add_argument("--model", choices=tuple(SIZES), default="tiny")
    p.add_argument("--steps", type=int, default=0, help="timed steps (default: by model size)")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--mixed-precision", choices=("no", "bf16"), default="no")
    p.add_argument(
        "--ddp", default="", help='accel: DistributedDataParallelKwargs as JSON, e.g. {"static_graph": true}'
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--paired", action="store_true", help="also run a raw loop in this process, interleaved")
    p.add_argument(
        "--block", type=int, default=0, help="steps per turn in the paired comparison (default: by model size)"
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=0.0,
        help="paired: stop after the round that passes this many seconds (at least 6 rounds; --steps still caps "
        "them), so a slow machine (bf16 without native instructions) keeps the bench's time bounded",
    )
    args = p.parse_args()
    steps = args.steps or {"tiny": 3000, "medium": 150, "8m": 80, "30m": 24}[args.model]
    warm = max(20, steps // 10) if args.model in ("tiny", "medium") else 4
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    cuda = args.device == "cuda"
    if args.impl == "raw":
        run = runner(*raw_loop(args, world), cuda)
        run(warm)  # warm-up
        seconds = run(steps)
        result = {"impl": "raw", "model": args.model, "steps_per_s": steps / seconds}
    elif not args.paired:
        run = runner(*framework_loop(args)[:2], cuda)
        run(warm)
        seconds = run(steps)
        result = {"impl": args.impl, "model": args.model, "steps_per_s": steps / seconds}
    else:
        # One process: the raw loop trains the very model, optimizer and loader the framework was given (prepare
        # returns them unwrapped there), so both loops touch the same memory and only the loop code differs.
        # DDP: separate models (one module cannot sit in two DDP wrappers), on the process group the framework set up.
        step, loader, given = framework_loop(args)
        fw = runner(step, loader, cuda)
        raw = runner(*raw_loop(args, world, given if world == 1 else None), cuda)
        fw(warm)
        raw(warm)
        block = args.block or (8 if args.model == "tiny" else 2 if args.model == "medium" else 1)
        chunk = -(-block // args.accum) * args.accum  # whole accumulation cycles
        fw_s: list[float] = []
        raw_s: list[float] = []
        # CPU seconds of this process (all its threads: gloo's too) per block beside the wall time: a block's wall
        # time also counts the time this process waited for the core or for the other process, its CPU time only
        # the work its loop made
        fw_c: list[float] = []
        raw_c: list[float] = []

        def timed(run: Callable[[int], float], wall: list[float], cpu: list[float]) -> None:
            start = time.process_time()
            wall.append(run(chunk))
            cpu.append(time.process_time() - start)

        began = time.perf_counter()
        for r in range(max(2, steps // chunk)):
            if r % 2:
                timed(fw, fw_s, fw_c)
                timed(raw, raw_s, raw_c)
            else:
                timed(raw, raw_s, raw_c)
                timed(fw, fw_s, fw_c)
            if args.seconds and r + 1 >= 6 and out_of_time(time.perf_counter() - began > args.seconds, world):
                break
        ratios = sorted(r / f for f, r in zip(fw_s, raw_s, strict=True))
        cpu_ratios = [r / f for f, r in zip(fw_c, raw_c, strict=True) if f > 0]
        result = {
            "impl": args.impl,
            "model": args.model,
            "steps_per_s": chunk / statistics.median(fw_s),
            "raw_steps_per_s": chunk / statistics.median(raw_s),
            "ratio_to_raw": statistics.median(ratios),
            "rounds": len(ratios),
            "ratio_quartiles": [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]],
            "cpu_ratio_to_raw": statistics.median(cpu_ratios) if cpu_ratios else None,
        }
    if rank == 0:
        print(json.dumps(result))
    if world > 1 and args.impl == "raw":
        import gc

        import torch.distributed as dist

        # As a careful hand-written script ends: the DDP model first (it holds the process group; were it the last
        # to let go, at interpreter exit, gloo's threads could deadlock or abort), then the group.
        del run
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
