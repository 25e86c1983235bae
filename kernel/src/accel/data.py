"""Data sharding: every process sees a disjoint share of each epoch, in step with the others.

Map-style datasets: the batches of the user's batch sampler are dealt round-robin (process ``r`` gets batches
``r, r+N, ...``). With ``even_batches=True`` (default) the last short batch and any missing batches are completed
with samples from the start of the epoch, so every process runs the same number of full batches;
``gather_for_metrics`` drops those duplicates again. With ``even_batches=False`` nothing is duplicated; processes
that run out early get *empty* batches (zero rows) for the remaining steps, so collectives in the loop never hang.
Iterable datasets: every process reads the stream and takes its slice of each ``batch_size * N`` samples; with
``even_batches=False`` a process whose slice of the last group is empty gets one empty batch (:class:`Padding`).

Shuffling: a ``RandomSampler`` without its own generator is replaced by ``SeedableRandomSampler``, seeded
identically on every process (drawn from torch's global generator and broadcast from process 0) and reseeded with
``seed + epoch``, so all processes agree on the permutation and an epoch can be replayed exactly.

Resuming: a prepared dataloader knows how many batches of the current pass it handed out and the sampler's (and
generators') state when the pass began (``state_dict``). ``load_state_dict`` makes the next pass replay that
epoch's order and skip the batches already seen, at the batch-sampler level (:class:`SkipBatchSampler`): the
skipped batches' indices are drawn, their samples are never loaded. ``skip_first_batches`` does the same on
request. Random states, per process (saved with the ``rng`` item): torch's when the pass started, so the restored
pass draws the loader's seed and the sampler's order again before the saved states are put back; with worker
processes each batch is loaded with seeds of its own (:class:`WorkerSeededDataset`), so a skipped batch changes no
other batch's augmentation. Map-style loaders know the epoch's last batch by count and load nothing ahead of the
training loop; iterable datasets are read one batch ahead, with the random states before that read kept for
``save_state``.
"""

from __future__ import annotations

import functools
import math
import random
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

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
    """Seed python's, numpy's (if loaded) and torch's generators of this process from one 64-bit number."""
    random.seed(seed)
    torch.manual_seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed([seed & 0xFFFFFFFF, seed >> 32])


