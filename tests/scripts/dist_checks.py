"""Worker for tests/test_distributed.py: the Kernel API on N real processes, then train_equiv.py's two trainings.

    accel launch -n 2 tests/scripts/dist_checks.py OUT_DIR

Each process writes OUT_DIR/rank{process_index}.json with what it saw; the test asserts on the files.
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
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from train_equiv import train  # tests/scripts/ is sys.path[0]: the script's folder

from accel import Kernel
from accel.logging import get_logger

OUT = Path(sys.argv[1])


def tolist(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return data.tolist()
    if isinstance(data, dict):
        return {k: tolist(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [tolist(v) for v in data]
    return data


class Stream(IterableDataset):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from (torch.tensor(i) for i in range(self.n))


def topology(kernel: Kernel) -> dict[str, Any]:
    return {
        "process_index": kernel.process_index,
        "local_process_index": kernel.local_process_index,
        "num_processes": kernel.num_processes,
        "is_main_process": kernel.is_main_process,
        "is_local_main_process": kernel.is_local_main_process,
        "is_last_process": kernel.is_last_process,
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
        "device": str(kernel.device),
        "components": [f"{c.name}:{c.role}" for c in kernel.components],
    }


def collectives(kernel: Kernel) -> dict[str, Any]:
    r = kernel.process_index
    res: dict[str, Any] = {}
    res["gather_uneven"] = kernel.gather(torch.tensor([r * 10 + i for i in range(r + 1)]))
    res["gather_scalar"] = kernel.gather(torch.tensor(float(r)))
    res["gather_nested"] = kernel.gather({"a": torch.tensor([r]), "b": (torch.full((1, 2), r),)})
    res["gather_object"] = kernel.gather_object([f"r{r}"])
    v = torch.tensor([float(r + 1), float(10 * (r + 1))])
    res["reduce_sum"] = kernel.reduce(v, "sum")
    res["reduce_mean"] = kernel.reduce(v, "mean")
    res["reduce_max"] = kernel.reduce(v, "max")
    res["reduce_sum_scaled"] = kernel.reduce(v, "sum", scale=0.5)
    res["reduce_nested"] = kernel.reduce({"x": torch.tensor([r + 1])}, "sum")
    res["reduce_input_after"] = v
    t = torch.full((r + 1, 2), r + 1)
    res["pad"] = kernel.pad_across_processes(t, dim=0, pad_index=-1)
    res["pad_first"] = kernel.pad_across_processes(torch.arange(r + 1), pad_index=-1, pad_first=True)
    res["pad_dim1"] = kernel.pad_across_processes(torch.ones(1, r + 1), dim=1)
    res["pad_then_gather"] = kernel.gather(kernel.pad_across_processes(torch.arange(r + 1), pad_index=-1))
    res["broadcast_from_1"] = kernel.broadcast(torch.full((3,), float(r + 1)), from_process=1)
    res["broadcast_nested"] = kernel.broadcast({"w": torch.full((2,), float(r)), "n": [torch.tensor(r)]})
    res["broadcast_object"] = kernel.broadcast({"seed": r * 7 + 3, "name": f"rank{r}"})
    with kernel.split_between_processes(list(range(5))) as part:
        res["split_list"] = part
    with kernel.split_between_processes(list(range(5)), apply_padding=True) as part:
        res["split_list_padded"] = part
    with kernel.split_between_processes(torch.arange(6)) as part:
        res["split_tensor"] = part
    with kernel.split_between_processes(torch.arange(5), apply_padding=True) as part:
        res["split_tensor_padded"] = part
    with kernel.split_between_processes({"a": [1, 2, 3, 4], "b": torch.arange(4)}) as part:
        res["split_dict"] = part
    return res


def coordination(kernel: Kernel) -> dict[str, Any]:
    r = kernel.process_index
    res: dict[str, Any] = {}
    marker = OUT / "wait_for_everyone.marker"
    if r == kernel.num_processes - 1:
        time.sleep(1.0)
        marker.write_text("written by the last process")
    kernel.wait_for_everyone()
    res["marker_seen_after_wait"] = marker.exists()

    first = OUT / "main_process_first.marker"
    with kernel.main_process_first():
        if kernel.is_main_process:
            time.sleep(0.5)
            first.write_text("main")
        res["first_marker_seen_inside"] = first.exists()

    @kernel.on_main_process
    def main_only() -> int:
        return 100 + r

    @kernel.on_local_main_process
    def local_main_only() -> int:
        return 200 + r

    @kernel.on_last_process
    def last_only() -> int:
        return 300 + r

    @kernel.on_process(process_index=1)
    def second_only() -> int:
        return 400 + r

    res["on_main_process"] = main_only()
    res["on_local_main_process"] = local_main_only()
    res["on_last_process"] = last_only()
    res["on_process_1"] = second_only()

    kernel.print(f"KERNEL-PRINT from process {r}")

    records: list[str] = []

    class ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = get_logger("dist_checks", log_level="INFO")
    logger.logger.addHandler(ListHandler())
    logger.logger.propagate = False
    logger.info("main only")
    logger.info("every process", main_process_only=False)
    logger.warning("in order", main_process_only=False, in_order=True)
    res["logged"] = records

    kernel.save({"w": torch.full((2,), float(r))}, OUT / f"saved_by_rank{r}.safetensors")
    kernel.wait_for_everyone()
    res["saved_files"] = sorted(p.name for p in OUT.glob("saved_by_rank*.safetensors"))
    return res


def shard(
    kernel: Kernel, n: int, batch_size: int, shuffle: bool = False, iterable: bool = False, epochs: int = 1
) -> dict[str, Any]:
    """Iterate a prepared loader over arange(n); record this process's batches and what gather_for_metrics
    returned (the first epoch's, and what gather_for_metrics returned in each epoch). A collective runs every
    step, so a process that ran out of batches would hang the others."""
    ds: Any = Stream(n) if iterable else TensorDataset(torch.arange(n))
    dl = kernel.prepare(DataLoader(ds, batch_size=batch_size, shuffle=shuffle))
    per_epoch = []
    for _ in range(epochs):
        batches, gathered = [], []
        for batch in dl:
            x = batch if iterable else batch[0]
            batches.append(x.tolist())
            gathered.extend(kernel.gather_for_metrics(x).tolist())
            kernel.reduce(torch.tensor([len(x)]), "sum")  # another collective per step
        per_epoch.append((batches, gathered))
    return {
        "batches": per_epoch[0][0],
        "len": None if iterable else len(dl),
        "gathered": per_epoch[0][1],
        "epochs": [{"batches": b, "gathered": g} for b, g in per_epoch],
    }


def sharding(even: Kernel, uneven: Kernel) -> dict[str, Any]:
    cases = {"10_3": (10, 3), "7_4": (7, 4), "8_2": (8, 2), "12_3": (12, 3), "9_3": (9, 3), "3_4": (3, 4)}
    res: dict[str, Any] = {}
    for name, (n, bs) in cases.items():
        res[f"even_{name}"] = shard(even, n, bs)
        res[f"uneven_{name}"] = shard(uneven, n, bs)
    res["even_shuffle_10_3"] = shard(even, 10, 3, shuffle=True, epochs=2)
    res["even_iterable_10_3"] = shard(even, 10, 3, iterable=True)
    res["uneven_iterable_10_3"] = shard(uneven, 10, 3, iterable=True)
    return res


def uneven_training(uneven: Kernel) -> dict[str, Any]:
    """DDP training with even_batches=False where one process runs out of data first: must finish, in sync."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(9, 2)
    dl = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=3)
    model, opt, dl = uneven.prepare(model, opt, dl)
    rows = []
    for xb, yb in dl:
        rows.append(len(xb))
        uneven.backward(nn.functional.mse_loss(model(xb), yb, reduction="sum"))
        opt.step()
        opt.zero_grad()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {
        "rows": rows,
        "params": params,
        "all_params": uneven.gather(params[None]),
        "finite": bool(torch.isfinite(params).all()),
    }


