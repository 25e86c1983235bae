"""Worker for tests/test_accelerate_semantics.py: Accelerate's utilities as accel has them, on N real processes.

    accel launch -n 2 tests/scripts/semantics_checks.py OUT_DIR

Each process writes OUT_DIR/rank{process_index}.json with what it saw; the test asserts on the files (and compares
with what Accelerate 1.15 gives on 2 CPU processes, recorded there).
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any

import datasets
import torch
from torch import nn
from torch.utils.data import DataLoader

from accel import Kernel
from accel.utils import synchronize_rng_states

OUT = Path(sys.argv[1])


def shown(data: Any) -> Any:
    """JSON for what split_between_processes gave: type name and values."""
    if isinstance(data, datasets.Dataset):
        return ["Dataset", data.to_dict()]
    if isinstance(data, torch.Tensor):
        return ["Tensor", data.tolist()]
    if isinstance(data, dict):
        return {k: shown(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [type(data).__name__, list(data)]
    return repr(data)


def split(kernel: Kernel) -> dict[str, Any]:
    cases = {
        "list": lambda: list(range(5)),
        "tuple": lambda: tuple(range(5)),
        "tensor": lambda: torch.arange(5),
        "tensor2d": lambda: torch.arange(10).reshape(5, 2),
        "dict": lambda: {"a": list(range(5)), "b": torch.arange(5)},
        "dataset": lambda: datasets.Dataset.from_dict({"x": list(range(5)), "y": list("abcde")}),
        "one": lambda: [7],
        "dataset_one": lambda: datasets.Dataset.from_dict({"x": [7]}),
    }
    res: dict[str, Any] = {}
    for name, make in cases.items():
        for pad in (False, True):
            inputs = make()
            with kernel.split_between_processes(inputs, apply_padding=pad) as part:
                res[f"{name}_pad{pad}"] = shown(part)
            if isinstance(inputs, dict):
                res[f"{name}_pad{pad}_input_after"] = shown(inputs)
    for name, bad in (("mismatch", {"a": [1, 2], "b": [1]}), ("int", 5)):
        try:
            with kernel.split_between_processes(bad):
                pass
        except Exception as exc:
            res[f"refused_{name}"] = f"{type(exc).__name__}: {exc}"
    return res


def rng(kernel: Kernel) -> dict[str, Any]:
    r = kernel.process_index
    torch.manual_seed(r)
    before = torch.rand(1).item()
    synchronize_rng_states(["torch"])
    after = torch.rand(1).item()
    gen = torch.Generator().manual_seed(100 + r)
    kernel.synchronize_rng_states(["generator"], generator=gen)
    refused = []
    for args in ((["generator"],), (["cuda"],), (["bogus"],)):
        try:
            synchronize_rng_states(*args)
        except Exception as exc:
            refused.append(f"{type(exc).__name__}: {exc}")
    return {"before": before, "after": after, "generator": torch.rand(1, generator=gen).item(), "refused": refused}


def active_dataloader(kernel: Kernel) -> dict[str, Any]:
    loader = kernel.prepare(DataLoader(list(range(8)), batch_size=2))
    state = kernel.gradient_state
    res = {"before": repr(state.active_dataloader), "in_before": state.in_dataloader}
    for _ in loader:
        res["inside_is_loader"] = state.active_dataloader is loader
        res["in_inside"] = state.in_dataloader
    res["after"] = repr(state.active_dataloader)
    return res


def local_grads(model: nn.Module, batches: list[torch.Tensor]) -> list[float]:
    """Gradient of sum(model(b)) over the batches, on this process alone (a copy of the model)."""
    copy = nn.Linear(2, 1)
    copy.load_state_dict({k.removeprefix("module."): v for k, v in model.state_dict().items()})
    for b in batches:
        copy(b).sum().backward()
    return [g for p in copy.parameters() for g in p.grad.flatten().tolist()]  # type: ignore[union-attr]


def trigger_sync(kernel: Kernel, trigger: bool) -> dict[str, Any]:
    """Two forwards under no_sync, the first backward outside any context, the second inside
    trigger_sync_in_backward (or not, as the control)."""
    torch.manual_seed(0)
    model = kernel.prepare(nn.Linear(2, 1))
    r = kernel.process_index
    a, b = torch.full((3, 2), float(r + 1)), torch.full((2, 2), float(10 * r + 3))
    with kernel.no_sync(model):
        loss_a = model(a).sum()
        loss_b = model(b).sum()
    kernel.backward(loss_a)
    if trigger:
        with kernel.trigger_sync_in_backward(model):
            kernel.backward(loss_b)
    else:
        kernel.backward(loss_b)
    grads = [g for p in model.parameters() for g in p.grad.flatten().tolist()]  # type: ignore[union-attr]
    return {"grads": grads, "local": local_grads(model, [a, b])}


class RefusesEmpty(nn.Module):
    """A Linear that cannot take an empty batch (as many real models cannot)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            raise RuntimeError("RefusesEmpty got an empty batch")
        return self.linear(x)


def join(kernel: Kernel, even_argument: bool) -> dict[str, Any]:
    """5 samples, batches of 2 on 2 processes with uneven batches: process 0 gets 2 batches, process 1 one."""
    torch.manual_seed(0)
    model = RefusesEmpty()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    model, optimizer, loader = kernel.prepare(model, optimizer, DataLoader(data, batch_size=2))
    seen, ends = [], []
    context = kernel.join_uneven_inputs([model], even_batches=False) if even_argument else None
    with context or kernel.join_uneven_inputs([model]):
        for batch in loader:
            seen.append(batch.tolist())
            ends.append(kernel.gradient_state.end_of_dataloader)
            kernel.backward(model(batch).sum())
            optimizer.step()
            optimizer.zero_grad()
    after = [len(b) for b in loader]  # outside the context: back to the kernel's own batching
    params = [v for p in model.parameters() for v in p.detach().flatten().tolist()]
    return {"seen": seen, "params": params, "end_of_dataloader": ends, "after": after}


def attributes(kernel: Kernel) -> dict[str, Any]:
    res: dict[str, Any] = {}
    same = pickle.loads(pickle.dumps(kernel))
    res["pickle_is_same_kernel"] = same is kernel
    return res


def main() -> None:
    kernel = Kernel()
    result: dict[str, Any] = {"split": split(kernel), "rng": rng(kernel), "active": active_dataloader(kernel)}
    result["trigger"] = trigger_sync(kernel, True)
    result["no_trigger"] = trigger_sync(kernel, False)
    result["join_argument"] = join(kernel, True)
    result["join_kernel"] = join(Kernel(even_batches=False), False)
    result["attributes"] = attributes(kernel)
    (OUT / f"rank{kernel.process_index}.json").write_text(json.dumps(result, indent=1))
    kernel.end_training()


if __name__ == "__main__":
    main()
