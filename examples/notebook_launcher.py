"""notebook_launcher: start the processes of a training function from Python (a Jupyter cell, or this script).

    python examples/notebook_launcher.py

In a notebook, define the function in a cell and call ``notebook_launcher(train, args, num_processes=2)`` in the
next one: every process runs ``train``, the Kernel is created inside it, and the results come back in process
order. Do not create a Kernel in the notebook's own process before launching (each process makes its own).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel, notebook_launcher


def train(epochs: int) -> float:
    kernel = Kernel()
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = kernel.prepare(model, optimizer, loader)
    for _ in range(epochs):
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            kernel.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    final = kernel.reduce(loss.detach(), "mean").item()
    kernel.print(f"process {kernel.process_index} of {kernel.num_processes}: final loss {final:.4f}")
    kernel.end_training()
    return final


if __name__ == "__main__":  # needed: the processes may import this file
    results = notebook_launcher(train, args=(3,), num_processes=2)
    print(f"results, in process order: {[round(r, 4) for r in results]}")
