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
``seed + epoch``, so all processes agree on the permutation and an epoch can be replayed exactly
(``Kernel(seed_samplers=False)`` keeps it on one process: torch's global generator draws each epoch's order).

Resuming: a prepared dataloader knows how many batches of the current pass it handed out and the sampler's (and
generators') state when the pass began (``state_dict``). ``load_state_dict`` makes the next pass replay that
epoch's order and skip the batches already seen, at the batch-sampler level (:class:`SkipBatchSampler`): the
skipped batches' indices are drawn, their samples are never loaded. ``skip_first_batches`` does the same on
request. Random states, per process (saved with the ``rng`` item): torch's when the pass started, so the restored
pass draws the loader's seed and the sampler's order again before the saved states are put back; with worker
processes each batch is loaded with seeds of its own (:class:`WorkerSeededDataset`), so a skipped batch changes no
other batch's augmentation (``Kernel(reseed_workers=False)`` turns that off: torch's own seeding of
each worker, the resumed pass's samples the same but not their random augmentation). Map-style loaders know the epoch's last batch by count and load nothing ahead of the
training loop; iterable datasets are read one batch ahead, with the random states before that read kept for
``save_state``.

Why one module of this size: the prepared dataloader and the shard samplers it builds share the pass state
(position, seeds, padding) that exact resume rests on; the samplers that do not need it are in
:mod:`accel.sampling`.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from accel.contract import KernelView
from accel.errors import UsageError
from accel.gradient_state import GradientState
from accel.nested import map_tensors
from accel.sampling import (
    _END,
    BatchSamplerShard,
    IterableDatasetShard,
    Padding,
    PaddingBatch,
    PaddingCollate,
    SeedableRandomSampler,
    SeededBatch,
    SkipBatchSampler,
    WorkerSeededDataset,
    innermost_sampler,
    rng_states,
    seed_everything,
    set_rng_states,
)

if TYPE_CHECKING:
    from accel.data_arguments import DataSettings


class DataKernel(KernelView, Protocol):
    """What the dataloaders read of the Kernel beyond :class:`accel.contract.KernelView` (the object a hook gets is
    the Kernel, which has all of it)."""

    gradient_state: GradientState
    even_batches: bool
    _data: DataSettings
    _join_uneven: bool  # inside join_uneven_inputs with uneven batches

    @property
    def non_blocking(self) -> bool: ...

    @property
    def split_batches(self) -> bool: ...

    @property
    def data_parallel_index(self) -> int: ...

    @property
    def data_parallel_size(self) -> int: ...


__all__ = [
    "BatchSamplerShard",
    "IterableDatasetShard",
    "Padding",
    "PaddingBatch",
    "PaddingCollate",
    "PreparedDataLoader",
    "SeedableRandomSampler",
    "SeededBatch",
    "SkipBatchSampler",
    "WorkerSeededDataset",
    "empty_like_batch",
    "innermost_sampler",
    "rng_states",
    "seed_everything",
    "send_to_device",
    "set_rng_states",
    "shard_dataloader",
    "skip_first_batches",
]


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
        return kind(
            [
                v.to(device, non_blocking=non_blocking)
                if isinstance(v, torch.Tensor)
                else send_to_device(v, device, non_blocking)
                for v in batch
            ]
        )
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if kind is dict:
        if _tensors_on(batch.values(), device):
            return batch.copy()
        return {k: send_to_device(v, device, non_blocking) for k, v in batch.items()}

    def move(x: Any) -> Any:  # an object with a ``to`` method (BatchEncoding...) moves itself, as in Accelerate
        return x.to(device, non_blocking=non_blocking) if isinstance(x, torch.Tensor) else x.to(device)

    return map_tensors(move, batch, leaf=_movable)


def _movable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) or callable(getattr(x, "to", None))


def empty_like_batch(batch: Any) -> Any:
    """The same structure with zero rows (used when a process has run out of data with ``even_batches=False``)."""
    return map_tensors(lambda t: t[:0], batch)


