"""The per-step shortcuts the kernel takes on one CPU process behave like the general paths they skip."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pluggy
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import accel.data
from accel import Kernel, hookspecs

hookimpl = pluggy.HookimplMarker(hookspecs.PROJECT)


def _loader() -> DataLoader:
    data = TensorDataset(torch.arange(20.0).reshape(10, 2), torch.arange(10))
    return DataLoader(data, batch_size=3)


def test_cpu_batches_without_an_accelerator_are_handed_out_as_loaded(monkeypatch) -> None:
    kernel = Kernel(cpu=True)
    shortcut = [[x.clone(), y.clone()] for x, y in kernel.prepare(_loader())]
    monkeypatch.setattr(accel.data, "_accelerator_present", lambda: True)  # as on a GPU host: every batch is checked
    checked = [[x.clone(), y.clone()] for x, y in kernel.prepare(_loader())]
    assert len(shortcut) == len(checked) == 4
    for (a, b), (c, d) in zip(shortcut, checked, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d) and a.device == c.device == kernel.device


class RecordingNoSync:
    """A strategy whose no_sync records when it is entered and left."""

    def __init__(self) -> None:
        self.log: list[str] = []

    @hookimpl
    def accel_no_sync(self, kernel: Any, model: torch.nn.Module) -> Any:
        @contextlib.contextmanager
        def context() -> Iterator[None]:
            self.log.append("enter")
            yield
            self.log.append("exit")

        return context()


def test_accumulate_reuses_its_context_only_when_that_is_safe() -> None:
    kernel = Kernel(cpu=True, gradient_accumulation_steps=2)
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    first = kernel.accumulate(a)
    assert kernel.accumulate(a) is first  # same models, not in use: the same context object
    assert kernel.accumulate(b) is not first
    assert kernel.accumulate(a, b) is not kernel.accumulate(a)
    syncs = []
    for _ in range(6):
        with kernel.accumulate(a):
            syncs.append(kernel.sync_gradients)
    assert syncs == [False, True] * 3


def test_a_context_holding_no_sync_open_is_not_handed_out_again() -> None:
    kernel = Kernel(cpu=True, gradient_accumulation_steps=3)
    strategy = RecordingNoSync()
    kernel.plugins.pm.register(strategy, name="recording-no-sync")
    model = kernel.prepare(torch.nn.Linear(2, 2))  # prepare resolves the per-step hooks again
    with kernel.accumulate(model):  # step 1 of 3: no sync, no_sync entered and held
        outer = kernel._accumulating
        assert strategy.log == ["enter"]
        inner = kernel.accumulate(model)
        assert inner is not outer  # the open one keeps its stack
        with inner:  # step 2 of 3: no sync either
            assert strategy.log == ["enter", "enter"]
        assert strategy.log == ["enter", "enter", "exit"]
    assert strategy.log == ["enter", "enter", "exit", "exit"]
    with kernel.accumulate(model):  # step 3 of 3: sync, nothing entered
        assert kernel.sync_gradients
    assert strategy.log.count("enter") == strategy.log.count("exit") == 2


class FallThroughBackward:
    """A plugin that answers ``accel_backward`` with None: the kernel's default then runs through the hook."""

    @hookimpl
    def accel_backward(self, kernel: Any, loss: torch.Tensor) -> None:
        return None


@pytest.mark.parametrize("path", ["plain", "hook"])
def test_backward_keywords_reach_tensor_backward(path: str) -> None:
    kernel = Kernel(cpu=True)
    if path == "hook":
        kernel.plugins.pm.register(FallThroughBackward(), name="fall-through")
    model = kernel.prepare(torch.nn.Linear(3, 1))
    assert kernel._hot.plain_backward is (path == "plain")
    x = torch.randn(4, 3)

    loss = model(x).square().mean()
    kernel.backward(loss, retain_graph=True)
    once = model.weight.grad.clone()
    kernel.backward(loss)  # the graph was kept: a second backward adds the same gradient again
    torch.testing.assert_close(model.weight.grad, 2 * once)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        kernel.backward(loss)  # ... and was not kept this time

    model.zero_grad(set_to_none=True)
    kernel.backward(model(x).square().mean(), inputs=[model.bias])
    assert model.weight.grad is None and model.bias.grad is not None


def train(kernel: Kernel) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model, opt, loader = kernel.prepare(net, opt, _loader())
    for _ in range(2):
        for x, y in loader:
            with kernel.accumulate(model):
                kernel.backward((model(x).squeeze(1) - y.float()).square().mean())
                kernel.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def test_kernel_made_default_calls_train_like_the_hooks() -> None:
    """With no plugin the kernel makes its defaults' calls itself; with pluggy's call monitoring on, every step
    goes through the hooks instead. Same training, bit for bit, and the monitor saw the hooks being called."""
    plain = Kernel(cpu=True, gradient_accumulation_steps=2)
    direct = train(plain)
    assert plain._hot.plain_backward and plain._hot.plain_optimizer and plain._hot.plain_clip

    watched = Kernel(cpu=True, gradient_accumulation_steps=2)
    calls: list[str] = []
    watched.plugins.pm.add_hookcall_monitoring(lambda name, impls, kwargs: calls.append(name), lambda *a: None)
    through_hooks = train(watched)
    assert not watched._hot.plain_backward and not watched._hot.plain_optimizer and not watched._hot.plain_clip
    # 10 samples in batches of 3: 4 micro-batches an epoch, the last one syncs, so 2 optimizer steps an epoch
    assert calls.count("accel_backward") == 8
    assert calls.count("accel_optimizer_step") == calls.count("accel_zero_grad") == 4
    assert calls.count("accel_clip_grad_norm") == 4
    for a, b in zip(direct, through_hooks, strict=True):
        assert torch.equal(a, b)


def test_end_of_dataloader_follows_the_innermost_loader() -> None:
    kernel = Kernel(cpu=True)
    outer, inner = kernel.prepare(_loader()), kernel.prepare(DataLoader(TensorDataset(torch.arange(4.0)), batch_size=2))
    state = kernel.gradient_state
    seen = []
    for _ in outer:
        during = [state.end_of_dataloader for _ in inner]
        seen.append((during, state.end_of_dataloader))
    assert seen == [([False, True], False)] * 3 + [([False, True], True)]
    assert state.end_of_dataloader is False  # no loader is being iterated


def test_prepared_zero_grad_keeps_set_to_none_on_the_direct_path() -> None:
    kernel = Kernel(cpu=True)
    net = torch.nn.Linear(2, 1)
    model, opt = kernel.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert kernel._hot.plain_optimizer
    kernel.backward(model(torch.ones(1, 2)).sum())
    opt.zero_grad(set_to_none=False)
    assert torch.equal(net.weight.grad, torch.zeros_like(net.weight))
    opt.zero_grad()
    assert net.weight.grad is None
