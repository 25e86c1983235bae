"""DeepSpeed ZeRO: optimizer state (stage 1), gradients (2) and parameters (3) partitioned over the processes
(accel-plugin-deepspeed).

    accel launch -n 2 --plugin deepspeed --zero_stage 2 examples/deepspeed_zero.py
    accel launch -n 2 --plugin deepspeed --zero_stage 3 --offload_optimizer_device cpu examples/deepspeed_zero.py
    accel launch -n 2 --plugin deepspeed --deepspeed_config_file ds.json examples/deepspeed_zero.py

A torch optimizer is handed to the DeepSpeed engine as it is; ``"auto"`` values of a config file are filled from
the prepared objects. On CPU the first run builds DeepSpeed's shared-memory op (it can take minutes; later runs
reuse it from TORCH_EXTENSIONS_DIR).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel


def main() -> None:
    kernel = Kernel(gradient_accumulation_steps=2)
    with kernel.model_init_context():  # DeepSpeed's zero.Init under ZeRO-3 with zero3_init_flag; else nothing
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    x = torch.randn(128, 8, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.mean(dim=1, keepdim=True)), batch_size=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = kernel.prepare(model, optimizer, loader)

    for epoch in range(2):
        for xb, yb in loader:
            with kernel.accumulate(model):
                loss = nn.functional.mse_loss(model(xb), yb)
                kernel.backward(loss)  # the engine's backward
                optimizer.step()  # the engine's step, on the accumulation boundary
                optimizer.zero_grad()
        kernel.print(f"epoch {epoch}: loss {kernel.reduce(loss.detach(), 'mean').item():.4f}")
    kernel.end_training()


if __name__ == "__main__":
    main()
