"""Big-model inference: build the model without memory, then stream a checkpoint into it under a memory budget,
leaving what does not fit on disk (accel-plugin-bigmodel, Accelerate's ``init_empty_weights`` and
``load_checkpoint_and_dispatch``).

    python examples/big_model_inference.py --workdir runs/big

It first saves a small model as a sharded safetensors checkpoint (``Kernel.save_model``; ``save_pretrained`` writes
the same layout), then loads it with 400 KB of CPU memory: the first blocks stay in memory, the rest is read from
disk at each forward. With an accelerator give it a budget too: ``max_memory={0: "20GiB", "cpu": "60GiB"}``.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

from accel import Kernel
from accel.utils import init_empty_weights, load_checkpoint_and_dispatch


class Block(nn.Module):  # a residual block: kept on one device (no_split_module_classes)
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self, width: int = 64, depth: int = 8) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    checkpoint = os.path.join(args.workdir, "checkpoint")

    torch.manual_seed(0)
    kernel = Kernel()
    trained = kernel.prepare(Model()).eval()
    kernel.save_model(trained, checkpoint, max_shard_size="300KB")  # 1.1 MB of weights in shards

    with init_empty_weights():  # parameters on the meta device: no memory, no initialisation
        model = Model()
    model = load_checkpoint_and_dispatch(
        model,
        checkpoint,
        device_map="auto",
        max_memory={"cpu": "400KB"},
        no_split_module_classes=["Block"],
        offload_folder=os.path.join(args.workdir, "offload"),
    )
    places = list(model.hf_device_map.values())
    print(f"device map: {places.count('cpu')} parts in CPU memory, {places.count('disk')} on disk")
    x = torch.randn(4, 64)
    with torch.no_grad():
        same = torch.equal(model(x), trained(x))
    print(f"same output as the fully loaded model: {same}")


if __name__ == "__main__":
    main()
