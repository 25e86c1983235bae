"""Data sharding: every process sees a disjoint share of each epoch, in step with the others.

Map-style datasets: the batches of the user's batch sampler are dealt round-robin (process ``r`` gets batches
``r, r+N, ...``). With ``even_batches=True`` (default) the last short batch and any missing batches are completed
with samples from the start of the epoch, so every process runs the same number of full batches;
``gather_for_metrics`` drops those duplicates again. With ``even_batches=False`` nothing is duplicated; processes
that run out early get *empty* batches (zero rows) for the remaining steps, so collectives in the loop never hang.

Shuffling: a ``RandomSampler`` without its own generator is replaced by ``SeedableRandomSampler``, seeded
identically on every process (drawn from torch's global generator and broadcast from process 0) and reseeded with
``seed + epoch``, so all processes agree on the permutation and an epoch can be replayed exactly.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

if TYPE_CHECKING:
    from accel.kernel import Kernel


class SeedableRandomSampler(Sampler[int]):
    """A random permutation drawn from ``seed + epoch``; the epoch advances after each full pass."""

    def __init__(self, data_source: Any, seed: int, num_samples: int | None = None, replacement: bool = False):
        self.data_source = data_source
        self.seed = int(seed)
        self.epoch = 0
        self.replacement = replacement
        self._num_samples = num_samples

    @property
    def num_samples(self) -> int:
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        gen = torch.Generator()
        gen.manual_seed(self.seed + self.epoch)
        n = len(self.data_source)
        if self.replacement:
            order = torch.randint(high=n, size=(self.num_samples,), generator=gen).tolist()
        else:
            order = torch.randperm(n, generator=gen).tolist()[: self.num_samples]
        yield from order
        self.epoch += 1

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch = int(state["seed"]), int(state["epoch"])


class BatchSamplerShard(Sampler[list[int]]):
    """This process's batches out of a batch sampler (see the module docstring for the rules)."""

    def __init__(self, batch_sampler: Any, num_processes: int, process_index: int, even_batches: bool = True):
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.even_batches = even_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))

    @property
    def total_batches(self) -> int:
        return len(self.batch_sampler)

    def steps(self) -> int:
        """Batches every process iterates (including padding or empty batches)."""
        n, p = self.total_batches, self.num_processes
        return n // p if self.drop_last else math.ceil(n / p)

    def __len__(self) -> int:
        if self.even_batches:
            return self.steps()
        return len(range(self.process_index, self.total_batches, self.num_processes))

    def __iter__(self) -> Iterator[list[int]]:
        p, r = self.num_processes, self.process_index
        group: list[list[int]] = []
        held: list[list[int]] | None = None  # the last full group, yielded once we know whether it ends the epoch
        first: list[int] = []
        size = self.batch_size
        for batch in self.batch_sampler:
            batch = list(batch)
            size = size or len(batch)
            if len(first) < size * p:
                first.extend(batch)
            group.append(batch)
            if len(group) == p:
                if held is not None:
                    yield held[r]
                held, group = group, []
        if held is not None:
            if not group and self.even_batches and size is not None and len(held[-1]) < size:
                _complete(held, size, p, first)  # the epoch ends on a short batch: fill it up
            yield held[r]
        if not group or self.drop_last:
            return
        if not self.even_batches:
            if r < len(group):
                yield group[r]
            return
        assert size is not None
        _complete(group, size, p, first)
        yield group[r]


def _complete(group: list[list[int]], size: int, p: int, first: list[int]) -> None:
    """Fill the last short batch of ``group`` and add missing batches (up to ``p``) with samples from the start of
    the epoch, in place."""
    filler = _cycle(first)
    while len(group[-1]) < size:
        group[-1].append(next(filler))
    while len(group) < p:
        group.append([next(filler) for _ in range(size)])


def _cycle(items: list[int]) -> Iterator[int]:
    while True:
        yield from items


class IterableDatasetShard(IterableDataset):
    """This process's share of an iterable dataset: of each ``batch_size * N`` samples it takes its own slice.
    ``even_batches`` completes the last group from the first samples seen."""

    def __init__(self, dataset: Any, batch_size: int, num_processes: int, process_index: int,
                 drop_last: bool = False, even_batches: bool = True):
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_processes = num_processes
        self.process_index = process_index
        self.drop_last = drop_last
        self.even_batches = even_batches
        self.seen = -1  # samples of the last full pass (known once it ended)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        span = self.batch_size * self.num_processes
        lo, hi = self.batch_size * self.process_index, self.batch_size * (self.process_index + 1)
        buf: list[Any] = []
        first: list[Any] = []
        seen = 0
        for item in self.dataset:
            seen += 1
            if len(first) < span:
                first.append(item)
            buf.append(item)
            if len(buf) == span:
                yield from buf[lo:hi]
                buf = []
        self.seen = seen
        if buf and not self.drop_last:
            if self.even_batches:
                filler = _cycle_any(first)
                while len(buf) < span:
                    buf.append(next(filler))
            yield from buf[lo:hi]


def _cycle_any(items: list[Any]) -> Iterator[Any]:
    while True:
        yield from items


