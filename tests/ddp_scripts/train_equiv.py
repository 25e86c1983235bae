"""Worker for tests/test_ddp_behaviour.py: a tiny regression trained with SGD on non-shuffled data.

    python train_equiv.py OUT_DIR --batch_size 2B        # one process, kernel only
    accel launch -n 2 train_equiv.py OUT_DIR --batch_size B
    python -m torch.distributed.run --standalone --nproc_per_node 2 train_equiv.py OUT_DIR --batch_size B

Each rank writes ``OUT_DIR/rank<r>.json``: world size, the plugins in use, the sample indices of every
optimizer step (gathered over all ranks) and the final parameters.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel

SAMPLES = 24


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--batch_size", type=int, required=True)
    args = parser.parse_args()

    torch.manual_seed(0)
    x = torch.randn(SAMPLES, 5)
    y = (x @ torch.randn(5, 1)).tanh() + 0.1 * torch.randn(SAMPLES, 1)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    kernel = Kernel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(x, y, torch.arange(SAMPLES)), batch_size=args.batch_size, shuffle=False)
    model, optimizer, loader = kernel.prepare(model, optimizer, loader)

    steps: list[list[int]] = []
    for xb, yb, idx in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        kernel.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps.append(kernel.gather(idx).tolist())

    params = {k: v.tolist() for k, v in kernel.unwrap_model(model).state_dict().items()}
    record = {
        "rank": kernel.process_index,
        "world": kernel.num_processes,
        "env_world_size": os.environ.get("WORLD_SIZE"),
        "wrapped": type(model).__name__,
        "components": [f"{c.name}:{c.role}" for c in kernel.components],
        "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
        "steps": steps,
        "params": params,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"rank{kernel.process_index}.json").write_text(json.dumps(record))
    kernel.end_training()


if __name__ == "__main__":
    main()
