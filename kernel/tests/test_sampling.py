"""accel.sampling: how the prepared dataloader's samplers share an epoch between processes and make it replayable.
Every process's batches together are the dataset, each sample once (without even_batches) or completed from the
epoch's first samples (with it: every process gets as many full batches); the same seed and epoch give the same
order on every process and the next epoch another; a resumed pass skips batches without loading them; a batch's
worker seed does not depend on which worker loads it; and the random states are read and restored exactly."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, SequentialSampler

from accel.errors import UsageError
from accel.sampling import (
    BatchSamplerShard,
    IterableDatasetShard,
    Padding,
    SeedableRandomSampler,
    SeededBatch,
    SkipBatchSampler,
    WorkerSeededDataset,
    seed_everything,
)


def batches(n: int, size: int, drop_last: bool = False) -> BatchSampler:
    return BatchSampler(SequentialSampler(range(n)), size, drop_last)


def shards(n: int, size: int, processes: int, **kwargs: Any) -> list[list[list[int]]]:
    """Each process's batches of a pass over ``range(n)`` in batches of ``size``."""
    out = []
    drop_last = kwargs.pop("drop_last", False)
    for rank in range(processes):
        shard = BatchSamplerShard(batches(n, size, drop_last), processes, rank, **kwargs)
        out.append([list(b) for b in shard])
        assert len(out[-1]) == len(shard), (rank, out[-1])
    return out


@pytest.mark.parametrize("n", [0, 1, 7, 8, 12, 13, 25])
@pytest.mark.parametrize("processes", [1, 2, 3, 4])
def test_without_even_batches_the_shards_are_disjoint_and_cover_the_dataset(n: int, processes: int) -> None:
    parts = shards(n, 4, processes, even_batches=False)
    samples = [i for part in parts for batch in part for i in batch]
    assert sorted(samples) == list(range(n))  # every sample once, none twice
    counts = [len(part) for part in parts]
    assert max(counts, default=0) - min(counts, default=0) <= 1  # batches dealt round-robin


@pytest.mark.parametrize("n", [1, 7, 8, 12, 13, 25])
@pytest.mark.parametrize("processes", [2, 3, 4])
def test_with_even_batches_every_process_gets_as_many_full_batches(n: int, processes: int) -> None:
    """The dataset is covered, each process gets the same number of batches of the full size, and what completes
    them are the epoch's first samples, in order."""
    parts = shards(n, 4, processes, even_batches=True)
    assert len({len(part) for part in parts}) == 1
    assert all(len(batch) == 4 for part in parts for batch in part)
    samples = Counter(i for part in parts for batch in part for i in batch)
    assert set(samples) == set(range(n))
    extra = sum(samples.values()) - n
    assert extra < 4 * processes
    fill = [i for _ in range(extra // max(n, 1) + 2) for i in range(n)][:extra]  # the first samples, cycled
    assert sorted(i for i, c in samples.items() for _ in range(c - 1)) == sorted(fill)


def test_drop_last_leaves_the_incomplete_group_out() -> None:
    parts = shards(13, 4, 2, even_batches=True, drop_last=True)
    assert parts == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]


def test_split_batches_slices_every_batch() -> None:
    parts = shards(10, 4, 2, split_batches=True)
    assert parts == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]  # the last batch completed from the first
    with pytest.raises(UsageError, match=r"needs a batch size that divides by the number of processes \(3\)"):
        BatchSamplerShard(batches(10, 4), 3, 0, split_batches=True)


