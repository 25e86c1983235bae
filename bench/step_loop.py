"""One training loop, three ways: raw PyTorch, accel's Kernel, Accelerate's Accelerator. Prints steps/s as JSON.

    python bench/step_loop.py --impl raw|accel|accelerate --model tiny|medium [--accum 2 --clip 1.0] [--device cuda]

Run under torchrun (or accel launch) for the 2-process DDP variant: raw then wraps the model in DDP itself.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SIZES = {"tiny": (32, 64, 10, 16), "medium": (512, 2048, 512, 64)}  # in, hidden, out, batch


def build(size: str) -> tuple[nn.Module, DataLoader]:
    d_in, hidden, d_out, batch = SIZES[size]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, d_out))
    n = batch * 64
    data = TensorDataset(torch.randn(n, d_in), torch.randint(0, d_out, (n,)))
    return model, DataLoader(data, batch_size=batch, shuffle=False)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=("raw", "accel", "accelerate"), required=True)
    p.add_argument("--model", choices=tuple(SIZES), default="tiny")
    p.add_argument("--steps", type=int, default=0, help="timed steps (default: by model size)")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args()
    steps = args.steps or (3000 if args.model == "tiny" else 150)
    torch.set_num_threads(1)
    model, loader = build(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    loss_fn = nn.functional.cross_entropy

    cuda = args.device == "cuda"
    if args.impl == "raw":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        model.to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if world > 1:
            import torch.distributed as dist

            dist.init_process_group("nccl" if cuda else "gloo")
            model = nn.parallel.DistributedDataParallel(model)
            sampler = torch.utils.data.DistributedSampler(loader.dataset, shuffle=False)
            loader = DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler)
        import contextlib

        def step(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
            if cuda:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync = (i + 1) % args.accum == 0
            ctx = model.no_sync() if (world > 1 and not sync) else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(model(x), y) / args.accum
                loss.backward()
            if sync:
                if args.clip:
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                opt.step()
                opt.zero_grad()
    else:
        if args.impl == "accel":
            from accel import Kernel

            k = Kernel(cpu=not cuda, gradient_accumulation_steps=args.accum)
        else:
            from accelerate import Accelerator

            k = Accelerator(cpu=not cuda, gradient_accumulation_steps=args.accum)
        model, opt, loader = k.prepare(model, opt, loader)

        def step(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
            with k.accumulate(model):
                loss = loss_fn(model(x), y)
                k.backward(loss)
                if args.clip and k.sync_gradients:
                    k.clip_grad_norm_(model.parameters(), args.clip)
                opt.step()
                opt.zero_grad()

    def run(n: int) -> float:
        done = 0
        start = time.perf_counter()
        while done < n:
            for x, y in loader:
                step(done, x, y)
                done += 1
                if done == n:
                    break
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    run(max(20, steps // 10))  # warm-up
    seconds = run(steps)
    if rank == 0:
        print(json.dumps({"impl": args.impl, "model": args.model, "steps_per_s": steps / seconds}))


if __name__ == "__main__":
    main()
