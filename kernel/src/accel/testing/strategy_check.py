"""Worker of :class:`accel.testing.conformance.StrategyConformance`'s training test.

``accel launch -n N [--plugin NAME] -m accel.testing.strategy_check OUT_DIR``: trains a linear model on a fixed
data set with gradient accumulation, exercises the collectives, and writes ``OUT_DIR/process<i>.json``. Built so
that the result does not depend on how batches are spread over processes: one optimizer step per epoch whose
gradient is the full-batch gradient, so the final weights equal :func:`reference_weights`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

SAMPLES = 32
FEATURES = 4
EPOCHS = 3
LR = 0.1
ACCUMULATION = 2


def make_data() -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return x, y


def make_model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


def reference_weights() -> list[float]:
    """Full-batch gradient descent on one process, without accel: what every strategy must reproduce."""
    import torch

    x, y = make_data()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(EPOCHS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [float(v) for v in torch.cat([p.detach().flatten() for p in model.parameters()])]


def main(argv: list[str]) -> int:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from accel import Kernel

    out = argv[0]
    kernel = Kernel(gradient_accumulation_steps=ACCUMULATION)
    n = kernel.num_processes
    if SAMPLES % (n * ACCUMULATION):
        raise SystemExit(f"strategy_check needs a process count dividing {SAMPLES // ACCUMULATION}, got {n}")
    x, y = make_data()
    # ACCUMULATION micro-batches per process per epoch: each optimizer step sees every sample once.
    loader = DataLoader(TensorDataset(x, y), batch_size=SAMPLES // (n * ACCUMULATION))
    evaluation = DataLoader(TensorDataset(x, y), batch_size=5)  # uneven: tests even_batches + gather_for_metrics
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader, evaluation = kernel.prepare(model, optimizer, loader, evaluation)
    steps = 0
    for _ in range(EPOCHS):
        for xb, yb in loader:
            with kernel.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                kernel.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                steps += int(kernel.sync_gradients)
    targets = []
    model.eval()
    with torch.no_grad():
        for xb, yb in evaluation:
            model(xb)
            targets.append(kernel.gather_for_metrics(yb).cpu())
    unwrapped = kernel.unwrap_model(model)
    weights = torch.cat([p.detach().float().flatten().cpu() for p in unwrapped.parameters()])
    rank = torch.tensor([float(kernel.process_index + 1)], device=kernel.device)
    shared = torch.full((2,), float(kernel.process_index), device=kernel.device)
    report = {
        "process_index": kernel.process_index,
        "num_processes": n,
        "local_process_index": kernel.local_process_index,
        "is_main_process": kernel.is_main_process,
        "device": str(kernel.device),
        "optimizer_steps": steps,
        "weights": [float(v) for v in weights],
        "unwrapped_type": type(unwrapped).__name__,
        "all_weights": [list(map(float, w)) for w in kernel.gather_object([weights.tolist()])],
        "gathered_targets": sorted(float(v) for v in torch.cat(targets).flatten()),
        "reduce_sum": float(kernel.reduce(rank, "sum").item()),
        "gather_ranks": [float(v) for v in kernel.gather(rank).cpu()],
        "broadcast": [float(v) for v in kernel.broadcast(shared, from_process=0).cpu()],
        "state_dict_keys": sorted(kernel.get_state_dict(model).keys()) if kernel.is_main_process else [],
    }
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"process{kernel.process_index}.json"), "w", encoding="utf-8") as fh:
        json.dump(report, fh)
    kernel.wait_for_everyone()
    kernel.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
