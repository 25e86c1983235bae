"""Worker for tests/test_accelerate_scheduler.py: the learning-rate curve of each scheduler, built the way
Accelerate's examples build it (from ``len(train_dataloader) * epochs`` *before* ``prepare``), under accel or under
Accelerate itself, so the two can be compared step by step.

    accel launch -n 2 lr_curves.py OUT_DIR                                    # accel (Kernel)
    python -m torch.distributed.run --nproc_per_node 2 lr_curves.py OUT_DIR --framework accelerate

Each process writes OUT_DIR/<framework>_rank<process index>.json: for each case, the rate after every
``scheduler.step()`` call, the number of optimizer steps taken and the samples of each batch (this process's shard).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

EPOCHS = 2
SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer, int], Any]] = {
    "steplr": lambda opt, total: torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7),
    "onecycle": lambda opt, total: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total),
    "lambda": lambda opt, total: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total)),
}
#: name -> (constructor arguments, batch size of the script's dataloader). The same names mean the same thing under
#: both frameworks; "per_optimizer_step" exists under accel only.
CONFIGS: dict[str, tuple[dict[str, Any], int]] = {
    "default": ({}, 4),
    "accumulate2": ({"gradient_accumulation_steps": 2}, 4),
    "split_batches": ({"split_batches": True}, 8),
    "not_with_optimizer": ({"step_scheduler_with_optimizer": False}, 4),
    "per_optimizer_step": ({"scheduler_steps": "per_optimizer_step"}, 4),
}


def make(framework: str, arguments: dict[str, Any]) -> Any:
    arguments = dict(arguments)
    if framework == "accel":
        from accel import DataLoaderConfiguration, Kernel
    else:
        from accelerate import Accelerator as Kernel
        from accelerate import DataLoaderConfiguration
    if arguments.pop("split_batches", False):
        arguments["dataloader_config"] = DataLoaderConfiguration(split_batches=True)
    return Kernel(**arguments)


def curve(framework: str, scheduler: str, config: str) -> dict[str, Any]:
    arguments, batch_size = CONFIGS[config]
    kernel = make(framework, arguments)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(42, 3, generator=gen), torch.randn(42, 1, generator=gen))
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataloader = DataLoader(data, batch_size=batch_size)
    sched = SCHEDULERS[scheduler](optimizer, len(dataloader) * EPOCHS)  # Accelerate's examples do exactly this
    model, optimizer, dataloader, sched = kernel.prepare(model, optimizer, dataloader, sched)
    lrs: list[float] = []
    inputs: list[list[float]] = []  # the first feature of each sample this process got: its shard, batch by batch
    steps = 0
    for _ in range(EPOCHS):
        for x, y in dataloader:
            inputs.append(x[:, 0].tolist())
            with kernel.accumulate(model):
                kernel.backward(nn.functional.mse_loss(model(x), y))
                steps += int(kernel.sync_gradients)
                optimizer.step()
                sched.step()
                optimizer.zero_grad()
            lrs.append(sched.get_last_lr()[0])
    return {"lrs": lrs, "optimizer_steps": steps, "batches": len(dataloader), "inputs": inputs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--framework", choices=("accel", "accelerate"), default="accel")
    args = parser.parse_args()
    configs = [c for c in CONFIGS if args.framework == "accel" or c != "per_optimizer_step"]
    result = {f"{s}/{c}": curve(args.framework, s, c) for s in SCHEDULERS for c in configs}
    if args.framework == "accel":
        from accel.kernel import active_kernel

        kernel = active_kernel()
        rank = kernel.process_index if kernel is not None else 0
    else:
        from accelerate import PartialState

        rank = PartialState().process_index
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.framework}_rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
