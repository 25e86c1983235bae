"""Worker script of plugins/deepspeed/tests/test_deepspeed_dummy.py (``accel launch -n 2 --plugin deepspeed``).

``deepspeed_dummy.py OUT CASES``: CASES is a JSON list of ``[name, mode, kernel_options]``; the cases run one after
another in this launch's processes (one ``import torch``/deepspeed for all), each with a fresh ``Kernel(**options)``,
model, optimizer and loader, over the one process group this script creates (each Kernel uses it, as under one
launch per case the Kernel would create it). A case that fails ends the processes: its result and the later ones are
missing, and the test says which.

MODE ``dummy``: the DeepSpeed config file has ``optimizer`` and ``scheduler`` sections full of "auto"; the script
passes ``DummyOptim`` / ``DummyScheduler`` (Accelerate's way) over two parameter groups. MODE ``empty``: the script's
own AdamW over two groups, the second one empty (as the no-weight-decay group of a model without biases or norms),
and a LambdaLR built before ``prepare()`` (DeepSpeed drops the empty group inside ``prepare()``). Each rank writes
OUT/<name>/rank<r>.json with the learning rates seen at every step and the losses.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel

STEPS_PER_EPOCH, EPOCHS, WARMUP = 6, 2, 3


def run(out: Path, mode: str, options: dict[str, Any]) -> None:
    kernel = Kernel(**options)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4 * 2 * STEPS_PER_EPOCH, 8, generator=gen), torch.randn(48, 1, generator=gen))
    loader = DataLoader(data, batch_size=4)
    total = len(loader) * EPOCHS  # counted before prepare(), over the whole dataset (Accelerate's examples)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    if mode == "dummy":
        from accel.utils import DummyOptim, DummyScheduler

        groups = [{"params": weights, "weight_decay": 0.01}, {"params": biases, "weight_decay": 0.0}]
        optimizer = DummyOptim(groups, lr=0.05)
        scheduler = DummyScheduler(optimizer, total_num_steps=total, warmup_num_steps=WARMUP)
    else:
        groups = [{"params": weights + biases, "weight_decay": 0.01}, {"params": [], "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=0.05)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, loader, scheduler = kernel.prepare(model, optimizer, loader, scheduler)
    local_sgd = "accepted"
    if kernel.num_processes > 1:
        from accel.utils import LocalSGD

        try:  # only a strategy with a full parameter replica per process may average parameters
            LocalSGD(kernel, model, local_sgd_steps=2)
        except Exception as exc:
            local_sgd = f"{type(exc).__name__}: {exc}"
    lrs, losses, groups_seen = [], [], len(optimizer.param_groups)
    for _ in range(EPOCHS):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            kernel.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            lrs.append([scheduler.get_last_lr(), [g["lr"] for g in optimizer.param_groups]])
            losses.append(loss.item())
    # save_state / load_state carry the scheduler's position (the engine's scheduler under DummyScheduler)
    saved_state = scheduler.state_dict()
    kernel.save_state(out / "ckpt")
    for group in optimizer.param_groups:
        group["lr"] = 123.0
    scheduler.load_state_dict({k: 0 if isinstance(v, int) else v for k, v in saved_state.items()})
    kernel.load_state(out / "ckpt")
    restored = [scheduler.state_dict() == saved_state, [g["lr"] for g in optimizer.param_groups] == lrs[-1][1]]
    (out / f"rank{kernel.process_index}.json").write_text(
        json.dumps(
            {
                "restored": restored,
                "local_sgd": local_sgd,
                "lrs": lrs,
                "losses": losses,
                "groups": groups_seen,
                "optimizer": type(optimizer.optimizer).__name__,
                "weight_decay": [g["weight_decay"] for g in optimizer.param_groups],
            }
        )
    )
    kernel.end_training()


def main() -> None:
    dist.init_process_group("gloo")
    for name, mode, options in json.loads(sys.argv[2]):
        out = Path(sys.argv[1]) / name
        out.mkdir(parents=True, exist_ok=True)
        run(out, mode, options)
        print(f"case {name}: done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
