"""accel.data: the prepared dataloader in one process (the kernel's own ``accel_prepare_dataloader``, no plugin).
It hands out the batches the user's DataLoader would, with a shuffle seeded once per loader; its ``state_dict`` in
the middle of a pass makes a new loader replay the rest of that pass exactly; ``skip_first_batches`` starts the next
pass later for a prepared and a plain DataLoader; wrong input is one line. Sharding between processes is in
test_sampling.py (the samplers) and tests/test_even_batches.py (two real processes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from accel.data import PreparedDataLoader, skip_first_batches
from accel.errors import UsageError
from accel.testing import make_kernel


class Stream(IterableDataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(float(self.n)))


def loader(n: int = 22, shuffle: bool = False, **kwargs: Any) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(float(n))), batch_size=4, shuffle=shuffle, **kwargs)


def values(batches: Any) -> list[list[int]]:
    return [[int(v) for v in (b[0] if isinstance(b, list) else b)] for b in batches]


@pytest.fixture
def kernel() -> Iterator[Any]:
    kernel = make_kernel(cpu=True)
    yield kernel
    kernel.end_training()


def test_one_process_gets_the_batches_of_the_users_loader(kernel: Any) -> None:
    prepared = kernel.prepare(loader())
    assert isinstance(prepared, PreparedDataLoader) and len(prepared) == len(loader()) == 6
    assert values(prepared) == values(loader())  # the short last batch too: a map-style loader has its length
    # a stream's last short batch is completed from its first samples (even_batches, as Accelerate does)
    stream = kernel.prepare(DataLoader(Stream(10), batch_size=4))
    assert values(stream) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    uneven = make_kernel(cpu=True, even_batches=False)
    try:
        assert values(uneven.prepare(DataLoader(Stream(10), batch_size=4))) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    finally:
        uneven.end_training()


def test_a_pass_counts_its_batches_and_knows_the_last_one_when_it_is_handed_out(kernel: Any) -> None:
    prepared = kernel.prepare(loader())
    seen = [(int(batch[0][0]), kernel.gradient_state.end_of_dataloader) for batch in prepared]
    assert seen == [(0, False), (4, False), (8, False), (12, False), (16, False), (20, True)]
    # the position a checkpoint would save, batch by batch: once the last batch is out, the next pass's start
    assert [prepared.state_dict()["position"] for _ in prepared] == [1, 2, 3, 4, 5, 0]
    assert not kernel.gradient_state.end_of_dataloader  # the pass ended: no loader is active


def test_a_sampler_shorter_than_its_length_ends_the_pass_with_a_warning(kernel: Any) -> None:
    class Short(torch.utils.data.Sampler[int]):
        def __iter__(self) -> Any:
            return iter(range(6))

        def __len__(self) -> int:
            return 10

    prepared = kernel.prepare(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=2, sampler=Short()))
    assert len(prepared) == 5
    with pytest.warns(RuntimeWarning, match="the dataloader yielded 3 batches, its length says 5"):
        assert values(prepared) == [[0, 1], [2, 3], [4, 5]]

    # one batch short: every batch before the last is handed out, then the last one is not there
    class OneShort(Short):
        def __len__(self) -> int:
            return 8

    prepared = kernel.prepare(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=2, sampler=OneShort()))
    with pytest.warns(RuntimeWarning, match="the dataloader yielded 3 batches, its length says 4"):
        assert values(prepared) == [[0, 1], [2, 3], [4, 5]]


def test_a_shuffled_loader_draws_a_new_order_each_epoch_from_one_seed(kernel: Any) -> None:
    torch.manual_seed(0)
    prepared = kernel.prepare(loader(shuffle=True))
    first, second = values(prepared), values(prepared)
    assert sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(22))
    assert first != second
    torch.manual_seed(0)  # the loader's seed is drawn from torch's generator once, when it is prepared
    again = kernel.prepare(loader(shuffle=True))
    assert values(again) == first and values(again) == second


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_mid_pass_replays_the_rest_of_that_pass(kernel: Any, shuffle: bool, workers: int) -> None:
    torch.manual_seed(1)
    prepared = kernel.prepare(loader(shuffle=shuffle, num_workers=workers))
    values(prepared)  # a first epoch: the state must hold the epoch too
    it = iter(prepared)
    seen = values(next(it) for _ in range(2))
    state = prepared.state_dict()
    rest = values(it)
    assert state["position"] == 2 and state["steps"] == 6 and len(seen) + len(rest) == 6

    torch.manual_seed(99)  # another seed: the order must come from the state
    resumed = kernel.prepare(loader(shuffle=shuffle, num_workers=workers))
    resumed.load_state_dict(state)
    assert values(resumed) == rest
    assert sorted(sum(values(resumed), [])) == list(range(22))  # and then whole epochs again


def test_a_state_of_another_loader_is_refused_in_one_line(kernel: Any) -> None:
    prepared = kernel.prepare(loader(n=22))
    it = iter(prepared)
    next(it)
    state = prepared.state_dict()
    other = kernel.prepare(loader(n=40))
    with pytest.raises(UsageError) as info:
        other.load_state_dict(state)
    assert str(info.value) == (
        "the dataloader had 6 batches per process per epoch when saved and has 10 now (different dataset, batch "
        "size or drop_last)"
    )


def test_skip_first_batches_starts_only_the_next_pass_later(kernel: Any) -> None:
    prepared = kernel.prepare(loader())
    assert skip_first_batches(prepared, 4) is prepared
    assert values(prepared) == values(loader())[4:] and values(prepared) == values(loader())
    plain = skip_first_batches(loader(), 4)
    assert values(plain) == values(loader())[4:] and values(plain) == values(loader())
    stream = skip_first_batches(DataLoader(Stream(10), batch_size=4), 2)
    assert values(stream) == [[8, 9]] and len(values(stream)) == 3


@pytest.mark.parametrize("bad", [-1, True])
def test_skip_first_batches_refuses_a_bad_count_in_one_line(bad: Any) -> None:
    with pytest.raises(UsageError) as info:
        skip_first_batches(loader(), bad)
    assert str(info.value) == f"skip_first_batches needs a number of batches >= 0, got {bad!r}"
    with pytest.raises(TypeError, match="skip_first_batches expects a DataLoader, got list"):
        skip_first_batches([1, 2], 1)


def test_prepare_refuses_what_is_not_a_dataloader(kernel: Any) -> None:
    from accel.data import shard_dataloader

    with pytest.raises(TypeError, match=r"prepare\(\) expects a torch.utils.data.DataLoader, got list"):
        shard_dataloader(kernel, [1, 2])  # type: ignore[arg-type]
