"""Worker for tests/test_ddp_behaviour.py: data sharding, accumulation and collectives on every rank.

    accel launch -n 2 api_checks.py OUT_DIR

Each rank writes ``OUT_DIR/rank<r>.json`` with what it saw; the test compares the ranks' records. Nothing is
asserted here (beyond what is needed to keep going), so a failure shows up as a readable diff in the test.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel
from accel.logging import get_logger


def epoch(kernel: Kernel, n: int, batch_size: int, shuffle: bool = False, epochs: int = 1) -> dict[str, Any]:
    """One pass (or several) over ``range(n)``: this rank's batches and what gather_for_metrics returned.
    A collective runs on every step (gather_for_metrics and reduce), so uneven batch counts would hang."""
    ds = TensorDataset(torch.arange(n))
    loader = kernel.prepare(DataLoader(ds, batch_size=batch_size, shuffle=shuffle))
    record: dict[str, Any] = {"len": len(loader), "epochs": []}
    for _ in range(epochs):
        local: list[list[int]] = []
        gathered: list[int] = []
        steps = 0
        for (x,) in loader:
            local.append(x.tolist())
            gathered.extend(kernel.gather_for_metrics(x).tolist())
            steps = int(kernel.reduce(torch.tensor(1), "sum"))  # a collective on every step
        record["epochs"].append({"local": local, "gathered": gathered, "last_reduce": steps})
    return record


def data_checks(kernel: Kernel) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n, bs in ((10, 3), (7, 4), (8, 2), (10, 4)):
        kernel.even_batches = True
        out[f"even_{n}_{bs}"] = epoch(kernel, n, bs)
        kernel.even_batches = False
        out[f"uneven_{n}_{bs}"] = epoch(kernel, n, bs)
    kernel.even_batches = True
    out["shuffle_10_3"] = epoch(kernel, 10, 3, shuffle=True, epochs=2)
    return out


def accumulate_checks(kernel: Kernel) -> dict[str, Any]:
    """k=4 over 8 micro-batches: count the gradient all-reduces with a DDP comm hook."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    loader = DataLoader(ds, batch_size=2)  # 16 batches: 8 per rank
    model, optimizer, loader = kernel.prepare(model, optimizer, loader)
    calls = [0]

    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none here
        calls[0] += 1
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    steps: list[dict[str, Any]] = []
    for x, y in loader:
        before = calls[0]
        with kernel.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            kernel.backward(loss)
            norm = kernel.clip_grad_norm_(model.parameters(), max_norm=1e6)
            grad = torch.cat([p.grad.flatten() for p in model.parameters()])
            grads = kernel.gather(grad[None])
            steps.append({
                "sync": kernel.sync_gradients,
                "allreduces": calls[0] - before,
                "norm": None if norm is None else float(norm),
                "grads_equal_across_ranks": bool(torch.equal(grads[0], grads[1])),
            })
            optimizer.step()
            optimizer.zero_grad()
    return {"model_type": type(model).__name__, "steps": steps, "total_allreduces": calls[0]}