def rng_states() -> dict[str, Any]:
    """This process's python, numpy (if loaded) and torch CPU random states."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        states["numpy"] = np.random.get_state()
    return states


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
    is out, so ``accumulate`` syncs and ``gather_for_metrics`` trims duplicates. The last batch is known by count
    where the loader has a length (map-style datasets), so no batch is loaded before the training loop asks for it;
    an iterable dataset is read one batch ahead. ``state_dict``/``load_state_dict`` save and restore the position
    in the current pass (see the module docstring). Other attributes are those of the underlying DataLoader."""

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
        self._restored: int | None = None  # the position load_state restored for the next pass, until it starts
        self._position = 0  # batches of the current pass handed out, skipped ones included
        self._open = False  # a pass started (or was restored) and has neither finished nor been abandoned
        self._start: dict[str, Any] = {}  # sampler and generator states when the current pass started
        # Random states of this process (saved with the per-process ``rng`` item, see ``rng_state_dict``): torch's
        # when the current pass started (its iterator's seed and the sampler's draws come from it), and all of them
        # as they were before the batch read ahead was loaded (iterable datasets loaded in this process).
        self._rng_start: torch.Tensor | None = None
        self._before: dict[str, Any] | None = None
        self._resume: dict[str, Any] = {}  # the above as restored by load_state, for the restored pass
        self._length: int | None = self._known_length()

    def _known_length(self) -> int | None:
        if self.steps is not None:
            return self.steps
        if isinstance(self.base.dataset, IterableDataset):
            return None
        try:
            return len(self.base)
        except TypeError:
            return None

    def __getattr__(self, name: str) -> Any:
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    @property
    def dataset(self) -> Any:
        """The dataset given to ``prepare`` (the loader may read it through a wrapper)."""
        dataset = self.base.dataset
        return dataset.dataset if isinstance(dataset, WorkerSeededDataset) else dataset

    def __len__(self) -> int:
        return self.steps if self.steps is not None else len(self.base)

    def set_epoch(self, epoch: int) -> None:
        for obj in (innermost_sampler(self.base), self.base.dataset):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
                return

    # ---- position -----------------------------------------------------------------------------------------

    def skip_next(self, num_batches: int) -> None:
        """Leave out the first ``num_batches`` batches of the next pass (they are not loaded). After
        ``load_state`` the next pass already starts where the saved one stopped: a call naming that same position
        (Accelerate's documented resume) changes nothing; another number is an error."""
        if num_batches < 0:
            raise UsageError(f"skip_first_batches needs a number of batches >= 0, got {num_batches}")
        if self._restored is not None:
            if num_batches != self._restored:
                raise UsageError(f"skip_first_batches({num_batches}) disagrees with the checkpoint: load_state "
                                 f"restored this dataloader to batch {self._restored} of its epoch, where its next "
                                 f"pass starts; skip {self._restored} batches or leave the call out")
            return
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

    def _in_pass(self) -> bool:
        return self._open and (self.steps is None or self._position < self.steps)

    def state_dict(self) -> dict[str, Any]:
        """Where the current pass stands: ``position`` batches out of ``steps`` handed out, and the sampler state
        that reproduces this pass's order. A pass that finished (or handed out its last batch, or was abandoned)
        is recorded as position 0 of the next one. Warns (one line) where the resumed run cannot be exact."""
        in_pass = self._in_pass()
        problem = self._inexact(in_pass)
        if problem:
            from accel.tracking import user_stacklevel

            dataset = self.shard.dataset if isinstance(self.shard, IterableDatasetShard) else self.dataset
            warnings.warn(f"save_state: the prepared dataloader over {type(dataset).__name__} {problem}",
                          RuntimeWarning, stacklevel=user_stacklevel())
        return {
            "position": self._position if in_pass else 0,
            "start": self._start if in_pass else self._snapshot(),
            "steps": self.steps,
            "num_processes": self.kernel.num_processes,
        }

    def _inexact(self, in_pass: bool) -> str | None:
        """Why a run resumed from a checkpoint taken now may load different batches, or None."""
        if not isinstance(self.base.dataset, IterableDataset):
            if in_pass and self._position and self.base.num_workers > 0 and self.base.batch_sampler is None:
                return ("loads single samples (batch_size=None) in worker processes, which cannot be given seeds per "
                        "batch: random draws in the dataset can differ after resuming (give the DataLoader a "
                        "batch_size to resume exactly)")
            return None
        if self.base.num_workers > 0 and self.base.persistent_workers and getattr(self.base, "_iterator", None) is not None:
            return ("has persistent worker processes, whose dataset copies and random generators cannot be saved: "
                    "the resumed run starts new ones, so its batches can differ (persistent_workers=False resumes "
                    "exactly)")
        if in_pass and self._position:
            return (f"is an iterable dataset with no index to resume at: the resumed run reads the {self._position} "
                    "batches already seen again and drops them, which is exact only if the dataset yields the same "
                    "samples each time it is iterated")
        return None

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
        self._restored = self._position
        self._open = self._position > 0
        self._resume = {}

    def rng_state_dict(self) -> dict[str, Any]:
        """This process's random states the current pass needs to be replayed (saved in the per-process ``rng``
        checkpoint item, next to the generators they belong to)."""
        if not self._in_pass() or self._rng_start is None:
            return {}
        out: dict[str, Any] = {"torch_start": self._rng_start}
        if self._before is not None:
            out["before"] = self._before
        return out

    def load_rng_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = dict(state) if self._skip else {}

    # ---- iteration ----------------------------------------------------------------------------------------

    def _worker_seed(self) -> int | None:
        if not isinstance(self.base.dataset, WorkerSeededDataset):
            return None
        return int(torch.empty((), dtype=torch.int64).random_(generator=self.base.generator).item())

    def _open_base(self, skip: int, resume: dict[str, Any]) -> Iterator[Any]:
        """The base loader's iterator for a pass that leaves out ``skip`` batches. A restored pass replays from
        torch's random state when the interrupted pass started (so the loader's seed and a sampler's draws repeat),
        then puts back the states of the moment of saving once the skipped batches are drawn; the first batch is
        loaded with the states from before it was read ahead, if it was."""
        saved = rng_states() if skip else None  # the states of the moment of saving (or of skip_first_batches)
        if "torch_start" in resume:
            torch.set_rng_state(resume["torch_start"])
        self._rng_start = torch.get_rng_state()
        after: Callable[[], None] | None = None
        if saved is not None:
            before = resume.get("before")
            if before is not None:
                resume["saved"] = saved  # put back once the first batch is loaded (see _read_ahead)
            after = functools.partial(set_rng_states, before if before is not None else saved)
        seed = self._worker_seed()
        if self.skipper is None:
            it = iter(self.base)
            return self._drop(it, skip, after) if skip else it
        self.skipper.skip, self.skipper.worker_seed, self.skipper.after_skip = skip, seed, after
        try:
            return iter(self.base)
        finally:
            self.skipper.skip, self.skipper.worker_seed, self.skipper.after_skip = 0, None, None

    @staticmethod
    def _drop(it: Iterator[Any], skip: int, after: Callable[[], None] | None) -> Iterator[Any]:
        for _ in range(skip):  # iterable datasets: nothing to skip by index, the batches are read and dropped
            if next(it, _END) is _END:
                break
        if after is not None:
            after()
        yield from it

    def _batches(self, it: Iterator[Any], skip: int) -> Iterator[Any]:
        """The batches of a pass of several processes (or a skipping one): empty batches where this process has
        run out before the others (``even_batches=False``)."""
        last = None
        count = 0
        for batch in it:
            if type(batch) is PaddingBatch:
                batch = empty_like_batch(batch.template)
            last = batch
            count += 1
            yield batch
        if self.steps is not None and count < self.steps - skip:
            if last is None:
                states = rng_states()  # a sample read for its structure only: no draws of the run are spent on it
                last = self.base.collate_fn([self.base.dataset[0]])
                set_rng_states(states)
            empty = empty_like_batch(last)
            for _ in range(self.steps - skip - count):
                yield empty

    def __iter__(self) -> Iterator[Any]:
        state = self.kernel.gradient_state
        skip, self._skip = self._skip, 0
        restored, self._restored = self._restored, None
        resume, self._resume = self._resume, {}
        if not (restored and skip):  # a restored pass keeps the start states of the pass it continues
            self._start = self._snapshot()
        self._position, self._open = skip, True
        self._before = None
        self.end_of_dataloader = False
        state.enter(self)
        ahead: Iterator[Any] | None = None  # a device loader's iterator, which reads batches ahead of this loop
        try:
            it = self._open_base(skip, resume)
            if skip or self.kernel.num_processes > 1:
                it = self._batches(it, skip)
            if self.device_loader is not None and self.device_placement:
                it = ahead = iter(self.device_loader(it))
            device = self.kernel.device if self.device_placement and self.device_loader is None else None
            if device is not None and device.type == "cpu" and not _accelerator_present():
                device = None  # no other device a tensor could be on: placement would hand every batch back as it is
            if self._length is not None:
                yield from self._counted(it, self._length, device)
            else:
                yield from self._read_ahead(it, device, resume)
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

    def _counted(self, it: Iterator[Any], total: int, device: torch.device | None) -> Iterator[Any]:
        """A pass whose length is known: the last batch is the ``total``-th (nothing is loaded ahead)."""
        if self._position >= total:  # skipped the whole pass: draw it to its end all the same
            for _ in it:
                pass
            return
        for batch in it:
            self._position += 1
            if self._position == total:
                # Finish the pass (a seeded sampler moves on to its next epoch) before the last batch is handed out.
                if next(it, _END) is not _END:
                    raise UsageError(f"the dataloader's sampler yields more batches than its length ({total}); "
                                     "give it a __len__ that matches what it yields")
                self.end_of_dataloader = True
                self.kernel.gradient_state.refresh()
                yield batch if device is None else send_to_device(batch, device, self.kernel.non_blocking)
                return
            yield batch if device is None else send_to_device(batch, device, self.kernel.non_blocking)
        # Fewer batches than the length said: the pass ended without its last batch being known as such.
        self.end_of_dataloader = True
        warnings.warn(f"the dataloader yielded {self._position} batches, its length says {total}; the end of "
                      "the epoch was not known in time for accumulate/gather_for_metrics", RuntimeWarning,
                      stacklevel=2)

    def _read_ahead(self, it: Iterator[Any], device: torch.device | None, resume: dict[str, Any]) -> Iterator[Any]:
        """A pass of unknown length: one batch is read ahead, so the last one is known when it is handed out. When
        batches are loaded in this process, the random states before each read-ahead are kept: a checkpoint taken
        now restores them for that batch, whose draws the states saved afterwards already hold."""
        state = self.kernel.gradient_state
        current = next(it, _END)
        if "before" in resume:
            set_rng_states(resume["saved"])
        if current is _END:
            return
        in_process = self.base.num_workers == 0 and self.device_loader is None
        while True:
            before = rng_states() if in_process else None
            upcoming = next(it, _END)
            if upcoming is _END:
                break
            self._before = before
            self._position += 1
            yield current if device is None else send_to_device(current, device, self.kernel.non_blocking)
            current = upcoming
        self._before = None
        self.end_of_dataloader = True
        state.refresh()
        if isinstance(self.shard, IterableDatasetShard) and self.shard.seen >= 0:
            span = self.shard.batch_size * self.shard.num_processes
            self.remainder = 0 if self.shard.drop_last else self.shard.seen % span
        self._position += 1
        yield current if device is None else send_to_device(current, device, self.kernel.non_blocking)


