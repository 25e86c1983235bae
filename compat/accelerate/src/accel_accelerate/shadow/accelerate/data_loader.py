"""``accelerate.data_loader``: Accelerate's dataloader classes and ``prepare_data_loader``, on accel's sharding.

A prepared dataloader is a :class:`DataLoaderShard` (accel's ``PreparedDataLoader`` with Accelerate's view of it):
its ``batch_sampler`` is the :class:`BatchSamplerShard`, whose ``batch_sampler`` is the script's own batch sampler,
whose ``sampler`` is a :class:`SeedableRandomSampler` where ``use_seedable_sampler`` asked for one, as in
Accelerate. Samplers follow Accelerate's rules (:func:`accelerate_sampler`): with ``use_seedable_sampler`` a
``RandomSampler`` becomes a ``SeedableRandomSampler`` seeded from ``data_seed`` or ``torch.random.initial_seed()``
(each epoch from ``seed + epoch``); without it a ``RandomSampler`` of several processes gets a generator of its own,
the same on every process. ``dispatch_batches=True`` gives a :class:`DataLoaderDispatcher`: process 0 reads the
batches and every process gets its slice."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from accel.compat import DataLoaderConfiguration
from accel.data import PreparedDataLoader, send_to_device, shard_dataloader, skip_first_batches
from accel.sampling import BatchSamplerShard, IterableDatasetShard, SkipBatchSampler
from accel.sampling import SeedableRandomSampler as _SeededSampler


class SeedableRandomSampler(_SeededSampler, RandomSampler):  # type: ignore[misc]
    """Accelerate's ``SeedableRandomSampler``: a ``RandomSampler`` (same arguments, plus ``data_seed``) whose
    generator is seeded with ``initial_seed + epoch`` at each pass; ``initial_seed`` is ``data_seed``, else
    ``torch.random.initial_seed()`` when it is made. The epoch moves on after each full pass."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        data_seed = kwargs.pop("data_seed", None)
        RandomSampler.__init__(self, *args, **kwargs)
        if self.generator is None:  # made now (Accelerate makes it at the first pass): its seed is set at each pass
            self.generator = torch.Generator()
        self.seed = int(data_seed if data_seed is not None else torch.random.initial_seed())
        self.epoch = 0

    @property
    def initial_seed(self) -> int:
        return self.seed

    @initial_seed.setter
    def initial_seed(self, value: int) -> None:
        self.seed = int(value)

    def __iter__(self) -> Iterator[int]:
        self.generator.manual_seed(self.seed + self.epoch)
        yield from RandomSampler.__iter__(self)
        self.set_epoch(self.epoch + 1)


def get_sampler(dataloader: Any) -> Any:
    """The sampler that draws the indices of ``dataloader``'s batches (Accelerate's ``get_sampler``)."""
    if isinstance(dataloader.sampler, BatchSampler):
        return getattr(dataloader.sampler, "sampler", None)
    return getattr(dataloader.batch_sampler, "sampler", None)


def accelerate_sampler(dataloader: DataLoader, use_seedable_sampler: bool, data_seed: int | None, kernel: Any) -> None:
    """Accelerate's sampler rules, applied to ``dataloader``'s batch sampler in place (as Accelerate does): with
    ``use_seedable_sampler`` a ``RandomSampler`` becomes a :class:`SeedableRandomSampler`; without it a
    ``RandomSampler`` without a generator gets one (several processes). The seed is process 0's on every process
    (Accelerate synchronizes the generator from process 0; a seedable sampler's seed is the same everywhere when
    the script seeds every process alike, and the broadcast keeps the shards disjoint when it does not)."""
    if isinstance(dataloader.dataset, IterableDataset):
        return
    holder: Any = dataloader.sampler if isinstance(dataloader.sampler, BatchSampler) else dataloader.batch_sampler
    sampler = getattr(holder, "sampler", None)
    if not isinstance(sampler, RandomSampler):
        return
    several = kernel.num_processes > 1
    if use_seedable_sampler:
        seeded = SeedableRandomSampler(
            data_source=sampler.data_source,
            replacement=sampler.replacement,
            num_samples=sampler._num_samples,
            generator=sampler.generator,
            data_seed=data_seed,
        )
        if several:
            seeded.seed = int(kernel.collectives.broadcast_object(seeded.seed, 0))
        holder.sampler = seeded
    elif several and sampler.generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        sampler.generator = torch.Generator()
        sampler.generator.manual_seed(int(kernel.collectives.broadcast_object(seed, 0)))


