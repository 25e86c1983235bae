"""Checkpoint and resume: save the whole training state every epoch, and continue from the newest checkpoint.

    python examples/checkpoint_resume.py --project_dir runs/ckpt --epochs 2   # trains epochs 0-1, saves after each
    python examples/checkpoint_resume.py --project_dir runs/ckpt --epochs 4   # resumes: trains epochs 2-3
    accel launch -n 2 examples/checkpoint_resume.py --project_dir runs/ckpt   # the same on two processes

``save_state`` writes the model, optimizer, scheduler, RNG states and the dataloaders' position under
``<project_dir>/checkpoints/checkpoint_<i>`` (the newest ``total_limit`` are kept); ``load_state()`` with no
argument loads the newest. Synthetic data: nothing is downloaded.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel, ProjectConfiguration


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project_dir", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    project = ProjectConfiguration(project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=2)
    kernel = Kernel(project_config=project)
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=8, gamma=0.9)
    loader = DataLoader(data, batch_size=16, shuffle=True)
    model, optimizer, loader, scheduler = kernel.prepare(model, optimizer, loader, scheduler)

    first_epoch = 0
    if kernel.latest_checkpoint() is not None:
        loaded = kernel.load_state()
        first_epoch = kernel.save_iteration  # checkpoint_<i> was saved after epoch i
        kernel.print(f"resumed from {loaded.name}: epoch {first_epoch} is next")
    for epoch in range(first_epoch, args.epochs):
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            kernel.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        kernel.save_state()
        kernel.print(f"epoch {epoch}: loss {kernel.reduce(loss.detach(), 'mean').item():.4f}, saved")
    kernel.end_training()


if __name__ == "__main__":
    main()
