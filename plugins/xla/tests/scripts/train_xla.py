"""Digits training through accel with whatever strategy is selected; prints one JSON line per epoch (mean training
loss, test accuracy, where the model lives) for the tests. Does not import torch_xla itself.

    accel launch --plugin xla train_xla.py --epochs 3
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel


def datasets() -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = order[:1500], order[1500:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.1),
        nn.Linear(16 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    torch.manual_seed(0)
    kernel = Kernel()
    train_ds, test_ds = datasets()
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr)
    train_dl = DataLoader(train_ds, batch_size=50, shuffle=True)
    test_dl = DataLoader(test_ds, batch_size=99)
    net, optimizer, train_dl, test_dl = kernel.prepare(net, optimizer, train_dl, test_dl)
    same = {id(p) for p in kernel.unwrap_model(net).parameters()} == {
        id(p) for g in optimizer.param_groups for p in g["params"]
    }
    for epoch in range(args.epochs):
        net.train()
        losses = []
        batch_devices = set()
        for x, y in train_dl:
            batch_devices.add(x.device.type)
            loss = nn.functional.cross_entropy(net(x), y)
            kernel.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        mean_loss = float(torch.stack(losses).mean().cpu())
        net.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in test_dl:
                pred, y = kernel.gather_for_metrics((net(x).argmax(-1), y))
                correct += int((pred == y).sum())
                total += len(y)
        kernel.print(
            json.dumps(
                {
                    "epoch": epoch,
                    "loss": mean_loss,
                    "accuracy": correct / total,
                    "total": total,
                    "device": str(kernel.device),
                    "param_device": next(kernel.unwrap_model(net).parameters()).device.type,
                    "batch_devices": sorted(batch_devices),
                    "optimizer_has_model_params": same,
                    "strategy": [c.name for c in kernel.components if c.role == "strategy"],
                    "processes": kernel.num_processes,
                    "mixed_precision": kernel.mixed_precision,
                    "param_dtype": str(next(kernel.unwrap_model(net).parameters()).dtype),
                }
            ),
            flush=True,
        )
    kernel.end_training()


if __name__ == "__main__":
    main()