def send_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor of a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return type(batch)({k: send_to_device(v, device, non_blocking) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(send_to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(send_to_device(v, device, non_blocking) for v in batch)
    if hasattr(batch, "to") and callable(batch.to):
        return batch.to(device)
    return batch


def empty_like_batch(batch: Any) -> Any:
    """The same structure with zero rows (used when a process has run out of data with ``even_batches=False``)."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return type(batch)({k: empty_like_batch(v) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(empty_like_batch(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(empty_like_batch(v) for v in batch)
    return batch


_LOADER_ARGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                "generator", "persistent_workers", "pin_memory_device")


def _loader_kwargs(dl: DataLoader) -> dict[str, Any]:
    kwargs = {name: getattr(dl, name) for name in _LOADER_ARGS if hasattr(dl, name)}
    if dl.num_workers > 0:
        kwargs["prefetch_factor"] = dl.prefetch_factor
    else:
        kwargs.pop("persistent_workers", None)
    return kwargs


class PreparedDataLoader:
    """Iterates this process's shard, moves batches to the device and tells the Kernel when the epoch's last batch
    is out (one batch of look-ahead), so ``accumulate`` syncs and ``gather_for_metrics`` trims duplicates.
    Other attributes are those of the underlying DataLoader."""

    def __init__(self, kernel: Kernel, base: DataLoader, steps: int | None, remainder: int,
                 device_placement: bool = True, shard: Any = None):
        self.kernel = kernel
        self.base = base
        self.steps = steps
        self.remainder = remainder
        self.device_placement = device_placement
        self.shard = shard
        self.end_of_dataloader = False

    def __getattr__(self, name: str) -> Any:
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def __len__(self) -> int:
        return self.steps if self.steps is not None else len(self.base)

    def set_epoch(self, epoch: int) -> None:
        for obj in (self.base.sampler, getattr(self.base.batch_sampler, "batch_sampler", None), self.base.dataset):
            sampler = getattr(obj, "sampler", obj)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
                return

    def _batches(self) -> Iterator[Any]:
        last = None
        count = 0
        for batch in self.base:
            last = batch
            count += 1
            yield batch
        if self.steps is not None and count < self.steps:
            if last is None:
                last = self.base.collate_fn([self.base.dataset[0]])
            empty = empty_like_batch(last)
            for _ in range(self.steps - count):
                yield empty

    def __iter__(self) -> Iterator[Any]:
        state = self.kernel.gradient_state
        state.enter(self)
        self.end_of_dataloader = False
        try:
            it = self._batches()
            try:
                current = next(it)
            except StopIteration:
                return
            while True:
                try:
                    upcoming = next(it)
                except StopIteration:
                    self.end_of_dataloader = True
                    if isinstance(self.shard, IterableDatasetShard) and self.shard.seen >= 0:
                        span = self.shard.batch_size * self.shard.num_processes
                        self.remainder = 0 if self.shard.drop_last else self.shard.seen % span
                    yield self._place(current)
                    return
                yield self._place(current)
                current = upcoming
        finally:
            state.leave(self)

    def _place(self, batch: Any) -> Any:
        return send_to_device(batch, self.kernel.device) if self.device_placement else batch


def shard_dataloader(kernel: Kernel, dataloader: DataLoader, device_placement: bool = True) -> PreparedDataLoader:
    """The kernel's default ``accel_prepare_dataloader``: shard by ``kernel.process_index`` of
    ``kernel.num_processes`` and wrap in a :class:`PreparedDataLoader`. Plugins may call it and wrap the result."""
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"prepare() expects a torch.utils.data.DataLoader, got {type(dataloader).__name__}")
    n, r, even = kernel.num_processes, kernel.process_index, kernel.even_batches
    kwargs = _loader_kwargs(dataloader)
    if isinstance(dataloader.dataset, IterableDataset):
        bs = dataloader.batch_size or 1
        shard = IterableDatasetShard(dataloader.dataset, bs, n, r, dataloader.drop_last, even)
        base = DataLoader(shard, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last, **kwargs)
        return PreparedDataLoader(kernel, base, None, -1, device_placement, shard)
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:  # batch_size=None: the dataset yields whole batches
        return PreparedDataLoader(kernel, dataloader, None, 0, device_placement)
    sampler = getattr(batch_sampler, "sampler", None)
    if isinstance(sampler, RandomSampler) and sampler.generator is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
        seed = kernel.collectives.broadcast_object(seed, 0)
        seeded = SeedableRandomSampler(sampler.data_source, seed, sampler._num_samples, sampler.replacement)
        batch_sampler = BatchSampler(seeded, batch_sampler.batch_size, batch_sampler.drop_last)
    shard_sampler = BatchSamplerShard(batch_sampler, n, r, even)
    base = DataLoader(dataloader.dataset, batch_sampler=shard_sampler, **kwargs)
    steps = shard_sampler.steps()
    try:
        size = len(dataloader.dataset)
    except TypeError:
        size = -1
    span = (shard_sampler.batch_size or 1) * n
    remainder = size % span if (even and not shard_sampler.drop_last and size >= 0) else 0
    return PreparedDataLoader(kernel, base, steps, remainder, device_placement, shard_sampler)
