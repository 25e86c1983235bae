"""Hook calls per training step and their cost: counts every pluggy hook call during steady-state steps of
the Kernel loop (pluggy's add_hookcall_monitoring) and times a hook call against a plain function call."""

from __future__ import annotations

import json
import time
from collections import Counter

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel


def main() -> None:
    torch.manual_seed(0)
    kernel = Kernel(cpu=True)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,))), batch_size=8)
    model, opt, loader = kernel.prepare(model, opt, loader)
    calls: Counter[str] = Counter()
    undo = kernel.plugins.pm.add_hookcall_monitoring(lambda name, impls, kw: calls.update([name]), lambda *a: None)
    steps = 0
    for x, y in loader:
        with kernel.accumulate(model):
            kernel.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        steps += 1
    undo()
    hook = kernel.plugins.pm.hook.accel_zero_grad
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        hook(kernel=kernel, optimizer=opt.optimizer, set_to_none=True)
    per_hook = (time.perf_counter() - start) / n
    start = time.perf_counter()
    for _ in range(n):
        opt.optimizer.zero_grad(set_to_none=True)
    per_plain = (time.perf_counter() - start) / n
    print(json.dumps({"calls_per_step": {k: v / steps for k, v in sorted(calls.items())},
                      "zero_grad_via_hook_us": per_hook * 1e6, "zero_grad_direct_us": per_plain * 1e6}))


if __name__ == "__main__":
    main()
