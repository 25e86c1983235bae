"""DDP training and gather_for_metrics with even_batches=False where one process runs out of data first (run with
`accel launch -n 2`): every process must finish the epoch, in step with the others.

    --kind map|iterable --workers N --size S --out F
Each process writes F.rank<r>.json: its number of steps, the rows of its batches and the rows gathered.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from accel import Kernel


class Rows(Dataset):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((3,), float(i)), torch.tensor(i)


class RowStream(IterableDataset):
    """Split between the loader's workers, as a real stream is."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        ids = range(self.size) if info is None else range(info.id, self.size, info.num_workers)
        for i in ids:
            yield torch.full((3,), float(i)), torch.tensor(i)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=("map", "iterable"), default="map")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--size", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.manual_seed(0)
    kernel = Kernel(even_batches=False)
    data = RowStream(args.size) if args.kind == "iterable" else Rows(args.size)
    loader = DataLoader(data, batch_size=4, num_workers=args.workers)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, dl = kernel.prepare(model, opt, loader)
    steps, rows, gathered = 0, [], []
    for _ in range(args.epochs):
        for x, i in dl:
            loss = model(x).pow(2).sum() / max(1, len(x))  # an empty batch gives zero gradients
            kernel.backward(loss)
            opt.step()
            opt.zero_grad()
            gathered.extend(kernel.gather_for_metrics(i).tolist())
            rows.append(len(x))
            steps += 1
    with open(f"{args.out}.rank{kernel.process_index}.json", "w") as f:
        json.dump({"steps": steps, "rows": rows, "gathered": gathered}, f)
    kernel.end_training()


if __name__ == "__main__":
    main()
