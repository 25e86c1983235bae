"""Worker for tests/test_distributed.py: deterministic training whose result does not depend on the process count.

    python train_equiv.py OUT_DIR [--global_batch 8] [--plugin ddp] [--fail_once MARKER] [--exit_code N]
    accel launch -n 2 train_equiv.py OUT_DIR ...
    python -m torch.distributed.run --standalone --nproc_per_node 2 train_equiv.py OUT_DIR ...

Every optimizer step sees the same global batch whatever the number of processes N: a process takes
``global_batch / N`` samples per step (and half of that per micro-batch with two accumulation steps). Because the
prepared loader deals batches round-robin, the N shards of consecutive batches make up exactly the global batch
that one process would take, so the trained parameters must match the one-process run.

Each process writes OUT_DIR/rank{process_index}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel


def data(n: int = 96) -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 6, generator=gen)
    y = torch.sin(x @ torch.randn(6, 2, generator=gen))
    return TensorDataset(x, y)


def train(kernel: Kernel, global_batch: int, accumulation: int, epochs: int = 2) -> dict[str, Any]:
    n = kernel.num_processes
    if global_batch % (n * accumulation):
        raise SystemExit(f"global batch {global_batch} must divide by processes x accumulation {n * accumulation}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    dl = DataLoader(data(), batch_size=global_batch // (n * accumulation), shuffle=True)
    model, opt, dl, sched = kernel.prepare(model, opt, dl, sched)
    model_type = type(model).__name__
    steps = 0
    for _ in range(epochs):
        for x, y in dl:
            with kernel.accumulate(model):
                kernel.backward(nn.functional.mse_loss(model(x), y))
                kernel.clip_grad_norm_(model.parameters(), 1.0)
                steps += int(kernel.sync_gradients)
                opt.step()
                sched.step()
                opt.zero_grad()
    params = torch.cat([p.detach().flatten() for p in kernel.unwrap_model(model).parameters()])
    everywhere = kernel.gather(params[None])
    return {
        "model_type": model_type,
        "params": params.tolist(),
        "in_sync": all(torch.equal(p, params) for p in everywhere.unbind(0)),
        "optimizer_steps": steps,
        "lr": opt.param_groups[0]["lr"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--global_batch", type=int, default=8)
    parser.add_argument("--plugin", action="append", default=None)
    parser.add_argument("--fail_once", type=Path, default=None, help="process 0 fails if this file does not exist")
    parser.add_argument("--exit_code", type=int, default=None, help="every process exits with this code")
    args = parser.parse_args()

    # The script keeps the global batch fixed (each process takes global_batch / N), so its schedule counts optimizer
    # steps: accel's per-optimizer-step rule, not Accelerate's (which steps N times per optimizer step).
    kernel = Kernel(plugins=args.plugin, scheduler_steps="per_optimizer_step")
    if args.exit_code is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / f"attempts_rank{kernel.process_index}.txt").open("a") as fh:
            fh.write(f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '?')}\n")
        print(f"process {kernel.process_index} exits with {args.exit_code} on purpose", file=sys.stderr)
        sys.exit(args.exit_code)
    if args.fail_once is not None and kernel.is_main_process and not args.fail_once.exists():
        args.fail_once.write_text("failed once")
        print("process 0 fails on purpose (first attempt)", file=sys.stderr)
        sys.exit(1)
    acc_kernel = Kernel(plugins=args.plugin, gradient_accumulation_steps=2, scheduler_steps="per_optimizer_step")
    env_keys = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TEST_LAUNCHER",
    )
    result = {
        "process_index": kernel.process_index,
        "local_process_index": kernel.local_process_index,
        "num_processes": kernel.num_processes,
        "components": [f"{c.name}:{c.role}" for c in kernel.components],
        "env": {k: os.environ.get(k) for k in env_keys},
        "plain": train(kernel, args.global_batch, accumulation=1),
        "accumulate": train(acc_kernel, args.global_batch, accumulation=2),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{kernel.process_index}.json").write_text(json.dumps(result, indent=1))
    kernel.end_training()


if __name__ == "__main__":
    main()
