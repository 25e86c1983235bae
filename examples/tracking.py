"""Experiment tracking: the run's config and its metrics, to every tracker named in ``log_with``.

    python examples/tracking.py --project_dir runs/track                       # accel-plugin-jsonl: runs/track/jsonl/
    python examples/tracking.py --project_dir runs/track --log_with tensorboard  # accel-plugin-tensorboard
    accel launch -n 2 examples/tracking.py --project_dir runs/track            # logged once, by the main process

A tracker is a plugin (``accel-plugin-jsonl``, ``-tensorboard``, ``-mlflow``, ``-wandb``); ``log_with="all"``
uses every installed one. Only the main process logs, so no rank check is needed around ``kernel.log``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project_dir", required=True)
    parser.add_argument("--log_with", default="jsonl")
    args = parser.parse_args()

    kernel = Kernel(log_with=args.log_with, project_dir=args.project_dir)
    config = {"lr": 0.05, "batch_size": 16, "epochs": 3}
    kernel.init_trackers("tracking_example", config=config)
    torch.manual_seed(0)
    x = torch.randn(128, 4)
    loader = DataLoader(TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])), batch_size=16)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    model, optimizer, loader = kernel.prepare(model, optimizer, loader)

    step = 0
    for epoch in range(config["epochs"]):
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            kernel.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            kernel.log({"train/loss": loss.item()}, step=step)
            step += 1
        kernel.log({"epoch": epoch, "lr": optimizer.param_groups[0]["lr"]}, step=step)
    kernel.print(f"logged {step} steps to {', '.join(kernel.log_with)}")
    kernel.end_training()  # closes the trackers' runs


if __name__ == "__main__":
    main()