class DataLoaderShard(PreparedDataLoader):
    """A prepared dataloader as Accelerate shows it: ``batch_sampler`` is its :class:`BatchSamplerShard` on several
    processes, the script's own batch sampler on one (accel iterates either through a ``SkipBatchSampler`` that
    leaves out the batches of a resumed epoch)."""

    @property
    def batch_sampler(self) -> Any:
        if isinstance(self.shard, BatchSamplerShard):
            return self.shard if self.shard.num_processes > 1 else self.shard.batch_sampler
        return self.base.batch_sampler

    def __len__(self) -> int:
        if _uneven(self.shard):  # Accelerate's: this process's own batches
            return len(self.shard)
        return super().__len__()

    #: Prepared with ``use_stateful_dataloader=True``: ``save_state`` records its position, which ``load_state``
    #: restores, as Accelerate's ``StatefulDataLoader`` does (otherwise the pass's start, the script skipping).
    use_stateful_dataloader = False

    def pass_start_state(self) -> dict[str, Any]:
        return self.state_dict() if self.use_stateful_dataloader else super().pass_start_state()

    def get_sampler(self) -> Any:
        return get_sampler(self)

    def set_sampler(self, sampler: Any) -> None:
        holder = self.batch_sampler
        while holder is not None and hasattr(holder, "batch_sampler"):
            holder.sampler = sampler
            holder = holder.batch_sampler
        if holder is not None:
            holder.sampler = sampler


def _uneven(shard: Any) -> bool:
    """Whether ``shard`` deals whole batches to several processes without evening them out."""
    return (
        isinstance(shard, BatchSamplerShard)
        and shard.num_processes > 1
        and not shard.even_batches
        and not shard.split_batches
    )


class _UnevenEnds:
    """The Kernel as a :class:`DataLoaderShard` sees it: without even batches its pass ends where this process's
    batches end, as in Accelerate (accel's own dataloaders hand out empty batches until the others are done, as they
    do inside ``join_uneven_inputs``)."""

    def __init__(self, kernel: Any, loader: PreparedDataLoader):
        self._kernel = kernel
        self._loader = loader

    @property
    def _join_uneven(self) -> bool:
        return bool(self._kernel._join_uneven) or _uneven(self._loader.shard)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernel, name)


def as_accelerate_loader(loader: Any, stateful: bool = False) -> Any:
    """``loader`` as a :class:`DataLoaderShard` where it is accel's own prepared dataloader (a plugin's subclass is
    left as it is)."""
    if type(loader) is PreparedDataLoader:
        loader.__class__ = DataLoaderShard
        loader.kernel = cast(Any, _UnevenEnds(loader.kernel, loader))
        cast(DataLoaderShard, loader).use_stateful_dataloader = stateful
    return loader


class _Sharding:
    """The Kernel as ``prepare_data_loader``'s arguments see it: this call's process count and index, batch
    splitting and even batches, everything else the Kernel's."""

    def __init__(self, kernel: Any, num_processes: int, process_index: int, split: bool, even: bool, nb: bool):
        self._kernel = kernel
        self.data_parallel_size = self.num_processes = num_processes
        self.data_parallel_index = self.process_index = process_index
        self.split_batches = split
        self.even_batches = even
        self.non_blocking = nb

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernel, name)


def _concatenate(batches: list[Any]) -> Any:
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches)
    if isinstance(first, Mapping):
        return type(first)({k: _concatenate([b[k] for b in batches]) for k in first})  # type: ignore[call-arg]
    if isinstance(first, (list, tuple)):
        parts = [_concatenate(list(column)) for column in zip(*batches, strict=True)]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    return first


