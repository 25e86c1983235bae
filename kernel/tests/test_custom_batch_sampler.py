"""A user's own batch sampler keeps its batching when accel seeds its shuffling: accel swaps in the seeded sampler
on a copy of the batch sampler (as Accelerate puts its seeded sampler back into the user's batch sampler), instead
of replacing the whole batch sampler with a plain ``BatchSampler`` (which silently dropped the custom batching)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from accel import Kernel


class SortedBatches(BatchSampler):
    """Each batch sorted, so a batch of a custom sampler is told apart from a plain BatchSampler's."""

    def __iter__(self) -> Iterator[list[int]]:
        for batch in super().__iter__():
            yield sorted(batch)


def test_a_custom_batch_sampler_keeps_its_batching_and_the_user_object_is_untouched() -> None:
    data = TensorDataset(torch.arange(32))
    user = SortedBatches(RandomSampler(data), batch_size=8, drop_last=False)
    loader = DataLoader(data, batch_sampler=user)
    kernel = Kernel(cpu=True)
    prepared = kernel.prepare(loader)
    batches = [b[0].tolist() for b in prepared]
    assert [sorted(b) for b in batches] == batches  # the custom batching (sorted) is applied
    assert batches != [list(range(i, i + 8)) for i in range(0, 32, 8)]  # and it still shuffles
    assert sorted(x for b in batches for x in b) == list(range(32))
    assert isinstance(user.sampler, RandomSampler)  # the user's object is not modified
    again = [b[0].tolist() for b in prepared]
    assert again != batches and all(sorted(b) == b for b in again)  # a new epoch, a new order, same batching
    kernel.end_training()
