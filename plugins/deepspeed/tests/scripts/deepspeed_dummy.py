"""Worker script of tests/test_utils_deepspeed.py (``accel launch -n 2 --plugin deepspeed``).

MODE ``dummy``: the DeepSpeed config file has ``optimizer`` and ``scheduler`` sections full of "auto"; the script
passes ``DummyOptim`` / ``DummyScheduler`` (Accelerate's way) over two parameter groups. MODE ``empty``: the script's
own AdamW over two groups, the second one empty (as the no-weight-decay group of a model without biases or norms),
and a LambdaLR built before ``prepare()`` (DeepSpeed drops the empty group inside ``prepare()``). Each rank writes
OUT/rank<r>.json with the learning rates seen at every step and the losses.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel

OUT, MODE = Path(sys.argv[1]), sys.argv[2]
STEPS_PER_EPOCH, EPOCHS, WARMUP = 6, 2, 3


def main() -> None:
    kernel = Kernel()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4 * 2 * STEPS_PER_EPOCH, 8, generator=gen), torch.randn(48, 1, generator=gen))
    loader = DataLoader(data, batch_size=4)
    total = len(loader) * EPOCHS  # counted before prepare(), over the whole dataset (Accelerate's examples)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    if MODE == "dummy":
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
    kernel.save_state(OUT / "ckpt")
    for group in optimizer.param_groups:
        group["lr"] = 123.0
    scheduler.load_state_dict({k: 0 if isinstance(v, int) else v for k, v in saved_state.items()})
    kernel.load_state(OUT / "ckpt")
    restored = [scheduler.state_dict() == saved_state, [g["lr"] for g in optimizer.param_groups] == lrs[-1][1]]
    (OUT / f"rank{kernel.process_index}.json").write_text(
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


if __name__ == "__main__":
    main()
