"""The per-step shortcuts the kernel takes on one CPU process behave like the general paths they skip."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pluggy
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
    for (a, b), (c, d) in zip(shortcut, checked):
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
