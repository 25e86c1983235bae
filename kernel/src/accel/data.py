"""Data sharding: every process sees a disjoint share of each epoch, in step with the others.

Map-style datasets: the batches of the user's batch sampler are dealt round-robin (process ``r`` gets batches
``r, r+N, ...``). With ``even_batches=True`` (default) the last short batch and any missing batches are completed
with samples from the start of the epoch, so every process runs the same number of full batches;
``gather_for_metrics`` drops those duplicates again. With ``even_batches=False`` nothing is duplicated; processes
that run out early get *empty* batches (zero rows) for the remaining steps, so collectives in the loop never hang.

Shuffling: a ``RandomSampler`` without its own generator is replaced by ``SeedableRandomSampler``, seeded
identically on every process (drawn from torch's global generator and broadcast from process 0) and reseeded with
``seed + epoch``, so all processes agree on the permutation and an epoch can be replayed exactly.

Resuming: a prepared dataloader knows how many batches of the current pass it handed out and the sampler's (and
generators') state when the pass began (``state_dict``). ``load_state_dict`` makes the next pass replay that
epoch's order and skip the batches already seen, at the batch-sampler level (:class:`SkipBatchSampler`): the
skipped batches' indices are drawn, their samples are never loaded. ``skip_first_batches`` does the same on
request.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

from accel.errors import UsageError

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
    """This process's batches out of a batch sampler (see the module docstring for the rules).

    ``split_batches`` (Accelerate's option): instead of dealing whole batches, every batch is split and process
    ``r`` takes its ``r``-th slice of ``batch_size / N`` indices, so the batch size is the global one. With
    ``even_batches`` the epoch's last short batch is completed from the first batch; without it, the processes
    beyond its end get empty batches (as when dealing)."""

    def __init__(self, batch_sampler: Any, num_processes: int, process_index: int, even_batches: bool = True,
                 split_batches: bool = False):
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.even_batches = even_batches
        self.split_batches = split_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        if split_batches and (not isinstance(self.batch_size, int) or self.batch_size % num_processes):
            raise UsageError(f"split_batches=True needs a batch size that divides by the number of processes "
                             f"({num_processes}); this dataloader's batch size is {self.batch_size}")

    @property
    def total_batches(self) -> int:
        return len(self.batch_sampler)

    def steps(self) -> int:
        """Batches every process iterates (including padding or empty batches)."""
        n, p = self.total_batches, self.num_processes
        if self.split_batches:
            return n
        return n // p if self.drop_last else math.ceil(n / p)

    def __len__(self) -> int:
        if self.even_batches or self.split_batches:
            return self.steps()
        return len(range(self.process_index, self.total_batches, self.num_processes))

    def __iter__(self) -> Iterator[list[int]]:
        if self.num_processes == 1:  # one process: every batch is its own, nothing to group or pad
            return iter(self.batch_sampler)
        return self._slices() if self.split_batches else self._groups()

    def _slices(self) -> Iterator[list[int]]:
        size = self.batch_size
        assert size is not None
        part = size // self.num_processes
        lo, hi = part * self.process_index, part * (self.process_index + 1)
        first: list[int] = []
        for batch in self.batch_sampler:
            batch = list(batch)
            if not first:
                first = batch
            if len(batch) < size and self.even_batches:  # the epoch's last batch: complete it from the first
                filler = _cycle(first)
                while len(batch) < size:
                    batch.append(next(filler))
            if len(batch) > lo:
                yield batch[lo:hi]

    def _groups(self) -> Iterator[list[int]]:
        p, r = self.num_processes, self.process_index
        group: list[list[int]] = []
        first: list[int] = []
        size = self.batch_size
        # A complete group whose last batch is short is held until we know it is the epoch's last (then its short
        # batch is completed below, like that of an incomplete group).
        held: list[list[int]] | None = None
        for batch in self.batch_sampler:
            if held is not None:
                yield held[r]
                held = None
            batch = list(batch)
            size = size or len(batch)
            if len(first) < size * p:
                first.extend(batch)
            group.append(batch)
            if len(group) == p:
                if self.even_batches and p > 1 and len(batch) < size:
                    held = group
                else:
                    yield group[r]
                group = []
        if held is not None:
            group = held
        if not group or self.drop_last:
            return
        if not self.even_batches:
            if r < len(group):
                yield group[r]
            return
        # Complete the last short batch and the missing batches with samples from the start of the epoch.
        assert size is not None
        filler = _cycle(first)
        while len(group[-1]) < size:
            group[-1].append(next(filler))
        while len(group) < p:
            group.append([next(filler) for _ in range(size)])
        yield group[r]


class SkipBatchSampler(Sampler[Any]):
    """The batches (or indices) of ``batch_sampler``, leaving out the first ``skip`` of the *next* pass only.
    Skipped batches are drawn from the inner sampler (so its order and state advance exactly as in a full pass)
    but never loaded."""

    def __init__(self, batch_sampler: Any, skip: int = 0):
        self.batch_sampler = batch_sampler
        self.skip = int(skip)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        return self._iter(skip) if skip else iter(self.batch_sampler)

    def _iter(self, skip: int) -> Iterator[Any]:
        for i, batch in enumerate(self.batch_sampler):
            if i >= skip:
                yield batch


def innermost_sampler(loader: Any) -> Any:
    """The sampler at the bottom of a loader's chain of batch samplers (through shards and skips)."""
    obj = loader.batch_sampler if getattr(loader, "batch_sampler", None) is not None else loader.sampler
    for _ in range(32):
        inner = getattr(obj, "batch_sampler", None)
        if inner is None:
            inner = getattr(obj, "sampler", None)
        if inner is None:
            return obj
        obj = inner
    return obj


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


_END = object()  # end-of-iterator sentinel


def _accelerator_present() -> bool:
    """Whether this process can see any accelerator (GPU, XPU, ...), through torch's device-neutral API."""
    return bool(torch.accelerator.is_available())


def _tensors_on(values: Iterable[Any], device: torch.device) -> bool:
    """Whether every value is a tensor already on ``device``."""
    return all(isinstance(v, torch.Tensor) and v.device == device for v in values)


def send_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor of a (nested) batch to ``device``. A flat list, tuple or dict of tensors already there
    comes back as a new container of the same tensors (tuples as they are), without a no-op ``.to`` per tensor."""
    kind = type(batch)
    if kind is list or kind is tuple:  # the common case first (a default collate's batch)
        if _tensors_on(batch, device):
            return batch if kind is tuple else batch.copy()
        return kind([v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor)
                     else send_to_device(v, device, non_blocking) for v in batch])
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if kind is dict:
        if _tensors_on(batch.values(), device):
            return batch.copy()
        return {k: send_to_device(v, device, non_blocking) for k, v in batch.items()}
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
    ``state_dict``/``load_state_dict`` save and restore the position in the current pass (see the module
    docstring). Other attributes are those of the underlying DataLoader."""

    def __init__(self, kernel: Kernel, base: DataLoader, steps: int | None, remainder: int,
                 device_placement: bool = True, shard: Any = None, skipper: SkipBatchSampler | None = None,
                 device_loader: Callable[[Iterator[Any]], Iterable[Any]] | None = None):
        self.kernel = kernel
        #: A plugin's device loader (see ``shard_dataloader``): it gets each pass's stream of CPU batches and yields
        #: them on the device; the position and end-of-epoch bookkeeping stay here, in the iterating thread.
        self.device_loader = device_loader
        self.base = base
        self.steps = steps
        self.remainder = remainder
        self.device_placement = device_placement
        self.shard = shard
        self.skipper = skipper
        self.end_of_dataloader = False
        self._skip = 0  # batches to leave out at the start of the next pass
        self._position = 0  # batches of the current pass handed out, skipped ones included
        self._open = False  # a pass started (or was restored) and has neither finished nor been abandoned
        self._start: dict[str, Any] = {}  # sampler and generator states when the current pass started

    def __getattr__(self, name: str) -> Any:
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def __len__(self) -> int:
        return self.steps if self.steps is not None else len(self.base)

    def set_epoch(self, epoch: int) -> None:
        for obj in (innermost_sampler(self.base), self.base.dataset):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
                return

    # ---- position -----------------------------------------------------------------------------------------

    def skip_next(self, num_batches: int) -> None:
        """Leave out the first ``num_batches`` batches of the next pass (they are not loaded)."""
        if self._skip:
            raise UsageError(f"this dataloader already starts its next pass at batch {self._skip} (restored by "
                             "load_state); do not call skip_first_batches after load_state, the position is "
                             "restored for you")
        if num_batches < 0:
            raise UsageError(f"skip_first_batches needs a number of batches >= 0, got {num_batches}")
        self._skip = int(num_batches)

    def _snapshot(self) -> dict[str, Any]:
        sampler = innermost_sampler(self.base)
        snap: dict[str, Any] = {}
        if isinstance(sampler, SeedableRandomSampler):
            snap["sampler"] = sampler.state_dict()
        elif isinstance(getattr(sampler, "epoch", None), int):  # DistributedSampler and the like
            snap["sampler"] = {"epoch": sampler.epoch}
        generator = getattr(sampler, "generator", None)
        if isinstance(generator, torch.Generator):
            snap["sampler_generator"] = generator.get_state()
        generator = getattr(self.base, "generator", None)
        if isinstance(generator, torch.Generator):
            snap["loader_generator"] = generator.get_state()
        return snap

    def _apply(self, snap: dict[str, Any]) -> None:
        sampler = innermost_sampler(self.base)
        if "sampler" in snap:
            if isinstance(sampler, SeedableRandomSampler):
                sampler.load_state_dict(snap["sampler"])
            elif hasattr(sampler, "set_epoch"):
                sampler.set_epoch(int(snap["sampler"]["epoch"]))
        if "sampler_generator" in snap:
            sampler.generator.set_state(snap["sampler_generator"])
        if "loader_generator" in snap:
            self.base.generator.set_state(snap["loader_generator"])

    def state_dict(self) -> dict[str, Any]:
        """Where the current pass stands: ``position`` batches out of ``steps`` handed out, and the sampler state
        that reproduces this pass's order. A pass that finished (or handed out its last batch, or was abandoned)
        is recorded as position 0 of the next one."""
        in_pass = self._open and (self.steps is None or self._position < self.steps)
        return {
            "position": self._position if in_pass else 0,
            "start": self._start if in_pass else self._snapshot(),
            "steps": self.steps,
            "num_processes": self.kernel.num_processes,
        }

    def check_state(self, state: dict[str, Any]) -> str | None:
        """Why ``state`` cannot be restored into this dataloader, or None."""
        if int(state.get("position", 0)) == 0:
            return None
        saved_n, saved_steps = state.get("num_processes"), state.get("steps")
        if saved_n != self.kernel.num_processes:
            return (f"the dataloader stopped mid-epoch with {saved_n} process(es); this run has "
                    f"{self.kernel.num_processes}, so the rest of that epoch cannot be replayed: resume with "
                    f"{saved_n} process(es)")
        if saved_steps != self.steps:
            return (f"the dataloader had {saved_steps} batches per process per epoch when saved and has {self.steps} "
                    "now (different dataset, batch size or drop_last)")
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        problem = self.check_state(state)
        if problem:
            raise UsageError(problem)
        self._apply(state["start"])
        self._start = dict(state["start"])
        self._position = self._skip = int(state["position"])
        self._open = self._position > 0

    # ---- iteration ----------------------------------------------------------------------------------------

    def _batches(self, skip: int) -> Iterator[Any]:
        if self.skipper is not None:
            self.skipper.skip = skip
            drop = 0
        else:
            drop = skip  # iterable datasets: nothing to skip by index, the batches are read and dropped
        if skip:
            # Starting a loader's iterator draws a seed from torch's global generator when the loader has no
            # generator of its own. The interrupted pass already drew it before the state was saved.
            rng = torch.get_rng_state()
            it = iter(self.base)
            torch.set_rng_state(rng)
        else:
            it = iter(self.base)
        last = None
        count = 0
        for batch in it:
            if drop:
                drop -= 1
                continue
            last = batch
            count += 1
            yield batch
        if self.steps is not None and count < self.steps - skip:
            if last is None:
                last = self.base.collate_fn([self.base.dataset[0]])
            empty = empty_like_batch(last)
            for _ in range(self.steps - skip - count):
                yield empty

    def __iter__(self) -> Iterator[Any]:
        state = self.kernel.gradient_state
        skip, self._skip = self._skip, 0
        self._start = self._snapshot()
        self._position, self._open = skip, True
        self.end_of_dataloader = False
        state.enter(self)
        ahead: Iterator[Any] | None = None  # a device loader's iterator, which reads batches ahead of this loop
        try:
            # One process, nothing to skip: the base loader's batches as they are (no padding, no dropping).
            it = iter(self.base) if skip == 0 and self.kernel.num_processes == 1 else self._batches(skip)
            if self.device_loader is not None and self.device_placement:
                it = ahead = iter(self.device_loader(it))
            current = next(it, _END)
            if current is _END:
                return
            device = self.kernel.device if self.device_placement and self.device_loader is None else None
            if device is not None and device.type == "cpu" and not _accelerator_present():
                device = None  # no other device a tensor could be on: placement would hand every batch back as it is
            for upcoming in it:  # one batch of look-ahead, so the last batch is known when it is handed out
                self._position += 1
                yield current if device is None else send_to_device(current, device, self.kernel.non_blocking)
                current = upcoming
            self.end_of_dataloader = True
            state.refresh()
            if isinstance(self.shard, IterableDatasetShard) and self.shard.seen >= 0:
                span = self.shard.batch_size * self.shard.num_processes
                self.remainder = 0 if self.shard.drop_last else self.shard.seen % span
            self._position += 1
            yield current if device is None else send_to_device(current, device, self.kernel.non_blocking)
        finally:
            # Finished, or abandoned (the loop broke and the iterator was dropped): either way the next pass
            # starts a fresh epoch, as it would without a checkpoint.
            if ahead is not None:
                close = getattr(ahead, "close", None)
                if close is not None:
                    close()  # stop its reading ahead before looking at the sampler
                if not self.end_of_dataloader:  # abandoned: however far it read, the sampler is where the pass began
                    self._apply(self._start)
            self._open = False
            state.leave(self)


def shard_dataloader(kernel: Kernel, dataloader: DataLoader, device_placement: bool = True,
                     device_loader: Callable[[Iterator[Any]], Iterable[Any]] | None = None) -> PreparedDataLoader:
    """The kernel's default ``accel_prepare_dataloader``: shard by ``kernel.process_index`` of
    ``kernel.num_processes`` and wrap in a :class:`PreparedDataLoader`. Plugins may call it and wrap the result.

    ``device_loader``: for a plugin that moves batches to the device itself, ahead of time in background threads
    (a device runtime's own parallel loader). It is called at the start of each pass with the iterator of that pass's CPU
    batches and returns an iterable of the same batches on the device, in order; the kernel then moves nothing
    itself. Use it rather than wrapping the returned loader: a background thread iterating the prepared loader
    would run the end-of-epoch and position bookkeeping (``accumulate``, ``gather_for_metrics``, ``save_state``)
    ahead of the training loop. When a pass is abandoned (``break``), its iterator is closed (a generator's
    ``finally`` can stop its threads) and the sampler is put back where the pass began, so the next pass does not
    depend on how far the device loader had read ahead."""
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"prepare() expects a torch.utils.data.DataLoader, got {type(dataloader).__name__}")
    n, r, even = kernel.num_processes, kernel.process_index, kernel.even_batches
    split = kernel.split_batches and n > 1
    kwargs = _loader_kwargs(dataloader)
    if isinstance(dataloader.dataset, IterableDataset):
        bs = dataloader.batch_size or 1
        if split:  # each group of `bs` samples is one global batch: a process takes bs / n of them
            if bs % n:
                raise UsageError(f"split_batches=True needs a batch size that divides by the number of processes "
                                 f"({n}); this dataloader's batch size is {bs}")
            bs //= n
        shard = IterableDatasetShard(dataloader.dataset, bs, n, r, dataloader.drop_last, even)
        base = DataLoader(shard, batch_size=bs if dataloader.batch_size else None, drop_last=dataloader.drop_last,
                          **kwargs)
        return PreparedDataLoader(kernel, base, None, -1, device_placement, shard, device_loader=device_loader)
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:  # batch_size=None: the dataset yields whole batches
        if split:
            raise UsageError("split_batches=True needs a DataLoader with a batch_size (this one has batch_size=None: "
                             "its dataset yields whole batches, which accel does not split)")
        skipper = SkipBatchSampler(dataloader.sampler)
        base = DataLoader(dataloader.dataset, batch_size=None, sampler=skipper, **kwargs)
        return PreparedDataLoader(kernel, base, None, 0, device_placement, None, skipper, device_loader)
    sampler = getattr(batch_sampler, "sampler", None)
    if isinstance(sampler, RandomSampler) and sampler.generator is None:
        seed = kernel._data.data_seed
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
        seed = kernel.collectives.broadcast_object(seed, 0)
        seeded = SeedableRandomSampler(sampler.data_source, seed, sampler._num_samples, sampler.replacement)
        batch_sampler = BatchSampler(seeded, batch_sampler.batch_size, batch_sampler.drop_last)
    shard_sampler = BatchSamplerShard(batch_sampler, n, r, even, split)
    skipper = SkipBatchSampler(shard_sampler)
    base = DataLoader(dataloader.dataset, batch_sampler=skipper, **kwargs)
    steps = shard_sampler.steps()
    try:
        size = len(dataloader.dataset)
    except TypeError:
        size = -1
    span = (shard_sampler.batch_size or 1) * (1 if split else n)
    remainder = size % span if (even and not shard_sampler.drop_last and size >= 0) else 0
    return PreparedDataLoader(kernel, base, steps, remainder, device_placement, shard_sampler, skipper, device_loader)