def shard_dataloader(kernel: Kernel, dataloader: DataLoader, device_placement: bool = True,
                     device_loader: Callable[[Iterator[Any]], Iterable[Any]] | None = None) -> PreparedDataLoader:
    """The kernel's default ``accel_prepare_dataloader``: shard by ``kernel.data_parallel_index`` of
    ``kernel.data_parallel_size`` (the process index and count unless the strategy says otherwise) and wrap in a :class:`PreparedDataLoader`. Plugins may call it and wrap the result.

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
    n, r, even = kernel.data_parallel_size, kernel.data_parallel_index, kernel.even_batches
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
        if not even and n > 1:  # a process that has run out gets empty batches while another still has one
            kwargs["collate_fn"] = PaddingCollate(kwargs["collate_fn"])
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
        batch_sampler = BatchSampler(seeded, batch_sampler.batch_size, batch_sampler.drop_last)  # type: ignore[attr-defined]
    shard_sampler = BatchSamplerShard(batch_sampler, n, r, even, split)
    skipper = SkipBatchSampler(shard_sampler)
    dataset = dataloader.dataset
    if dataloader.num_workers > 0:  # each batch is loaded with its own seeds, whichever worker loads it
        dataset = WorkerSeededDataset(dataset)
    base = DataLoader(dataset, batch_sampler=skipper, **kwargs)
    steps = shard_sampler.steps()
    try:
        size = len(dataloader.dataset)  # type: ignore[arg-type]  # a map-style Dataset may have no __len__
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
    sampler. After ``load_state`` there is no need to call it: the position is restored automatically; a call with
    the restored position is accepted (nothing is skipped twice), another number is an error."""
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
        skipper = SkipBatchSampler(dataloader.batch_sampler, num_batches, once=True)
        return DataLoader(dataloader.dataset, batch_sampler=skipper, **kwargs)
    skipper = SkipBatchSampler(dataloader.sampler, num_batches, once=True)
    return DataLoader(dataloader.dataset, batch_size=None, sampler=skipper, **kwargs)
