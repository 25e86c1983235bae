"""A strategy plugin that writes its own checkpoint format refuses ``save_state(asynchronous=True)`` in one line.

    python ckpt_async_refused.py DIR fsdp|deepspeed

One plain process (no launcher) with the plugin chosen through ``Kernel(plugins=[...])``; one training step, then
an asynchronous save (must raise ``UsageError``, leaving nothing in DIR), then a synchronous one (must work). Prints
``refused: <message>`` and ``sync ok``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel, UsageError


def main() -> None:
    directory, plugin = Path(sys.argv[1]), sys.argv[2]
    if plugin == "fsdp":
        kernel = Kernel(cpu=True, plugins=["fsdp"], fsdp_auto_wrap_policy="NO_WRAP")
    else:
        kernel = Kernel(plugins=["deepspeed"], zero_stage=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4)
    model, optimizer, loader = kernel.prepare(model, optimizer, loader)  # DeepSpeed takes its batch size from it
    x, _y = next(iter(loader))
    kernel.backward(model(x).sum())
    optimizer.step()
    optimizer.zero_grad()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        kernel.save_state(directory / "ck", asynchronous=True)
    except UsageError as exc:
        print(f"refused: {exc}", flush=True)
    left = sorted(p.name for p in directory.iterdir())
    if left:
        raise SystemExit(f"the refused save left {left}")
    kernel.save_state(directory / "ck")
    print("sync ok", flush=True)
    kernel.end_training()


if __name__ == "__main__":
    main()
