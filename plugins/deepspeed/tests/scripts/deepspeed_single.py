"""Worker script of plugins/deepspeed/tests/test_deepspeed.py, started as a plain `python` process (no launcher variables).

ZeRO-3 with ``zero3_init_flag``: the model is built inside ``kernel.model_init_context()`` (DeepSpeed's zero.Init),
so its parameters are partitioned from creation. It trains a few steps with gradient accumulation 2, through
``kernel.backward(loss, retain_graph=True)``; the same loop then runs on the kernel alone (no plugin). Writes
OUT/result.json and OUT/zero_init.safetensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel, UsageError

OUT = Path(sys.argv[1])


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def run(kernel: Kernel) -> dict:
    with kernel.model_init_context():
        model = net()
    built_partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(3)
    loader = DataLoader(
        TensorDataset(torch.randn(24, 8, generator=gen), torch.randn(24, 1, generator=gen)), batch_size=4
    )
    model, optimizer, loader = kernel.prepare(model, optimizer, loader)
    first = kernel.get_state_dict(model)
    losses = []
    for x, y in loader:
        with kernel.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            kernel.backward(loss, retain_graph=True)  # the engine takes retain_graph: it must reach it
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    state = kernel.get_state_dict(model)
    refused = None
    try:  # a keyword the engine's backward does not take: one clear error, nothing run
        kernel.backward(nn.functional.mse_loss(model(x), y), inputs=list(model.parameters()))
    except UsageError as err:
        refused = str(err)
    kernel.end_training()
    return {
        "partitioned": built_partitioned,
        "losses": losses,
        "first": {k: v.tolist() for k, v in first.items()},
        "state": state,
        "inputs_refused": refused,
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    ds = run(Kernel(plugins=["deepspeed"], zero_stage=3, zero3_init_flag=True, gradient_accumulation_steps=2))
    plain = run(Kernel(gradient_accumulation_steps=2))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in ds.pop("state").items()}, OUT / "zero_init.safetensors")
    save_file({k: v.contiguous() for k, v in plain.pop("state").items()}, OUT / "plain.safetensors")
    (OUT / "result.json").write_text(json.dumps({"deepspeed": ds, "plain": plain}))


if __name__ == "__main__":
    main()
