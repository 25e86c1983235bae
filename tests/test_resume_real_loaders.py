"""Exact resume with the dataloaders real scripts use (and Accelerate's skip_first_batches after
load_state): a run saves in the middle of an epoch and goes on; a new process loads that checkpoint and trains to
the same step. The batches it trains on (sample ids and augmented values) and its final parameters must be bitwise
those of the first run. Samples are augmented in the dataset with python's, numpy's and torch's generators, the
model has dropout. Variants: num_workers 0/1/2 with and without persistent workers, map-style and iterable datasets,
shuffling, a WeightedRandomSampler and a DistributedSampler the script makes itself, one process and two (ddp on
gloo), and Accelerate's documented resume (load_state, then skip_first_batches with the position). The variants
share their runs: one run (of one process, or a launch of two) saves every variant in turn, a second one
resumes every variant, each variant with its own seeds, checkpoint and records (and, launched, its own process
group), and each is still asserted by its own test.

The in-process tests at the end show each mechanism on its own, quickly (the samplers' own tests are in
kernel/tests/test_sampling.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from clitools import launch_env
from torch.utils.data import DataLoader, Dataset, TensorDataset

import accel
from accel import Kernel
from accel.errors import UsageError
from accel.testing import run_tree

SCRIPT = Path(__file__).parent / "scripts" / "resume_loaders.py"
ACCEL = Path(sys.executable).parent / "accel"
STEPS, SAVE_AT = "30", "17"  # 13 batches an epoch with one process, 7 with two: the save is mid-epoch either way


def run(
    tmp_path: Path, processes: int, *args: str, check: bool = True, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    cmd = (
        [sys.executable, str(SCRIPT)]
        if processes == 1
        else [str(ACCEL), "launch", "-q", "-n", str(processes), str(SCRIPT)]
    )
    proc = run_tree([*cmd, *args], env=launch_env(tmp_path), cwd=tmp_path, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd + list(args))} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def records(tmp_path: Path, name: str, processes: int) -> list[dict[str, Any]]:
    return [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in range(processes)]


SAVE = ("--steps", STEPS, "--save-at", SAVE_AT, "--ckpt", "ck", "--out", "a")
RESUME = ("--steps", STEPS, "--resume", "--ckpt", "ck", "--out", "b")


def assert_same_end(tmp_path: Path, processes: int, first: str, second: str) -> None:
    """The resumed run (records ``second``) trained on the uninterrupted run's batches after SAVE_AT, bit for bit,
    and ended with the same parameters."""
    for a, b in zip(records(tmp_path, first, processes), records(tmp_path, second, processes), strict=True):
        tail = a["batches"][int(SAVE_AT) :]
        assert len(tail) == len(b["batches"]) == int(STEPS) - int(SAVE_AT)
        for step, (x, y) in enumerate(zip(tail, b["batches"], strict=True), int(SAVE_AT) + 1):
            assert x == y, f"step {step}: uninterrupted {x}, resumed {y}"
        assert a["params"] == b["params"]


ONE_PROCESS = {
    "map-shuffle-w0": ("--workers", "0"),
    "map-shuffle-w1": ("--workers", "1"),
    "map-shuffle-w2": ("--workers", "2"),
    "map-shuffle-w1-persistent": ("--workers", "1", "--persistent"),
    "map-shuffle-w2-persistent": ("--workers", "2", "--persistent"),
    "map-weighted-w0": ("--sampler", "weighted", "--workers", "0"),
    "map-weighted-w2": ("--sampler", "weighted", "--workers", "2"),
    "map-distributed-w0": ("--sampler", "distributed", "--workers", "0"),
    "map-distributed-w2-persistent": ("--sampler", "distributed", "--workers", "2", "--persistent"),
    "iterable-w0": ("--kind", "iterable", "--workers", "0"),
    "iterable-w2": ("--kind", "iterable", "--workers", "2"),
    "accelerate-skip-call-w0": ("--skip-call", "--workers", "0"),
    "accelerate-skip-call-w2": ("--skip-call", "--workers", "2"),
}


Runs = tuple[Path, str, str]  # the folder, the saving run's stderr, the resumed run's stderr


def batched_runs(tmp: Path, variants: dict[str, tuple[str, ...]], processes: int = 1) -> Runs:
    """Every variant saved, then resumed, in two runs (or launches of ``processes``) in all: the script runs the
    variants in turn (``--variants``), each from its own seeds with its own checkpoint and records (``ck-<name>``,
    ``a-<name>`` and ``b-<name>``) and its own Kernel, so no variant is resumed in the process that saved it
    (records identical to a run of the variant alone)."""
    (tmp / "variants.json").write_text(json.dumps({name: list(args) for name, args in variants.items()}))
    first = run(tmp, processes, *SAVE, "--variants", "variants.json", check=False, timeout=400)
    second = run(tmp, processes, *RESUME, "--variants", "variants.json", check=False, timeout=400)
    return tmp, first.stderr, second.stderr


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return batched_runs(tmp_path_factory.mktemp("one_process"), ONE_PROCESS)


def resumed_exactly(runs: Runs, variant: str, processes: int = 1) -> str:
    """Assert that ``variant`` ran without an error and resumed exactly; its stderr in the saving run."""
    tmp, first, second = runs
    saved, resumed = variant_stderr(first, variant), variant_stderr(second, variant)
    assert "Traceback" not in saved + resumed, f"--- saving run\n{saved}\n--- resumed run\n{resumed}"
    assert_same_end(tmp, processes, f"a-{variant}", f"b-{variant}")
    return saved


def variant_stderr(stderr: str, name: str) -> str:
    """What the script printed on stderr while it ran variant ``name`` (after its ``=== variant`` line; the
    sections of every process of a launch, which run the variants in step)."""
    parts = re.split(r"^=== variant (\S+)\n", stderr, flags=re.MULTILINE)
    sections = [text for started, text in zip(parts[1::2], parts[2::2], strict=True) if started == name]
    assert sections, f"variant {name} never started:\n{stderr[-6000:]}"
    return "".join(sections)


@pytest.mark.slow
@pytest.mark.multiprocess  # DataLoader workers and a second process for the resumed run
@pytest.mark.timeout(900)  # the first test also runs the module's two runs of every variant
@pytest.mark.parametrize("variant", sorted(ONE_PROCESS))
def test_exact_resume_one_process(one_process_runs: Runs, variant: str) -> None:
    saved = resumed_exactly(one_process_runs, variant)
    if "iterable" in variant:  # no index to resume at: the batches seen are read again; the save says so
        assert "RuntimeWarning: save_state: the prepared dataloader over AugmentedStream is an iterable" in saved
    else:
        assert "RuntimeWarning" not in saved


TWO_PROCESSES = {
    "map-shuffle-w2-persistent": ("--workers", "2", "--persistent"),
    "map-weighted-w0": ("--sampler", "weighted", "--workers", "0"),
    "map-distributed-w1": ("--sampler", "distributed", "--workers", "1"),
    "iterable-w1": ("--kind", "iterable", "--workers", "1"),
    "accelerate-skip-call-w0": ("--skip-call", "--workers", "0"),
}


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Two launches of 2 processes for every variant: each variant's Kernel ends (its process group destroyed) and
    the next variant's starts a new group (plugins/ddp/tests/test_ddp_regroup.py: that used to hang)."""
    return batched_runs(tmp_path_factory.mktemp("two_processes"), TWO_PROCESSES, processes=2)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)  # the first test also runs the module's two launches of every variant
