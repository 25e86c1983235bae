"""N-D parallelism: tensor parallel x sharded data parallel on one DeviceMesh (accel-plugin-parallel).

    accel launch -n 2 --plugin parallel --parallelism_config_tp_size 2 examples/nd_parallel.py
    accel launch -n 4 --plugin parallel --parallelism_config_dp_shard_size 2 --parallelism_config_tp_size 2 \\
        examples/nd_parallel.py

The model says how its layers split (``_tp_plan``, where Hugging Face models keep theirs): ``fc1`` by columns,
``fc2`` by rows, so the pair needs one all-reduce. Processes of one tensor-parallel group read the same batches:
``prepare`` shards the data over the data-parallel dimensions only (``kernel.data_parallel_size``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel


class MLP(nn.Module):
    _tp_plan = {"fc1": "colwise", "fc2": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def main() -> None:
    kernel = Kernel()  # the mesh sizes come from accel launch (or Kernel(parallelism_config=ParallelismConfig(...)))
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(128, 16, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, (x[:, :4].argmax(dim=1))), batch_size=8)
    model, optimizer, loader = kernel.prepare(model, optimizer, loader)

    for epoch in range(2):
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(xb), yb)
            kernel.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        kernel.print(f"epoch {epoch}: loss {kernel.reduce(loss.detach(), 'mean').item():.4f}")
    tp = kernel.num_processes // kernel.data_parallel_size
    kernel.print(f"{kernel.num_processes} processes: {kernel.data_parallel_size} data shard(s) x tensor parallel {tp}")
    kernel.end_training()


if __name__ == "__main__":
    main()