_LOADER_ARGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
    "pin_memory_device",
)


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

    def __init__(
        self,
        kernel: DataKernel,
        base: DataLoader,
        steps: int | None,
        remainder: int,
        device_placement: bool = True,
        shard: Any = None,
        skipper: SkipBatchSampler | None = None,
        device_loader: Callable[[Iterator[Any]], Iterable[Any]] | None = None,
    ):
        self.kernel = kernel
        #: A plugin's device loader (see ``shard_dataloader``): it gets each pass's stream of CPU batches and yields
        #: them on the device; the position and end-of-epoch bookkeeping stay here, in the iterating thread.
        self.device_loader = device_loader
        self.base = base
        self.steps = steps
        self.remainder = remainder
        self._even_remainder = remainder  # set_even_batches(True) puts it back
        self.device_placement = device_placement
        self.shard = shard
        self.skipper = skipper
        self.end_of_dataloader = False
        self._skip = 0  # batches to leave out at the start of the next pass
        self._restored: int | None = None  # the position load_state restored for the next pass, until it starts
        # batches of the restarted pass the script skips itself (a checkpoint that records where its pass began):
        # the pass replays torch's random states from its start until they are handed out (see _open_base)
        self._replay = 0
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
                raise UsageError(
                    f"skip_first_batches({num_batches}) disagrees with the checkpoint: load_state "
                    f"restored this dataloader to batch {self._restored} of its epoch, where its next "
                    f"pass starts; skip {self._restored} batches or leave the call out"
                )
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
            from accel.errors import user_stacklevel

            dataset = self.shard.dataset if isinstance(self.shard, IterableDatasetShard) else self.dataset
            warnings.warn(
                f"save_state: the prepared dataloader over {type(dataset).__name__} {problem}",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
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
                return (
                    "loads single samples (batch_size=None) in worker processes, which cannot be given seeds per "
                    "batch: random draws in the dataset can differ after resuming (give the DataLoader a "
                    "batch_size to resume exactly)"
                )
            return None
        if (
            self.base.num_workers > 0
            and self.base.persistent_workers
            and getattr(self.base, "_iterator", None) is not None
        ):
            return (
                "has persistent worker processes, whose dataset copies and random generators cannot be saved: "
                "the resumed run starts new ones, so its batches can differ (persistent_workers=False resumes "
                "exactly)"
            )
        if in_pass and self._position:
            return (
                f"is an iterable dataset with no index to resume at: the resumed run reads the {self._position} "
                "batches already seen again and drops them, which is exact only if the dataset yields the same "
                "samples each time it is iterated"
            )
        return None

    def check_state(self, state: dict[str, Any]) -> str | None:
        """Why ``state`` cannot be restored into this dataloader, or None."""
        if int(state.get("position", 0)) == 0:
            return None
        saved_n, saved_steps = state.get("num_processes"), state.get("steps")
        if saved_n != self.kernel.num_processes:
            return (
                f"the dataloader stopped mid-epoch with {saved_n} process(es); this run has "
                f"{self.kernel.num_processes}, so the rest of that epoch cannot be replayed: resume with "
                f"{saved_n} process(es)"
            )
        if saved_steps != self.steps:
            return (
                f"the dataloader had {saved_steps} batches per process per epoch when saved and has {self.steps} "
                "now (different dataset, batch size or drop_last)"
            )
        return None

    def pass_start_state(self) -> dict[str, Any]:
        """The state a save by the main process alone records (Accelerate's ``save_state``: the sampler's epoch and
        seed, not the position): the resumed run starts the current pass again, in the same order, and the script
        skips the batches it already saw itself (diffusers' ``continue``, or ``skip_first_batches``)."""
        state = self.state_dict()
        if state["position"]:
            state.update(position=0, start=self._start, replay=state["position"])
        return {**state, "script_skips": True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        problem = self.check_state(state)
        if problem:
            raise UsageError(problem)
        self._apply(state["start"])
        self._start = dict(state["start"])
        self._position = self._skip = int(state["position"])
        self._restored = None if state.get("script_skips") else self._position
        self._replay = int(state.get("replay", 0)) if self._length is not None else 0  # a counted pass only
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
        self._resume = dict(state) if self._skip or self._replay else {}

    # ---- iteration ----------------------------------------------------------------------------------------

    def _worker_seed(self) -> int | None:
        if not isinstance(self.base.dataset, WorkerSeededDataset):
            return None
        return int(torch.empty((), dtype=torch.int64).random_(generator=self.base.generator).item())

    def _open_base(self, skip: int, resume: dict[str, Any], replay: int = 0) -> Iterator[Any]:
        """The base loader's iterator for a pass that leaves out ``skip`` batches. A restored pass replays from
        torch's random state when the interrupted pass started (so the loader's seed and a sampler's draws repeat),
        then puts back the states of the moment of saving once the skipped batches are drawn; the first batch is
        loaded with the states from before it was read ahead, if it was. A restarted pass whose first ``replay``
        batches the script skips itself replays the same way until it has handed them out."""
        if replay and not skip and "torch_start" in resume:
            now = rng_states()
            torch.set_rng_state(resume["torch_start"])
            self._rng_start = torch.get_rng_state()
            return self._handed_out(self._open_base(0, {}), replay, functools.partial(set_rng_states, now))
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
    def _handed_out(it: Iterator[Any], count: int, after: Callable[[], None]) -> Iterator[Any]:
        """``it``, with ``after()`` called once ``count`` batches are out, before the next one is loaded."""
        for _ in range(count):
            batch = next(it, _END)
            if batch is _END:
                break
            yield batch
        after()
        yield from it

    @staticmethod
    def _drop(it: Iterator[Any], skip: int, after: Callable[[], None] | None) -> Iterator[Any]:
        for _ in range(skip):  # iterable datasets: nothing to skip by index, the batches are read and dropped
            if next(it, _END) is _END:
                break
        if after is not None:
            after()
        yield from it

    def set_even_batches(self, even: bool) -> bool | None:
        """Change even batching for the next passes of a map-style dataloader (``join_uneven_inputs``); returns the
        previous value, or None (and changes nothing) for others."""
        if not isinstance(self.shard, BatchSamplerShard):
            return None
        previous, self.shard.even_batches = self.shard.even_batches, even
        self.remainder = self._even_remainder if even else 0
        return previous

    def _batches(self, it: Iterator[Any], skip: int, joined: bool = False) -> Iterator[Any]:
        """The batches of a pass of several processes (or a skipping one): empty batches where this process has
        run out before the others (``even_batches=False``); ``joined`` (``join_uneven_inputs``): none, the pass
        ends where this process's data ends."""
        last = None
        count = 0
        for batch in it:
            if type(batch) is PaddingBatch:
                if joined:
                    return
                batch = empty_like_batch(batch.template)
            last = batch
            count += 1
            yield batch
        if self.steps is not None and count < self.steps - skip and not joined:
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
        replay, self._replay = self._replay, 0
        if not (restored and skip):  # a restored pass keeps the start states of the pass it continues
            self._start = self._snapshot()
        self._position, self._open = skip, True
        self._before = None
        self.end_of_dataloader = False
        state.enter(self)
        ahead: Iterator[Any] | None = None  # a device loader's iterator, which reads batches ahead of this loop
        try:
            it = self._open_base(skip, resume, replay)
            joined = self.kernel._join_uneven
            if skip or self.kernel.num_processes > 1:
                it = self._batches(it, skip, joined)
            if self.device_loader is not None and self.device_placement:
                it = ahead = iter(self.device_loader(it))
            device = self.kernel.device if self.device_placement and self.device_loader is None else None
            if device is not None and device.type == "cpu" and not _accelerator_present():
                device = None  # no other device a tensor could be on: placement would hand every batch back as it is
            if self._length is not None and not joined:  # joined: this process's pass may end early
                out = self._counted(it, self._length, device)
            else:
                out = self._read_ahead(it, device, resume)
            yield from self._watched(out, skip) if restored and skip else out
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

    def _watched(self, batches: Iterator[Any], restored: int) -> Iterator[Any]:
        """The batches of a pass that ``load_state`` restored to batch ``restored``, refusing (one line) to go on
        when the first one never reached a model: the script is skipping the batches of the resumed epoch itself,
        which the restored position already left out, and would lose them silently. Whether it reached one is seen
        by a forward pre-hook on each prepared model, set for that one batch (a forward, under any strategy)."""
        models = list(getattr(self.kernel, "_models", ()))
        first = next(batches, _END)
        if first is _END:
            return
        used: list[bool] = []
        handles = [model.register_forward_pre_hook(lambda module, args: used.append(True)) for model in models]
        try:
            yield first
        finally:
            for handle in handles:
                handle.remove()
        if models and not used:
            raise UsageError(
                f"load_state restored this dataloader to batch {restored} of its epoch, and the script skipped the "
                f"batch after it too (batch {restored + 1} never reached the model): it is skipping the batches it "
                "already saw a second time. Remove the script's own skip (load_state resumes the position), or "
                "create the Kernel with script_skips_batches=True so that load_state restarts the epoch for the "
                "script to skip"
            )
        yield from batches

    def _counted(self, it: Iterator[Any], total: int, device: torch.device | None) -> Iterator[Any]:
        """A pass whose length is known: the last batch is the ``total``-th (nothing is loaded ahead)."""
        if self._position >= total:  # skipped the whole pass: draw it to its end all the same
            for _ in it:
                pass
            return
        # Every batch but the last, numbered as it goes (zip stops at the range's end without reading the last one).
        numbers = range(self._position + 1, total)
        for self._position, batch in zip(numbers, it, strict=False):
            yield batch if device is None else send_to_device(batch, device, self.kernel.non_blocking)
        batch = next(it, _END) if self._position == total - 1 else _END
        if batch is _END:  # fewer batches than the length said: the pass ended without its last batch known as such
            self.end_of_dataloader = True
            warnings.warn(
                f"the dataloader yielded {self._position} batches, its length says {total}; the end of "
                "the epoch was not known in time for accumulate/gather_for_metrics",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        self._position = total
        # Finish the pass (a seeded sampler moves on to its next epoch) before the last batch is handed out.
        if next(it, _END) is not _END:
            raise UsageError(
                f"the dataloader's sampler yields more batches than its length ({total}); "
                "give it a __len__ that matches what it yields"
            )
        self.end_of_dataloader = True
        self.kernel.gradient_state.refresh()
        yield batch if device is None else send_to_device(batch, device, self.kernel.non_blocking)

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


def shard_dataloader(
    kernel: KernelView,
    dataloader: DataLoader,
    device_placement: bool = True,
    device_loader: Callable[[Iterator[Any]], Iterable[Any]] | None = None,
) -> PreparedDataLoader:
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
    kernel = cast(DataKernel, kernel)  # a hook's KernelView is the Kernel: its dataloader settings are there
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"prepare() expects a torch.utils.data.DataLoader, got {type(dataloader).__name__}")
    n, r, even = kernel.data_parallel_size, kernel.data_parallel_index, kernel.even_batches
    split = kernel.split_batches and n > 1
    kwargs = _loader_kwargs(dataloader)
    if isinstance(dataloader.dataset, IterableDataset):
        bs = dataloader.batch_size or 1
        if split:  # each group of `bs` samples is one global batch: a process takes bs / n of them
            if bs % n:
                raise UsageError(
                    f"split_batches=True needs a batch size that divides by the number of processes "
                    f"({n}); this dataloader's batch size is {bs}"
                )
            bs //= n
        shard = IterableDatasetShard(dataloader.dataset, bs, n, r, dataloader.drop_last, even)
        if not even and n > 1:  # a process that has run out gets empty batches while another still has one
            kwargs["collate_fn"] = PaddingCollate(kwargs["collate_fn"])
        base = DataLoader(
            shard, batch_size=bs if dataloader.batch_size else None, drop_last=dataloader.drop_last, **kwargs
        )
        return PreparedDataLoader(kernel, base, None, -1, device_placement, shard, device_loader=device_loader)
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:  # batch_size=None: the dataset yields whole batches
        if split:
            raise UsageError(
                "split_batches=True needs a DataLoader with a batch_size (this one has batch_size=None: "
                "its dataset yields whole batches, which accel does not split)"
            )
        skipper = SkipBatchSampler(dataloader.sampler)
        base = DataLoader(dataloader.dataset, batch_size=None, sampler=skipper, **kwargs)
        return PreparedDataLoader(kernel, base, None, 0, device_placement, None, skipper, device_loader)
    sampler = getattr(batch_sampler, "sampler", None)
    seeded_here = n > 1 or kernel.settings.get("seed_samplers", True)
    if isinstance(sampler, RandomSampler) and sampler.generator is None and seeded_here:
        seed = kernel._data.data_seed
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
        seed = kernel.collectives.broadcast_object(seed, 0)
        seeded = SeedableRandomSampler(sampler.data_source, seed, sampler._num_samples, sampler.replacement)
        if type(batch_sampler) is BatchSampler:
            batch_sampler = BatchSampler(seeded, batch_sampler.batch_size, batch_sampler.drop_last)
        else:  # the user's own batching stays: a copy of their batch sampler draws from the seeded sampler
            batch_sampler = copy.copy(batch_sampler)
            batch_sampler.sampler = seeded  # type: ignore[attr-defined]
    shard_sampler = BatchSamplerShard(batch_sampler, n, r, even, split)
    skipper = SkipBatchSampler(shard_sampler)
    dataset = dataloader.dataset
    if dataloader.num_workers > 0 and kernel.settings.get("reseed_workers", True):  # each batch: its own seeds
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