@pytest.mark.parametrize("variant", sorted(TWO_PROCESSES))
def test_exact_resume_two_processes_ddp(two_process_runs: Runs, variant: str) -> None:
    resumed_exactly(two_process_runs, variant, processes=2)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_negative_control_and_persistent_iterable_workers_warn(tmp_path: Path) -> None:
    """A run that never saves is the run the others save in (save_state changes nothing); a draw after
    load_state makes the resumed run differ (the comparison can fail); an iterable dataset with persistent workers
    cannot be resumed exactly and save_state says so."""
    run(tmp_path, 1, "--steps", STEPS, "--ckpt", "unused", "--out", "u", "--workers", "2")
    run(tmp_path, 1, "--steps", STEPS, "--save-at", SAVE_AT, "--ckpt", "ck", "--out", "a", "--workers", "2")
    run(tmp_path, 1, "--steps", STEPS, "--resume", "--ckpt", "ck", "--out", "b", "--workers", "2", "--disturb")
    (u,), (a,), (b,) = records(tmp_path, "u", 1), records(tmp_path, "a", 1), records(tmp_path, "b", 1)
    assert u == a
    assert a["params"] != b["params"]
    proc = run(
        tmp_path,
        1,
        "--steps",
        SAVE_AT,
        "--save-at",
        SAVE_AT,
        "--ckpt",
        "ck2",
        "--out",
        "c",
        "--kind",
        "iterable",
        "--workers",
        "2",
        "--persistent",
    )
    lines = [line for line in proc.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(lines) == 1 and "has persistent worker processes" in lines[0], proc.stderr


# ---- in-process: each mechanism on its own ------------------------------------------------------------------


class Counting(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def ids(loader: Any) -> list[list[int]]:
    return [b.flatten().tolist() for b in loader]


@pytest.mark.multiprocess
@pytest.mark.parametrize("persistent", [False, True])
def test_skip_first_batches_with_worker_processes(persistent: bool) -> None:
    """torch's multi-process iterator calls iter(batch_sampler) twice and drops the first: the skip survives it,
    on plain and prepared loaders, and only the next pass is shortened."""
    plain = DataLoader(Counting(12), batch_size=2, num_workers=2, persistent_workers=persistent)
    skipped = accel.skip_first_batches(plain, 4)
    assert ids(skipped) == [[8, 9], [10, 11]]
    assert len(ids(skipped)) == 6
    kernel = Kernel(cpu=True)
    dl = kernel.prepare(DataLoader(Counting(12), batch_size=2, num_workers=2, persistent_workers=persistent))
    assert ids(kernel.skip_first_batches(dl, 4)) == [[8, 9], [10, 11]]
    assert len(ids(dl)) == 6


class Noisy(Dataset):
    """Augmentation from torch's global generator in __getitem__."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)]) + torch.rand(1)


def test_global_rng_augmentation_is_not_off_by_one_batch(tmp_path: Path) -> None:
    """Map-style loaders in this process: the next batch is not loaded before save_state, so its draws are not
    in the saved random state (they were, with one batch of look-ahead: the resumed run replayed them)."""

    def fresh() -> tuple[Kernel, Any]:
        torch.manual_seed(0)
        kernel = Kernel(cpu=True)
        return kernel, kernel.prepare(DataLoader(Noisy(), batch_size=4, shuffle=True))

    kernel, dl = fresh()
    straight = [b.tolist() for b in dl]
    kernel, dl = fresh()
    it = iter(dl)
    head = [next(it).tolist() for _ in range(2)]
    kernel.save_state(tmp_path / "ck")
    kernel, dl = fresh()
    kernel.load_state(tmp_path / "ck")
    assert head + [b.tolist() for b in dl] == straight


def test_skip_first_batches_after_load_state_must_agree(tmp_path: Path) -> None:
    kernel = Kernel(cpu=True)
    dl = kernel.prepare(DataLoader(Counting(20), batch_size=2))
    it = iter(dl)
    for _ in range(3):
        next(it)
    kernel.save_state(tmp_path / "ck")
    kernel = Kernel(cpu=True)
    dl = kernel.prepare(DataLoader(Counting(20), batch_size=2))
    kernel.load_state(tmp_path / "ck")
    with pytest.raises(UsageError, match=r"skip_first_batches\(2\) disagrees .* batch 3 of its epoch"):
        kernel.skip_first_batches(dl, 2)
    assert kernel.skip_first_batches(dl, 3) is dl
    assert ids(dl)[0] == [6, 7]  # skipped once, not twice
    assert ids(dl)[0] == [0, 1]


def test_a_sampler_whose_length_lies_is_named() -> None:
    class Short(torch.utils.data.Sampler[int]):
        def __iter__(self) -> Any:
            return iter(range(8))

        def __len__(self) -> int:
            return 4

    kernel = Kernel(cpu=True)
    dl = kernel.prepare(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, sampler=Short()))
    with pytest.raises(UsageError, match="yields more batches than its length"):
        list(dl)


@pytest.mark.multiprocess
def test_unseedable_worker_loading_is_named_at_save_state(tmp_path: Path) -> None:
    """batch_size=None with worker processes: no batch to carry a seed, so save_state says the resume may differ."""
    kernel = Kernel(cpu=True)
    dl = kernel.prepare(DataLoader(Counting(12), batch_size=None, num_workers=2))
    it = iter(dl)
    next(it)
    with pytest.warns(RuntimeWarning, match="batch_size=None"):
        kernel.save_state(tmp_path / "ck")
    del it


@pytest.mark.multiprocess
@pytest.mark.parametrize("reseed", [True, False])
def test_reseed_workers_option(reseed: bool) -> None:
    """Worker processes, a pass resumed 3 batches in (skip_first_batches): by default each batch is loaded with
    seeds of its own, so the resumed batches equal the uninterrupted pass's, augmentation included.
    Kernel(reseed_workers=False) loads through the user's dataset as a plain DataLoader does: the
    same samples, but their augmentation follows torch's per-worker seeding and differs (as documented)."""
    kernel = Kernel(cpu=True, reseed_workers=reseed)
    dl = kernel.prepare(DataLoader(Noisy(), batch_size=4, num_workers=2))
    assert (dl.base.dataset is not dl.dataset) is reseed  # the per-batch seeding wrapper, or the user's dataset
    torch.manual_seed(0)
    straight = [b.flatten().tolist() for b in dl][3:]
    torch.manual_seed(0)
    resumed = [b.flatten().tolist() for b in kernel.skip_first_batches(dl, 3)]
    assert [[int(v) for v in b] for b in resumed] == [[int(v) for v in b] for b in straight]  # the same samples
    assert (resumed == straight) is reseed