def collective_checks(kernel: Kernel, out_dir: Path) -> dict[str, Any]:
    r = kernel.process_index
    out: dict[str, Any] = {
        "is_main_process": kernel.is_main_process,
        "is_local_main_process": kernel.is_local_main_process,
        "process_index": r,
        "local_process_index": kernel.local_process_index,
        "num_processes": kernel.num_processes,
        "device": str(kernel.device),
    }
    # gather: rank r holds r+1 rows; nested structures too
    rows = torch.full((r + 1, 2), float(r))
    out["gather_rows"] = kernel.gather(rows).tolist()
    out["gather_nested"] = {k: v.tolist() for k, v in kernel.gather({"a": torch.tensor([r]), "b": torch.tensor([[r, r]])}).items()}
    out["gather_scalar"] = kernel.gather(torch.tensor(float(r))).tolist()
    value = torch.tensor([r + 1.0, 10.0 * (r + 1)])
    out["reduce"] = {red: kernel.reduce(value, red).tolist() for red in ("sum", "mean", "max")}
    out["reduce_input_untouched"] = value.tolist()
    # pad_across_processes: rank r holds r+2 elements
    t = torch.arange(r + 2)
    out["pad"] = kernel.pad_across_processes(t, pad_index=-1).tolist()
    out["pad_first"] = kernel.pad_across_processes(t, pad_index=-1, pad_first=True).tolist()
    out["pad_dim1"] = kernel.pad_across_processes(torch.ones(2, r + 1), dim=1).tolist()
    # broadcast: tensors in place, objects by pickling, from either process
    out["broadcast_tensor"] = kernel.broadcast(torch.tensor([7, 8]) if r == 0 else torch.zeros(2, dtype=torch.long)).tolist()
    out["broadcast_from_1"] = kernel.broadcast(torch.tensor([float(r)]), from_process=1).tolist()
    out["broadcast_object"] = kernel.broadcast({"rank": r, "words": ["x"] * (r + 1)})
    # split_between_processes
    splits: dict[str, Any] = {}
    with kernel.split_between_processes(list(range(5))) as part:
        splits["list5"] = part
    with kernel.split_between_processes(list(range(5)), apply_padding=True) as part:
        splits["list5_padded"] = part
    with kernel.split_between_processes(list(range(4))) as part:
        splits["list4"] = part
    with kernel.split_between_processes({"a": [0, 1, 2, 3, 4], "b": ["p", "q", "r", "s", "t"]}) as part:
        splits["dict"] = part
    with kernel.split_between_processes(torch.arange(5)) as part:
        splits["tensor"] = part.tolist()
    with kernel.split_between_processes(torch.arange(5), apply_padding=True) as part:
        splits["tensor_padded"] = part.tolist()
    out["split"] = splits
    # wait_for_everyone: rank 1 writes a file late; rank 0 must see it after the barrier
    marker = out_dir / "late_marker"
    if r == 1:
        time.sleep(1.0)
        marker.write_text("here")
    kernel.wait_for_everyone()
    out["saw_late_marker"] = marker.exists()
    # main_process_first: the main process runs (and finishes) the block before the others enter it
    order = out_dir / "order.txt"
    with kernel.main_process_first():
        with order.open("a") as f:
            f.write(f"{r} in\n")
        if r == 0:
            time.sleep(1.0)
        with order.open("a") as f:
            f.write(f"{r} out\n")
    kernel.wait_for_everyone()
    # on_main_process decorator
    ran: list[int] = []

    @kernel.on_main_process
    def only_main(x: int) -> int:
        ran.append(x)
        return x * 2

    out["on_main_process"] = {"returned": only_main(21), "ran": ran}
    # accel.logging: per-rank log file
    handler = logging.FileHandler(out_dir / f"log_rank{r}.txt")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = get_logger("accel_ddp_test", log_level="INFO")
    logger.logger.addHandler(handler)
    logger.info("from main only")
    logger.info("from every process", main_process_only=False)
    logger.warning("warning main only")
    handler.flush()
    # kernel.print: once per machine
    kernel.print("KERNEL-PRINT-MARKER")
    return out


def main() -> None:
    out_dir = Path(sys.argv[1])
    kernel = Kernel(gradient_accumulation_steps=4)
    result: dict[str, Any] = {
        "env_world_size": os.environ.get("WORLD_SIZE"),
        "components": [f"{c.name}:{c.role}" for c in kernel.components],
    }
    result["data"] = data_checks(kernel)
    result["accumulate"] = accumulate_checks(kernel)
    result["collectives"] = collective_checks(kernel, out_dir)
    (out_dir / f"rank{kernel.process_index}.json").write_text(json.dumps(result))
    kernel.end_training()


if __name__ == "__main__":
    main()
