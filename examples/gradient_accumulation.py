"""Gradient accumulation: an optimizer step every 4 batches, with gradients synchronised only on that batch.

    python examples/gradient_accumulation.py
    accel launch -n 2 examples/gradient_accumulation.py

Inside ``kernel.accumulate(model)``, ``kernel.backward`` divides the loss by ``gradient_accumulation_steps``,
the processes skip the gradient all-reduce until the last batch of the group (``no_sync``), and the prepared
optimizer and scheduler step only when ``kernel.sync_gradients`` is true, so the loop looks like one without
accumulation. The epoch's last, incomplete group still steps.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel


def main() -> None:
    kernel = Kernel(gradient_accumulation_steps=4)
    torch.manual_seed(0)
    x = torch.randn(320, 8)
    data = TensorDataset(x, (x[:, :1] > 0).float())
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model, optimizer, loader = kernel.prepare(model, optimizer, loader)

    steps = 0
    for epoch in range(3):
        for xb, yb in loader:
            with kernel.accumulate(model):
                loss = nn.functional.binary_cross_entropy_with_logits(model(xb), yb)
                kernel.backward(loss)
                optimizer.step()  # only applied on every 4th batch
                optimizer.zero_grad()
                steps += int(kernel.sync_gradients)
        kernel.print(f"epoch {epoch}: loss {kernel.reduce(loss.detach(), 'mean').item():.4f}, {steps} optimizer steps")
    kernel.end_training()


if __name__ == "__main__":
    main()
