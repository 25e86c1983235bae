"""MNIST-style example on scikit-learn's digits (8x8 images, ships with scikit-learn: no download). It needs
scikit-learn (``pip install -r examples/requirements.txt``), which no accel distribution installs.

A small CNN, AdamW, StepLR, three short epochs of training (about 0.89 accuracy on 2 CPU processes), each
followed by evaluation with ``gather_for_metrics``.

    python examples/train_digits.py                      # one process, kernel only
    accel launch -n 2 examples/train_digits.py           # two processes (accel-plugin-ddp)
    torchrun --nproc_per_node 2 examples/train_digits.py # also works

With ``--project_dir DIR`` it saves a checkpoint after every epoch (the newest two are kept) and, when DIR already
holds one, resumes from it: a run that was stopped (a Slurm requeue, a pre-empted node) continues where its last
complete epoch ended. See docs/slurm.md.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel, ProjectConfiguration


def datasets() -> tuple[TensorDataset, TensorDataset]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit(
            "examples/train_digits.py needs scikit-learn: pip install -r examples/requirements.txt"
        ) from None

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(len(y), generator=gen)
    train, test = order[:1500], order[1500:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(0.25), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--mixed_precision", default=None)
    parser.add_argument("--project_dir", default=None, help="checkpoint every epoch here; resume from the newest")
    args = parser.parse_args()

    torch.manual_seed(42)
    project = ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2) if args.project_dir else None
    kernel = Kernel(mixed_precision=args.mixed_precision, project_dir=args.project_dir, project_config=project)
    train_ds, test_ds = datasets()
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True)
    test_dl = DataLoader(test_ds, batch_size=64)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.7)
    model, optimizer, train_dl, test_dl, scheduler = kernel.prepare(model, optimizer, train_dl, test_dl, scheduler)

    first_epoch = 0
    if args.project_dir and kernel.latest_checkpoint():
        loaded = kernel.load_state()
        first_epoch = kernel.save_iteration  # checkpoint_<i> is saved after epoch i: i + 1 epochs are done
        kernel.print(f"resumed from {loaded.name}: epoch {first_epoch} is next")

    for epoch in range(first_epoch, args.epochs):
        model.train()
        for x, y in train_dl:
            loss = nn.functional.cross_entropy(model(x), y)
            kernel.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in test_dl:
                pred = model(x).argmax(dim=-1)
                pred, y = kernel.gather_for_metrics((pred, y))
                correct += int((pred == y).sum())
                total += len(y)
        kernel.print(
            f"epoch {epoch}: accuracy {correct / total:.3f} on {total} test images "
            f"({kernel.num_processes} process{'es' if kernel.num_processes > 1 else ''})"
        )
        if args.project_dir:
            kernel.save_state()
    kernel.end_training()


if __name__ == "__main__":
    main()
