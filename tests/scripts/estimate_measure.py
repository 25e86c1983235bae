"""Worker of tests/test_estimate_memory.py (`accel launch -n 2 --plugin deepspeed estimate_measure.py OUT CASES`).

One process group, then for each case a Kernel of that strategy trains estimate_model.net with AdamW: one full
step (the optimizer state exists from then on), then a second one. At the start of its torch optimizer step (a
step pre-hook), when the model states are alive at once, and right after its backward, it measures, on this process, the bytes of every tensor storage reachable from
Python that did not exist before the model was built (found with gc, plus the gradients, which have no Python object until read; each storage once), and splits them into
parameters (the prepared model's parameters: local shards, DeepSpeed partitions), optimizer state (the torch
optimizer's state and the parameters it steps when they are not the model's: master weights) and the rest
(gradients, buckets). The first case also reports the process's resident-memory high-water mark (VmHWM) minus
its resident memory before the model was built, after a warm-up step of the same strategy on a tiny model. Results go to OUT/<case>.<rank>.json.
"""

from __future__ import annotations

import gc
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel

sys.path.insert(0, str(Path(__file__).parent))
from estimate_model import net  # noqa: E402

OUT = Path(sys.argv[1])
CASES = {
    "ddp": dict(plugins=["ddp"]),
    "ddp_bucket_view": dict(plugins=["ddp"], ddp_gradient_as_bucket_view=True),
    "fsdp": dict(plugins=["fsdp"]),
    "fsdp_bf16": dict(plugins=["fsdp"], mixed_precision="bf16"),
    "zero1": dict(plugins=["deepspeed"], zero_stage=1),
    "zero1_bf16": dict(plugins=["deepspeed"], zero_stage=1, mixed_precision="bf16"),
    "zero2": dict(plugins=["deepspeed"], zero_stage=2),
    "zero3": dict(plugins=["deepspeed"], zero_stage=3),
    "zero2_bf16": dict(plugins=["deepspeed"], zero_stage=2, mixed_precision="bf16"),
    "zero3_bf16": dict(plugins=["deepspeed"], zero_stage=3, mixed_precision="bf16"),
}


def vm(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def storages(tensors: Any) -> dict[int, int]:
    """data_ptr -> bytes of each distinct storage behind these tensors (empty and meta ones left out)."""
    out: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        s = local(t).untyped_storage()
        if s.nbytes():
            out[s.data_ptr()] = s.nbytes()
    return out


def live_storages() -> dict[int, int]:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on every object touches deprecated module attributes
        warnings.simplefilter("ignore")
        return storages(o for o in gc.get_objects() if isinstance(o, torch.Tensor))


def torch_optimizer(opt: Any) -> torch.optim.Optimizer:
    while not type(opt).__module__.startswith("torch.optim") and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


def warm_up(name: str) -> None:
    """One step of the same strategy on a tiny model: what a first step imports and pages in (torch._dynamo for the
    optimizer, BLAS kernels, the strategy's modules) is resident from then on and not part of the model's memory."""
    kernel = Kernel(**CASES[name])
    model = torch.nn.Sequential(torch.nn.Linear(1024, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1024))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(8, 1024), torch.randn(8, 1024))
    model, optimizer, loader = kernel.prepare(model, optimizer, DataLoader(data, batch_size=4))
    for x, y in loader:
        kernel.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    kernel.end_training()
    del model, optimizer, loader, kernel
    gc.collect()


def measure(name: str, first: bool) -> dict[str, Any]:
    if first:
        warm_up(name)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 1024, generator=gen), torch.randn(16, 1024, generator=gen))
    before = live_storages()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
    rss_before = vm("VmRSS")
    kernel = Kernel(**CASES[name])
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = kernel.prepare(model, optimizer, DataLoader(data, batch_size=4))
    inner = torch_optimizer(optimizer)

    def snapshot() -> dict[str, int]:
        """Bytes of what was created since the model was built: parameters, optimizer state and the rest."""
        # gradients made in C++ have no Python object (gc cannot see them) until .grad is read
        grads = [p.grad for p in model.parameters()] + [p.grad for g in inner.param_groups for p in g["params"]]
        everything = {k: v for k, v in {**live_storages(), **storages(grads)}.items() if k not in before}
        param_bytes = storages([getattr(p, "ds_tensor", p) for p in model.parameters()])
        state = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
        masters = [p for g in inner.param_groups for p in g["params"]]
        optim_bytes = {k: v for k, v in storages(state + masters).items() if k not in param_bytes}
        params, optim, total = sum(param_bytes.values()), sum(optim_bytes.values()), sum(everything.values())
        return {"parameters": params, "optimizer": optim, "everything": total, "rest": total - params - optim}

    result: dict[str, Any] = {"world": dist.get_world_size()}
    steps = [0]

    def at_step(*_: Any) -> None:
        """At the start of the second torch optimizer step: the optimizer state exists since the first step and
        the gradients are reduced (DeepSpeed: into the fp32 partitions the step reads)."""
        steps[0] += 1
        if steps[0] == 2:
            result.update(snapshot())

    hook = inner.register_step_pre_hook(at_step)
    batches = iter(loader)
    for step in range(2):
        x, y = next(batches)
        kernel.backward(torch.nn.functional.mse_loss(model(x), y))
        if step == 1:  # what backward leaves before the optimizer step reduces or converts it
            result["rest_after_backward"] = snapshot()["rest"]
        optimizer.step()
        optimizer.zero_grad()
    hook.remove()
    if first:
        result["rss_peak_delta"] = vm("VmHWM") - rss_before
    kernel.end_training()
    gc.collect()
    return result


def main() -> None:
    dist.init_process_group("gloo")
    for i, name in enumerate(sys.argv[2].split(",")):
        result = measure(name, first=i == 0)
        (OUT / f"{name}.{dist.get_rank()}.json").write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    main()