def _rows(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    values = list(batch.values()) if isinstance(batch, Mapping) else list(batch)
    return _rows(values[0])


def _slice(batch: Any, part: slice) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[part]
    if isinstance(batch, Mapping):
        return type(batch)({k: _slice(v, part) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, (list, tuple)):
        parts = [_slice(v, part) for v in batch]
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    return batch


class DataLoaderDispatcher:
    """Accelerate's ``DataLoaderDispatcher``: process 0 iterates the whole dataloader, takes ``num_processes``
    batches at a time (one with ``split_batches``), joins them and sends them to every process, which keeps its
    slice. A last short batch is completed from the first one unless the loader drops it."""

    def __init__(self, dataloader: DataLoader, kernel: Any, split_batches: bool, device: Any, non_blocking: bool):
        self.base = dataloader
        self.kernel = kernel
        self.split_batches = split_batches
        self.device = device
        self.non_blocking = non_blocking

    def __getattr__(self, name: str) -> Any:
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def __len__(self) -> int:
        whole = len(self.base)
        if self.split_batches:
            return whole
        n = self.kernel.num_processes
        return whole // n if self.base.drop_last else math.ceil(whole / n)

    def set_epoch(self, epoch: int) -> None:
        sampler = get_sampler(self.base)
        for obj in (sampler, self.base.dataset):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
                return

    def __iter__(self) -> Iterator[Any]:
        n, r = self.kernel.num_processes, self.kernel.process_index
        it = iter(self.base) if r == 0 else None
        first: Any = None
        while True:
            batch = None
            if it is not None:
                taken = [b for _, b in zip(range(1 if self.split_batches else n), it, strict=False)]
                batch = _concatenate(taken) if taken else None
            batch = self.kernel.collectives.broadcast_object(batch, 0)
            if batch is None:
                return
            first = batch if first is None else first
            rows = _rows(batch)
            per = rows // n
            if rows % n:
                if self.base.drop_last:
                    return
                while _rows(batch) < (per + 1) * n:
                    batch = _concatenate([batch, first])
                per += 1
            mine = _slice(batch, slice(r * per, (r + 1) * per))
            yield mine if self.device is None else send_to_device(mine, self.device, self.non_blocking)


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: list[Any] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Any = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> Any:
    """Accelerate's ``prepare_data_loader``: this process's share of ``dataloader`` (``num_processes`` and
    ``process_index`` default to the run's), batches moved to the device with ``put_on_device``. Device meshes and
    ``slice_fn_for_dispatch`` are not supported here."""
    from accelerate.state import PartialState

    if torch_device_mesh is not None or slice_fn_for_dispatch is not None:
        raise NotImplementedError(
            "accel-accelerate's prepare_data_loader takes no torch_device_mesh or slice_fn_for_dispatch: "
            "prepare the dataloader with Accelerator(parallelism_config=...).prepare"
        )
    if dispatch_batches is None:
        dispatch_batches = put_on_device and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and not put_on_device:
        raise ValueError("Using `dispatch_batches=True` requires `put_on_device=True`.")
    state = PartialState()
    kernel = state._shared_state["_kernel"]
    n = state.num_processes if num_processes is None else int(num_processes)
    r = state.process_index if process_index is None else int(process_index)
    target = torch.device(device) if device is not None else state.device
    if dispatch_batches:
        if split_batches and dataloader.batch_size and dataloader.batch_size % n:
            raise ValueError(
                f"To use a `DataLoader` in `split_batches` mode, the batch size ({dataloader.batch_size}) "
                f"needs to be a round multiple of the number of processes ({n})."
            )
        accelerate_sampler(dataloader, use_seedable_sampler, data_seed, kernel)
        return DataLoaderDispatcher(dataloader, kernel, split_batches, target, non_blocking)
    accelerate_sampler(dataloader, use_seedable_sampler, data_seed, kernel)
    view = _Sharding(kernel, n, r, split_batches, even_batches, non_blocking)
    loader = shard_dataloader(view, dataloader, device_placement=put_on_device)
    if put_on_device and device is not None and target != kernel.device:
        loader.kernel = _Placed(view, target)
    return as_accelerate_loader(loader, use_stateful_dataloader)


class _Placed(_Sharding):
    """A ``_Sharding`` whose device is the one ``prepare_data_loader`` was given."""

    def __init__(self, view: _Sharding, device: torch.device):
        self.__dict__.update(view.__dict__)
        self.device = device


__all__ = [
    "BatchSamplerShard",
    "DataLoaderConfiguration",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "get_sampler",
    "prepare_data_loader",
    "skip_first_batches",
]
