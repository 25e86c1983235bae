"""`accel.data.shard_dataloader(..., device_loader=...)`: a plugin moves each pass's batches to the device ahead of
time in a background thread (as torch_xla's MpDeviceLoader does), while the kernel's bookkeeping (end of epoch for
`accumulate`/`gather_for_metrics`, the position saved by `save_state`) follows the training loop, not the thread.
Shown with a real reading-ahead thread; the XLA plugin's use of it runs in .venv-xla (plugins/xla/tests)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from accel import Component, hookimpl
from accel.data import shard_dataloader
from accel.testing import make_kernel

DONE = object()


class ReadAhead:
    """A device loader that reads the whole pass ahead in a thread, and marks what it hands out."""

    def __init__(self) -> None:
        self.read = 0
        self.closed = 0
        self.threads: list[threading.Thread] = []

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        out: queue.Queue[Any] = queue.Queue()
        stop = threading.Event()

        def work() -> None:
            for batch in batches:
                if stop.is_set():
                    break
                self.read += 1
                out.put(batch)
            out.put(DONE)

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        self.threads.append(thread)
        try:
            while (item := out.get()) is not DONE:
                x, y = item
                yield x + 1000, y  # "moved to the device"
        finally:
            stop.set()
            while thread.is_alive():  # let the worker see `stop` (it may wait on nothing: the queue is unbounded)
                thread.join(0.05)
            self.closed += 1


class DeviceLoaderStrategy(Component):
    role = "strategy"

    def __init__(self, loader: ReadAhead) -> None:
        self.loader = loader

    @hookimpl
    def accel_prepare_dataloader(self, kernel: Any, dataloader: Any) -> Any:
        return shard_dataloader(kernel, dataloader, device_loader=self.loader)


class Plugin:
    def __init__(self, loader: ReadAhead) -> None:
        self.component = DeviceLoaderStrategy(loader)

    @hookimpl
    def accel_activate(self, settings: Any) -> Component:
        return self.component


def setup(n: int = 40, batch_size: int = 4) -> tuple[Any, Any, ReadAhead]:
    reader = ReadAhead()
    kernel = make_kernel([], [("readahead", Plugin(reader))], cpu=True)
    data = TensorDataset(torch.arange(float(n)).unsqueeze(1), torch.arange(n))
    return kernel, kernel.prepare(DataLoader(data, batch_size=batch_size, shuffle=True)), reader


def test_bookkeeping_follows_the_loop_not_the_thread() -> None:
    kernel, loader, reader = setup()
    try:
        seen, ends, positions = [], [], []
        for step, (x, y) in enumerate(loader):
            if step == 0:
                reader.threads[-1].join(5)  # the thread has read the whole pass by now
                assert reader.read == len(loader) == 10
            assert bool((x >= 1000).all()), "the batches come from the device loader, not moved again"
            ends.append(kernel.gradient_state.end_of_dataloader)
            positions.append(loader.state_dict()["position"])
            seen.append(y)
        assert ends == [False] * 9 + [True]
        assert positions == list(range(1, 10)) + [0]  # the last batch handed out: the next pass is a new epoch
        assert sorted(torch.cat(seen).tolist()) == list(range(40)) and reader.closed == 1
    finally:
        kernel.end_training()


def test_an_abandoned_pass_is_replayed_however_far_the_thread_read() -> None:
    kernel, loader, reader = setup()
    try:
        first = []
        for step, (_, y) in enumerate(loader):
            reader.threads[-1].join(5)
            first.append(y)
            if step == 2:
                break
        assert reader.read == 10 and reader.closed == 1  # read to the end of the epoch, closed on break
        again = [y for _, y in loader]
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=False)), (
            "the next pass must start the same epoch again"
        )
        third = [y for _, y in loader]
        assert not all(torch.equal(a, b) for a, b in zip(again, third, strict=True)), (
            "a finished pass goes on to the next epoch"
        )
    finally:
        kernel.end_training()


def test_save_state_mid_pass_records_the_loops_position(tmp_path) -> None:
    kernel, loader, reader = setup()
    try:
        it = iter(loader)
        got = [next(it)[1] for _ in range(3)]
        reader.threads[-1].join(5)
        assert loader.state_dict()["position"] == 3
        kernel.save_state(tmp_path / "ckpt")
        rest = [y for _, y in it]
    finally:
        kernel.end_training()
    kernel, loader, reader = setup()
    try:
        kernel.load_state(tmp_path / "ckpt")
        resumed = [y for _, y in loader]
        assert len(resumed) == 7 and all(torch.equal(a, b) for a, b in zip(resumed, rest, strict=True))
        assert len(got) == 3
    finally:
        kernel.end_training()
