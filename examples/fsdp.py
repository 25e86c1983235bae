"""FSDP: parameters, gradients and optimizer state sharded over the processes (accel-plugin-fsdp, FSDP2).

    accel launch -n 2 --plugin fsdp examples/fsdp.py      # 2 CPU processes (gloo) or 2 GPUs (nccl)
    accel launch -n 2 --plugin fsdp --mixed_precision bf16 examples/fsdp.py

The script is the one you would write for plain data parallelism: the plugin shards the model in ``prepare``.
``kernel.get_state_dict(model)`` gathers the full weights (call it on every process: it is a collective), for
saving a plain checkpoint from the main process.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel


def main() -> None:
    kernel = Kernel()
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    data = TensorDataset(x, (x.sum(dim=1) > 0).long())
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=16, shuffle=True)
    model, optimizer, loader = kernel.prepare(model, optimizer, loader)

    for epoch in range(2):
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(xb), yb)
            kernel.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        kernel.print(f"epoch {epoch}: loss {kernel.reduce(loss.detach(), 'mean').item():.4f}")
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    full = sum(t.numel() for t in kernel.get_state_dict(model).values())
    kernel.print(f"{kernel.num_processes} process(es): {local} of {full} parameters on each process")
    kernel.end_training()


if __name__ == "__main__":
    main()
