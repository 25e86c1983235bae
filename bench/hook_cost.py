"""Hook calls per training step and their cost.

Counts (1) pluggy dispatches during steady-state steps of the Kernel loop (pluggy's add_hookcall_monitoring,
switched on after prepare) and (2) hook implementations run per step (each implementation of the per-step hooks
wrapped with a counter), then times one hook call three ways: through pluggy, through the kernel's resolved
dispatch (accel/dispatch.py) and as a plain method call.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel
from accel.dispatch import HOT_BROADCAST_HOOKS, HOT_HOOKS, HotHooks


def per_call_us(fn: Callable[[], Any], n: int = 20000, rounds: int = 7) -> float:
    best = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - start) / n * 1e6)
    return sorted(best)[len(best) // 2]


def main() -> None:
    torch.manual_seed(0)
    kernel = Kernel(cpu=True, gradient_accumulation_steps=2)
    pm = kernel.plugins.pm
    implementations: Counter[str] = Counter()
    for name in HOT_HOOKS + HOT_BROADCAST_HOOKS:  # count implementation runs: wrap each implementation's function
        for impl in getattr(pm.hook, name).get_hookimpls():

            def counted(*args: Any, _f: Callable[..., Any] = impl.function, _n: str = name, **kwargs: Any) -> Any:
                implementations[_n] += 1
                return _f(*args, **kwargs)

            impl.function = counted
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,))), batch_size=8)
    model, opt, loader = kernel.prepare(model, opt, loader)
    dispatches: Counter[str] = Counter()
    undo = pm.add_hookcall_monitoring(lambda name, impls, kw: dispatches.update([name]), lambda *a: None)
    steps = 0
    for _ in range(4):
        for x, y in loader:
            with kernel.accumulate(model):
                kernel.backward(nn.functional.cross_entropy(model(x), y))
                kernel.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            steps += 1
    undo()
    fresh = Kernel(cpu=True)
    hot = HotHooks(fresh.plugins.pm)
    inner = torch.optim.SGD(nn.Linear(8, 2).parameters(), lr=0.1)
    via_pluggy = per_call_us(
        lambda: fresh.plugins.pm.hook.accel_zero_grad(kernel=fresh, optimizer=inner, set_to_none=True)
    )
    via_resolved = per_call_us(lambda: hot.zero_grad(kernel=fresh, optimizer=inner, set_to_none=True))
    direct = per_call_us(lambda: inner.zero_grad(set_to_none=True))
    print(
        json.dumps(
            {
                "steps": steps,
                "gradient_accumulation_steps": 2,
                "pluggy_dispatches_per_step": {k: v / steps for k, v in sorted(dispatches.items())},
                "implementations_per_step": {k: v / steps for k, v in sorted(implementations.items())},
                "zero_grad_via_pluggy_us": via_pluggy,
                "zero_grad_resolved_us": via_resolved,
                "zero_grad_direct_us": direct,
            }
        )
    )


if __name__ == "__main__":
    main()