def accumulation(k: int) -> dict[str, Any]:
    """Count gradient all-reduces with a DDP comm hook while training under accumulate(model)."""
    torch.manual_seed(0)
    kernel = Kernel(gradient_accumulation_steps=k)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    n_micro = 10  # per process: syncs after micro-batches 4, 8 and 10 (end of the loader)
    x = torch.randn(n_micro * 2 * 3, 4)
    dl = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True) * 50), batch_size=3)
    model, opt, dl = kernel.prepare(model, opt, dl)
    calls: list[int] = []
    state = {"step": 0}

    def counting_hook(hook_state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
        calls.append(hook_state["step"])
        tensor = bucket.buffer().div_(kernel.num_processes)
        fut = torch.distributed.all_reduce(tensor, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    model.register_comm_hook(state, counting_hook)
    syncs, norms, grads_equal, opt_steps = [], [], [], 0
    for xb, yb in dl:
        state["step"] += 1
        with kernel.accumulate(model):
            kernel.backward(nn.functional.mse_loss(model(xb), yb))
            syncs.append(kernel.sync_gradients)
            grads = kernel.gather(torch.cat([p.grad.flatten() for p in model.parameters()])[None])
            grads_equal.append(all(torch.equal(g, grads[0]) for g in grads.unbind(0)))
            norm = kernel.clip_grad_norm_(model.parameters(), 0.1)
            after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            norms.append([None if norm is None else float(norm), float(after)])
            if kernel.sync_gradients:
                opt_steps += 1
            opt.step()
            opt.zero_grad()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {
        "model_type": type(model).__name__,
        "hook_calls": calls,
        "syncs": syncs,
        "grads_equal_across_processes": grads_equal,
        "norms": norms,
        "optimizer_steps": opt_steps,
        "params_equal_everywhere": bool(all(torch.equal(p, params) for p in kernel.gather(params[None]).unbind(0))),
    }


def main() -> None:
    kernel = Kernel()
    uneven = Kernel(even_batches=False)
    result: dict[str, Any] = {"topology": topology(kernel)}
    result["collectives"] = collectives(kernel)
    result["coordination"] = coordination(kernel)
    result["sharding"] = sharding(kernel, uneven)
    result["uneven_training"] = uneven_training(uneven)
    result["accumulation"] = accumulation(4)
    # train_equiv.py's trainings on this launch (last, so they cannot change what the checks above saw): the test
    # that two DDP processes end with the one-process parameters needs no launch of its own.
    result["equiv"] = {
        "num_processes": kernel.num_processes,
        "plain": train(Kernel(scheduler_steps="per_optimizer_step"), 8, accumulation=1),
        "accumulate": train(
            Kernel(gradient_accumulation_steps=2, scheduler_steps="per_optimizer_step"), 8, accumulation=2
        ),
    }
    (OUT / f"rank{kernel.process_index}.json").write_text(json.dumps(tolist(result), indent=1))
    kernel.end_training()


if __name__ == "__main__":
    main()
