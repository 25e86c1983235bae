"""Per-step hooks are resolved once (accel.dispatch): same answers as pluggy's dispatch, no pluggy call per step."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pluggy
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel, hookspecs
from accel.dispatch import PluginManager, resolve_each, resolve_firstresult

impl = pluggy.HookimplMarker(hookspecs.PROJECT)


def manager(*plugins: Any) -> pluggy.PluginManager:
    pm = PluginManager()  # accel's: it counts call monitors, so the kernel knows when someone watches
    for i, p in enumerate(plugins):
        pm.register(p, name=f"p{i}")
    return pm


class Answer:
    def __init__(self, value: Any, log: list[str], **opts: Any):
        self.value, self.log = value, log

        @impl(**opts)
        def accel_zero_grad(kernel: Any, optimizer: Any, set_to_none: bool) -> Any:
            self.log.append(f"{self.value}:{set_to_none}")
            return self.value

        self.accel_zero_grad = accel_zero_grad


def test_resolved_call_gives_pluggys_answer_order_and_arguments() -> None:
    for values, opts in [
        ((None, 1, 2), ({}, {}, {})),  # latest registered first; None falls through
        ((3, None, 4), ({"tryfirst": True}, {}, {"trylast": True})),
        ((None, None, None), ({}, {}, {})),
    ]:
        log_a: list[str] = []
        log_b: list[str] = []
        pm_a = manager(*[Answer(v, log_a, **o) for v, o in zip(values, opts, strict=True)])
        pm_b = manager(*[Answer(v, log_b, **o) for v, o in zip(values, opts, strict=True)])
        expected = pm_a.hook.accel_zero_grad(kernel=None, optimizer=None, set_to_none=True)
        fast = resolve_firstresult(pm_b, "accel_zero_grad")
        assert fast is not pm_b.hook.accel_zero_grad  # really resolved, not pluggy's caller
        assert fast(kernel=None, optimizer=None, set_to_none=True) == expected
        assert log_a == log_b and log_a  # same implementations, same order, same arguments


def test_implementation_naming_fewer_arguments_gets_only_those() -> None:
    seen: list[Any] = []

    class Few:
        @impl
        def accel_zero_grad(self, optimizer: Any) -> bool:
            seen.append(optimizer)
            return True

    fast = resolve_firstresult(manager(Few()), "accel_zero_grad")
    assert fast(kernel="k", optimizer="o", set_to_none=False) is True
    assert seen == ["o"]


def test_wrappers_and_monitoring_keep_pluggys_dispatch() -> None:
    class Wrapper:
        @impl(wrapper=True)
        def accel_zero_grad(self, kernel: Any, optimizer: Any, set_to_none: bool) -> Any:
            return (yield)

    pm = manager(Answer(1, []), Wrapper())
    assert resolve_firstresult(pm, "accel_zero_grad") is pm.hook.accel_zero_grad
    pm = manager(Answer(1, []))
    undo = pm.add_hookcall_monitoring(lambda *a: None, lambda *a: None)
    assert resolve_firstresult(pm, "accel_zero_grad") is pm.hook.accel_zero_grad
    undo()
    assert resolve_firstresult(pm, "accel_zero_grad") is not pm.hook.accel_zero_grad


def test_training_steps_make_no_pluggy_call_and_still_train(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path))
    torch.manual_seed(0)
    kernel = Kernel(cpu=True, gradient_accumulation_steps=2)
    model = nn.Linear(4, 2)
    before = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=4)
    model, opt, loader = kernel.prepare(model, opt, loader)
    calls: Counter[str] = Counter()
    undo = kernel.plugins.pm.add_hookcall_monitoring(lambda name, impls, kw: calls.update([name]), lambda *a: None)
    for x, y in loader:
        with kernel.accumulate(model):
            kernel.backward(nn.functional.cross_entropy(model(x), y))
            kernel.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    undo()
    assert calls == Counter()
    assert not torch.equal(model.weight.detach(), before)  # the resolved hooks really stepped


def test_resolved_broadcast_calls_every_implementation_in_pluggys_order() -> None:
    def unscaler(tag: str, log: list[str], **opts: Any) -> Any:
        class Unscale:
            @impl(**opts)
            def accel_unscale_gradients(self, kernel: Any) -> None:
                log.append(tag)

        return Unscale()

    log_a: list[str] = []
    log_b: list[str] = []
    specs = [("a", {"trylast": True}), ("b", {}), ("c", {"tryfirst": True}), ("d", {})]
    pm_a = manager(*[unscaler(t, log_a, **o) for t, o in specs])
    pm_b = manager(*[unscaler(t, log_b, **o) for t, o in specs])
    pm_a.hook.accel_unscale_gradients(kernel=None)
    fast = resolve_each(pm_b, "accel_unscale_gradients")
    assert fast is not pm_b.hook.accel_unscale_gradients
    assert fast(kernel=None) is None
    assert log_b == log_a == ["c", "d", "b", "a"]