class _DropFirst:
    """An iterable over a loader whose first ``n`` batches of the next pass are read and dropped (iterable
    datasets have no index to skip by)."""

    def __init__(self, loader: Any, n: int):
        self.loader = loader
        self.n = n

    def __len__(self) -> int:
        return max(0, len(self.loader) - self.n)

    def __iter__(self) -> Iterator[Any]:
        n, self.n = self.n, 0
        for i, batch in enumerate(self.loader):
            if i >= n:
                yield batch


def skip_first_batches(dataloader: Any, num_batches: int) -> Any:
    """A dataloader whose next pass starts at batch ``num_batches`` (later passes are whole epochs).

    For a prepared dataloader this is the dataloader itself; the skipped batches' indices are drawn but their
    samples are never loaded. A plain map-style DataLoader gets a new DataLoader over the same dataset and
    sampler. After ``load_state`` there is no need to call it: the position is restored automatically."""
    if isinstance(num_batches, bool) or int(num_batches) < 0:
        raise UsageError(f"skip_first_batches needs a number of batches >= 0, got {num_batches!r}")
    num_batches = int(num_batches)
    if isinstance(dataloader, PreparedDataLoader):
        dataloader.skip_next(num_batches)
        return dataloader
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"skip_first_batches expects a DataLoader, got {type(dataloader).__name__}")
    if isinstance(dataloader.dataset, IterableDataset):
        return _DropFirst(dataloader, num_batches)
    kwargs = _loader_kwargs(dataloader)
    if dataloader.batch_sampler is not None:
        return DataLoader(dataloader.dataset, batch_sampler=SkipBatchSampler(dataloader.batch_sampler, num_batches),
                          **kwargs)
    return DataLoader(dataloader.dataset, batch_size=None, sampler=SkipBatchSampler(dataloader.sampler, num_batches),
                      **kwargs)