@pytest.mark.parametrize("n", [0, 3, 8, 11, 16, 17])
@pytest.mark.parametrize("even", [False, True])
def test_iterable_shards_are_disjoint_and_cover_the_stream(n: int, even: bool) -> None:
    parts = [list(IterableDatasetShard(range(n), 4, 2, rank, even_batches=even)) for rank in range(2)]
    real = [[x for x in part if not isinstance(x, Padding)] for part in parts]
    if even:
        assert len(parts[0]) == len(parts[1]) and all(len(p) % 4 == 0 for p in parts)
        assert set(real[0] + real[1]) == set(range(n))
    else:
        assert sorted(real[0] + real[1]) == list(range(n))
        # as many batches each: the process that ran out gets a batch of padding while the other reads its last one
        assert -(-len(parts[0]) // 4) == -(-len(parts[1]) // 4)


def test_the_same_seed_and_epoch_give_the_same_order_on_every_process() -> None:
    data = range(50)
    a, b = SeedableRandomSampler(data, seed=7), SeedableRandomSampler(data, seed=7)
    first = list(a)
    assert first == list(b) and sorted(first) == list(data)  # a permutation, the same in both "processes"
    second = list(a)  # the epoch advances after a full pass
    assert second != first and sorted(second) == list(data) and a.epoch == 2
    assert list(SeedableRandomSampler(data, seed=8)) != first
    c = SeedableRandomSampler(data, seed=0)
    c.load_state_dict({"seed": 7, "epoch": 1})
    assert c.state_dict() == {"seed": 7, "epoch": 1} and list(c) == second
    assert len(list(SeedableRandomSampler(data, seed=7, num_samples=80, replacement=True))) == 80


def test_a_shuffled_epoch_is_shared_without_overlap() -> None:
    """What the prepared loader builds: one seeded permutation, its batches dealt between the processes."""
    parts = []
    for rank in range(3):
        sampler = BatchSampler(SeedableRandomSampler(range(30), seed=3), 4, False)
        parts.append([i for batch in BatchSamplerShard(sampler, 3, rank, even_batches=False) for i in batch])
    assert sorted(parts[0] + parts[1] + parts[2]) == list(range(30))
    assert parts[0] + parts[1] + parts[2] != list(range(30))


def test_skipped_batches_are_drawn_but_not_handed_out() -> None:
    inner = batches(10, 2)
    skip = SkipBatchSampler(inner, skip=3)
    assert [list(b) for b in skip] == [[6, 7], [8, 9]] and len(skip) == 2
    assert [list(b) for b in skip] == [[6, 7], [8, 9]]  # every pass, unless `once`
    once = SkipBatchSampler(inner, skip=3, once=True)
    assert len(list(once)) == 2 and len(list(once)) == 5
    assert skip.batch_size == 2  # the inner sampler's attributes


def test_a_batchs_worker_seed_depends_on_its_number_not_its_worker() -> None:
    skip = SkipBatchSampler(batches(10, 2), skip=2)
    skip.worker_seed = 1234
    resumed = list(skip)
    full = [list(b) for b in batches(10, 2)]
    assert all(isinstance(b, SeededBatch) for b in resumed)
    assert [b.seed for b in resumed] == [SeededBatch(b, 1234, i).seed for i, b in enumerate(full) if i >= 2]
    assert len({b.seed for b in resumed}) == len(resumed)

    class Noisy(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> float:
            return i + random.random() + torch.rand(()).item()

    loaded = WorkerSeededDataset(Noisy())
    assert loaded.__getitems__(resumed[0]) == loaded.__getitems__(SeededBatch(list(resumed[0]), 1234, 2))
    assert loaded.__getitems__(resumed[0]) != loaded.__getitems__(resumed[1])


def test_seed_everything_repeats_every_generator() -> None:
    np = pytest.importorskip("numpy")
    draws = []
    for _ in range(2):
        seed_everything(2**40 + 5)
        draws.append((random.random(), float(np.random.rand()), torch.rand(()).item()))
    assert draws[0] == draws[1]
    seed_everything(6)
    assert (random.random(), float(np.random.rand()), torch.rand(()).item()) != draws[0]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("even", [False, True])
def test_one_process_iterable_shard_takes_the_fast_path_to_the_same_samples(drop_last: bool, even: bool) -> None:
    """One process reads an iterable dataset without grouping samples (the grouping cost ~8 % of a fast
    loader's throughput); what it hands out is what the general path hands out, short last group included."""
    from accel.sampling import IterableDatasetShard

    for n in range(11):
        shard = IterableDatasetShard(list(range(n)), 4, 1, 0, drop_last, even)
        fast = list(shard)
        assert shard.seen == n
        general = list(shard._share())
        if drop_last:  # the general path leaves the short group out; the DataLoader drops that batch either way
            fast = fast[: len(fast) - len(fast) % 4]
        assert fast == general, (n, fast, general)


def test_random_states_leave_numpy_random_alone_until_it_is_loaded() -> None:
    """The prepared loader of an iterable dataset reads the random states before every batch it reads
    ahead. numpy 2 loads ``numpy.random`` on first use; until then nothing drew from its global generator, so its
    state (50 µs a read) is not read, and reading the others does not load it. Once loaded, it is saved as before."""
    code = (
        "import sys, torch\n"
        "from accel.sampling import rng_states\n"
        "print('numpy' in rng_states(), 'numpy.random' in sys.modules)\n"
        "import numpy.random\n"
        "numpy.random.seed(3)\n"
        "states = rng_states()\n"
        "first = numpy.random.rand(5)\n"
        "from accel.sampling import set_rng_states\n"
        "set_rng_states(states)\n"
        "print('numpy' in states, bool((numpy.random.rand(5) == first).all()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False", "True", "True"], out


def test_numpy_state_read_through_its_words_is_numpy_own() -> None:
    """numpy's global state is read again only when its raw words changed or a cached gaussian was
    pending (``randn`` uses that up without drawing); every read must equal ``numpy.random.get_state()``."""
    np = pytest.importorskip("numpy")
    from accel.sampling import _numpy_read, _numpy_state

    def same(a: Any, b: Any) -> bool:
        return bool(a[0] == b[0] and (a[1] == b[1]).all() and a[2:] == b[2:])

    np.random.seed(1)
    start = np.random.get_state()
    steps = [
        lambda: None,
        lambda: np.random.rand(3),
        lambda: None,
        lambda: np.random.randn(),  # draws two gaussians, caches one
        lambda: None,
        lambda: np.random.randn(),  # uses the cached one: no words change
        lambda: None,
        lambda: np.random.seed(1),
        lambda: np.random.randint(5),
        lambda: np.random.set_state(start),
        lambda: np.random.random(700),  # past the 624 words: numpy regenerates them
    ]
    for step in steps:
        step()
        assert same(_numpy_state(np.random), np.random.get_state())
    assert _numpy_read.usable  # the words were read (not a full read every time)


def test_python_state_read_through_its_words_is_pythons_own() -> None:
    """python's global ``random`` state is read again only when its raw words changed; the cached gaussian
    is taken as it is at each read (``gauss()`` uses it up without drawing). Every read must equal
    ``random.getstate()``."""
    import random

    from accel.sampling import _python_read, _python_state

    random.seed(1)
    start = random.getstate()
    steps = [
        lambda: None,
        lambda: random.random(),
        lambda: None,
        lambda: random.gauss(),  # draws two, caches one
        lambda: None,
        lambda: random.gauss(),  # uses the cached one: no words change
        lambda: None,
        lambda: random.seed(1),
        lambda: random.randint(0, 5),
        lambda: random.setstate(start),
        lambda: random.getrandbits(32 * 700),  # past the 624 words: python regenerates them
        lambda: random.seed(2),
    ]
    for step in steps:
        step()
        assert _python_state() == random.getstate()
    assert _python_read.usable  # the words were read (not a full read every time)
    reads = _python_read.state
    assert _python_state() is reads  # unchanged: the last read, not a new one
