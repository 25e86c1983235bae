"""Samplers and dataset wrappers that shard data between processes and make an epoch replayable; used by the
prepared dataloader (:mod:`accel.data`, which re-exports every public name of this module).

:class:`SeedableRandomSampler` draws the same permutation on every process from ``seed + epoch``;
:class:`BatchSamplerShard` deals a batch sampler's batches round-robin (completing the last ones with
``even_batches``); :class:`SkipBatchSampler` skips batches already seen on resume without loading their samples;
:class:`WorkerSeededDataset` seeds each batch's loading in worker processes; :class:`IterableDatasetShard` slices
a stream; :class:`Padding`/:class:`PaddingCollate` give empty batches to processes that ran out of data.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import operator
import random
import struct
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, Sampler

from accel.errors import UsageError

_END = object()  # end-of-iterator sentinel


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

    def __init__(
        self,
        batch_sampler: Any,
        num_processes: int,
        process_index: int,
        even_batches: bool = True,
        split_batches: bool = False,
    ):
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.even_batches = even_batches
        self.split_batches = split_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        if split_batches and (not isinstance(self.batch_size, int) or self.batch_size % num_processes):
            raise UsageError(
                f"split_batches=True needs a batch size that divides by the number of processes "
                f"({num_processes}); this dataloader's batch size is {self.batch_size}"
            )

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
    """The batches (or indices) of ``batch_sampler``, leaving out the first ``skip`` of a pass. Skipped batches are
    drawn from the inner sampler (so its order and state advance exactly as in a full pass) but never loaded.

    The values for a pass are read when the pass's iterator is made, and nothing is consumed by making one: torch's
    multi-process loader makes two and throws the first away. A prepared dataloader sets ``skip`` (and
    ``worker_seed``, ``after_skip``) around the ``iter()`` of its loader and clears them again. With ``once``
    (``skip_first_batches`` on a plain DataLoader) the skip is consumed by the first iterator that starts drawing,
    so only the next pass is shortened."""

    def __init__(self, batch_sampler: Any, skip: int = 0, once: bool = False):
        self.batch_sampler = batch_sampler
        self.skip = int(skip)
        self.once = once
        #: Set for a pass of a dataloader with worker processes: each batch carries a seed the workers load it with
        #: (see :class:`WorkerSeededDataset`).
        self.worker_seed: int | None = None
        #: Called once the skipped batches are drawn, before the first batch of the pass is handed on.
        self.after_skip: Callable[[], None] | None = None

    def __getattr__(self, name: str) -> Any:
        """The inner sampler's attributes (``even_batches``, ``batch_size``, ...), as a prepared dataloader's
        ``batch_sampler`` has them in Accelerate (its ``BatchSamplerShard``)."""
        if name.startswith("__") or name == "batch_sampler":  # unpickling asks before __dict__ exists
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)

    def __iter__(self) -> Iterator[Any]:
        if not self.skip and self.worker_seed is None and self.after_skip is None:
            return iter(self.batch_sampler)
        return self._iter(self.skip, self.worker_seed, self.after_skip)

    def _iter(self, skip: int, seed: int | None, after: Callable[[], None] | None) -> Iterator[Any]:
        if self.once:
            self.skip = 0
        it = iter(self.batch_sampler)
        for _ in range(skip):
            if next(it, _END) is _END:
                break
        if after is not None:
            after()
        if seed is None:
            yield from it
            return
        for i, batch in enumerate(it, skip):
            yield SeededBatch(batch, seed, i)


class SeededBatch(list):  # type: ignore[type-arg]
    """A batch's indices with the seed its worker loads it with: derived from the pass's seed and the batch's
    number in the pass, so it does not depend on which worker loads it or on how many batches a resumed pass
    skipped."""

    def __init__(self, indices: Iterable[int], pass_seed: int, number: int):
        super().__init__(indices)
        self.seed = (pass_seed + number * 0x9E3779B97F4A7C15) % 2**64


class WorkerSeededDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """The dataset a prepared dataloader with worker processes loads through: before a batch is loaded, the
    worker's python, numpy and torch generators are seeded from the batch (:class:`SeededBatch`), so random
    augmentation in ``__getitem__`` is the same in a resumed run (torch seeds each worker once, and a worker's
    draws then depend on every batch it loaded before). Other attributes are the dataset's."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[Any]) -> Any:
        seed = getattr(indices, "seed", None)
        if seed is not None:
            seed_everything(seed)
            indices = list(indices)
        many = getattr(self.dataset, "__getitems__", None)
        if many is not None:
            return many(indices)
        return [self.dataset[i] for i in indices]


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's (if loaded) and torch's generators of this process from one 64-bit number.

    torch's CPU generator is seeded directly (CUDA's only where this process initialised CUDA): ``torch.manual_seed``
    also queues a lazy CUDA seeding that records a formatted stack each call, 130 µs against 1 µs (bench/dataloader.py),
    and this runs before every batch a worker loads."""
    random.seed(seed)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed([seed & 0xFFFFFFFF, seed >> 32])


def rng_states() -> dict[str, Any]:
    """This process's python, numpy (if ``numpy.random`` is loaded) and torch CPU random states. numpy 2 loads
    ``numpy.random`` on first use (torch's optimizers load it): until then nothing drew from its global generator,
    and reading its state would load it. The prepared loader of an iterable dataset reads the states before every
    batch it reads ahead, so numpy's is read through :func:`_numpy_state`."""
    states: dict[str, Any] = {"python": _python_state(), "torch": torch.get_rng_state()}
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        states["numpy"] = _numpy_state(np_random)
    return states


class _LastRead:
    """The last state read of a global random generator (numpy's, python's), and the generator's raw words then."""

    generator: Any = None
    words = b""
    state: Any = None
    usable = False  # the raw words are where this module expects them (checked once per generator)


_numpy_read = _LastRead()
_MT_WORDS = 625 * 4  # numpy's mt19937_state: uint32 key[624], int pos


def _numpy_state(np_random: Any) -> Any:
    """``numpy.random.get_state()``, which costs about 50 µs (numpy copies the 624 words of the state one by one).
    When the generator's raw words (0.5 µs to copy, through its ``ctypes.state_address``) are those of the last read
    and no cached gaussian was pending then, nothing has drawn from it since: the last read is returned. (Drawing
    changes the words; a pending cached gaussian can be used up without drawing, so then it is read again.) Where
    the words are not laid out as expected (checked against a full read once per generator), every call reads."""
    getter = np_random.get_state
    generator = getattr(getattr(getter, "__self__", None), "_bit_generator", None)
    last = _numpy_read
    if generator is None:
        return getter()
    if generator is not last.generator:
        state = getter()
        try:
            words = ctypes.string_at(generator.ctypes.state_address, _MT_WORDS)
            usable = state[0] == "MT19937" and words == state[1].tobytes() + struct.pack("i", state[2])
        except (AttributeError, TypeError, ValueError, IndexError):
            words, usable = b"", False
        last.generator, last.words, last.state, last.usable = generator, words, state, usable
        return state
    if not last.usable:
        return getter()
    words = ctypes.string_at(generator.ctypes.state_address, _MT_WORDS)
    if words == last.words and not last.state[3]:  # state[3]: has_gauss
        return last.state
    last.words, last.state = words, getter()
    return last.state


_python_read = _LastRead()
# CPython's RandomObject: PyObject_HEAD, int index, uint32_t state[624]
_PY_HEAD, _PY_WORDS = 2 * struct.calcsize("P"), 625 * 4


def _python_state() -> Any:
    """``random.getstate()``, which costs about 24 µs (a tuple of 625 new ints). When the generator's raw words
    (``index`` and ``state[624]`` of CPython's object, 0.5 µs to copy) are those of the last read, nothing has drawn
    from it since, and the last read's words are returned with the cached gaussian as it is now (``gauss()`` can use
    that up without drawing). Where the words are not laid out as expected (checked against a full read once per
    generator; another Python), every call reads."""
    last, inst = _python_read, getattr(random.getstate, "__self__", None)  # random's hidden global generator
    if not isinstance(inst, random.Random):
        return random.getstate()
    if inst is not last.generator:
        state = random.getstate()
        words = ctypes.string_at(id(inst) + _PY_HEAD, _PY_WORDS)
        index, *key = struct.unpack(f"i{_PY_WORDS // 4 - 1}I", words)
        usable = sys.implementation.name == "cpython" and tuple(key) + (index,) == state[1]
        last.generator, last.words, last.state, last.usable = inst, words, state, usable
        return state
    if not last.usable:
        return random.getstate()
    words = ctypes.string_at(id(inst) + _PY_HEAD, _PY_WORDS)
    if words != last.words:
        last.words, last.state = words, random.getstate()
        return last.state
    gauss = inst.gauss_next  # type: ignore[attr-defined]  # random.Random keeps its cached gaussian there
    if gauss is not last.state[2]:
        last.state = (last.state[0], last.state[1], gauss)
    return last.state


def set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "numpy" in states:
        import numpy as np

        np.random.set_state(states["numpy"])


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

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        num_processes: int,
        process_index: int,
        drop_last: bool = False,
        even_batches: bool = True,
    ):
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
        if self.num_processes == 1:
            return self._whole()
        return self._share()

    def _whole(self) -> Iterator[Any]:
        """One process: every sample as it comes (no group to slice); the last short group completed as below. The
        parts are chained in C, so no Python code runs per sample (as with the dataset itself)."""
        return itertools.chain.from_iterable(self._whole_parts())

    def _whole_parts(self) -> Iterator[Iterable[Any]]:
        span = self.batch_size
        it = iter(self.dataset)
        first = list(itertools.islice(it, span))
        yield first
        counter = itertools.count(len(first))  # counts the rest: zip draws from `it` first, so it stops with `it`
        yield map(operator.itemgetter(0), zip(it, counter, strict=False))
        seen = self.seen = next(counter)
        short = seen % span
        if short and not self.drop_last and self.even_batches:
            yield itertools.islice(_cycle_any(first), span - short)

    def _share(self) -> Iterator[Any]:
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
            mine = buf[lo:hi]
            if mine:
                yield from mine
            else:  # even_batches=False: another process has one more (short) batch; this one gets an empty batch
                yield from [Padding(first[0])] * self.batch_size


class Padding:
    """A stand-in sample of an iterable dataset's shard: one batch of them becomes an empty batch (zero rows) of
    the same structure as ``sample``'s, for a process that has run out while another still has a batch."""

    def __init__(self, sample: Any):
        self.sample = sample


class PaddingBatch:
    """What :class:`PaddingCollate` makes of a batch of :class:`Padding`: ``template`` is a collated batch of one
    sample; the prepared dataloader hands out its empty version."""

    def __init__(self, template: Any):
        self.template = template


class PaddingCollate:
    """A collate function that turns a batch of :class:`Padding` into a :class:`PaddingBatch` and collates
    everything else as ``collate_fn`` does."""

    def __init__(self, collate_fn: Callable[[Any], Any]):
        self.collate_fn = collate_fn

    def __call__(self, batch: Any) -> Any:
        if type(batch) is Padding:  # batch_size=None: one sample at a time
            return PaddingBatch(self.collate_fn(batch.sample))
        if batch and type(batch[0]) is Padding:
            return PaddingBatch(self.collate_fn([batch[0].sample]))
        return self.collate_fn(batch)


def _cycle_any(items: list[Any]) -> Iterator[Any]:
    while True:
        yield from items
