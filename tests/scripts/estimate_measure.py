"""Worker of tests/test_estimate_memory.py (`accel launch -n 2 --plugin deepspeed estimate_measure.py OUT CASES`).

One process group, then for each case a Kernel of that strategy trains estimate_model.net with AdamW: one full
step (the optimizer state exists from then on), then forward and backward of a second step, where the model
states are all alive at once. There it measures, on this process, the bytes of every tensor storage reachable from
Python that did not exist before the model was built (found with gc, each storage once), and splits them into
parameters (the prepared model's parameters: local shards, DeepSpeed partitions), optimizer state (the torch
optimizer's state and the parameters it steps when they are not the model's: master weights) and the rest
(gradients, buckets). The first case also reports the process's resident-memory high-water mark (VmHWM) minus
its resident memory before the model was built. Results go to OUT/<case>.<rank>.json.
"""

from __future__ import annotations

import gc
import json
import sys
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
    "zero2": dict(plugins=["deepspeed"], zero_stage=2),
    "zero3": dict(plugins=["deepspeed"], zero_stage=3),
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
    return storages(o for o in gc.get_objects() if isinstance(o, torch.Tensor))


def torch_optimizer(opt: Any) -> torch.optim.Optimizer:
    while not type(opt).__module__.startswith("torch.optim") and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


def measure(name: str, first: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 1024, generator=gen), torch.randn(16, 1024, generator=gen))
    before = live_storages()
    rss_before = vm("VmRSS")
    kernel = Kernel(**CASES[name])
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = kernel.prepare(model, optimizer, DataLoader(data, batch_size=4))
    batches = iter(loader)
    for step in range(2):
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        kernel.backward(loss)
        if step == 1:
            break
        optimizer.step()
        optimizer.zero_grad()
    del x, y, loss
    everything = {k: v for k, v in live_storages().items() if k not in before}
    params = [getattr(p, "ds_tensor", p) for p in model.parameters()]
    param_bytes = storages(params)
    inner = torch_optimizer(optimizer)
    state = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    masters = [p for g in inner.param_groups for p in g["params"]]
    optim_bytes = {k: v for k, v in storages(state + masters).items() if k not in param_bytes}
    result = {"parameters": sum(param_bytes.values()), "optimizer": sum(optim_bytes.values()),
              "everything": sum(everything.values()), "world": dist.get_world_size()}
    result["rest"] = result["everything"] - result["parameters"] - result["optimizer"]
    if first:
        result["rss_peak_delta"] = vm("VmHWM") - rss_before
    optimizer.step()
    optimizer.zero_grad()
    kernel.end_training()
    del model, optimizer, loader, batches, kernel, inner, state, masters, params
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
