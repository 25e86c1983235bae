"""accel-plugin-ddp with real processes: data sharding, accumulation, collectives, equivalence with one process,
multi-node rendezvous on one host, plain torchrun / python, restarts and the digits example.

Workers live in tests/ddp_scripts/ and write one JSON file per rank; the tests compare the ranks' records.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from accel.testing import free_port, isolated_env, run_launch

SCRIPTS = Path(__file__).parent / "ddp_scripts"
ROOT = Path(__file__).parent.parent
TIMEOUT = 240


def read_ranks(out: Path, world: int = 2) -> list[dict[str, Any]]:
    files = sorted(out.glob("rank*.json"))
    assert [f.name for f in files] == [f"rank{r}.json" for r in range(world)], files
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def launch(tmp: Path, script: str, *args: str, num_processes: int = 2, flags: tuple[str, ...] = (),
           check: bool = True) -> subprocess.CompletedProcess[str]:
    return run_launch(["-q", *flags, str(SCRIPTS / script), *args], num_processes=num_processes, home=tmp / "home",
                      registered=["ddp"], cwd=tmp, timeout=TIMEOUT, check=check)


# ---- one launch of api_checks.py, read by many tests --------------------------------------------------------


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("api")
    out = tmp / "out"
    out.mkdir()
    proc = launch(tmp, "api_checks.py", str(out))
    return {"ranks": read_ranks(out), "out": out, "stdout": proc.stdout}


@pytest.mark.multiprocess
def test_api_run_is_ddp_on_two_processes(api: dict[str, Any]) -> None:
    for r, rec in enumerate(api["ranks"]):
        assert rec["env_world_size"] == "2"
        assert "ddp:strategy" in rec["components"]
        assert rec["collectives"]["process_index"] == r


EVEN_CASES = [(10, 3), (7, 4), (8, 2), (10, 4)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("n,bs", EVEN_CASES)
def test_even_batches_equal_counts_and_gather_for_metrics_exact(api: dict[str, Any], n: int, bs: int) -> None:
    recs = [rec["data"][f"even_{n}_{bs}"] for rec in api["ranks"]]
    locals_ = [rec["epochs"][0]["local"] for rec in recs]
    # every rank iterates the same number of full batches
    assert len(locals_[0]) == len(locals_[1]) == recs[0]["len"] == recs[1]["len"]
    assert all(len(b) == bs for lb in locals_ for b in lb)
    # together the ranks cover the dataset; only the padding (from the epoch's start) is seen twice
    seen = [[i for b in lb for i in b] for lb in locals_]
    assert set(seen[0]) | set(seen[1]) == set(range(n))
    padding = len(seen[0]) + len(seen[1]) - n
    assert padding == len(locals_[0]) * bs * 2 - n < 2 * bs
    dup = sorted(seen[0] + seen[1])
    for i in range(n):
        dup.remove(i)
    assert len(dup) == padding and set(dup) <= set(range(padding))
    # round-robin: rank r gets batches r, r+2, ... of the non-shuffled order
    assert locals_[0][0] == list(range(bs)) and locals_[1][0] == [i % n for i in range(bs, 2 * bs)]
    # gather_for_metrics: exactly len(dataset) items, each once, the same on both ranks
    for rec in recs:
        assert sorted(rec["epochs"][0]["gathered"]) == list(range(n))
        assert rec["epochs"][0]["last_reduce"] == 2
    assert recs[0]["epochs"][0]["gathered"] == recs[1]["epochs"][0]["gathered"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("n,bs", EVEN_CASES)
def test_uneven_batches_disjoint_no_hang_gather_exact(api: dict[str, Any], n: int, bs: int) -> None:
    recs = [rec["data"][f"uneven_{n}_{bs}"] for rec in api["ranks"]]
    seen = [[i for b in rec["epochs"][0]["local"] for i in b] for rec in recs]
    assert not set(seen[0]) & set(seen[1])  # disjoint shards, nothing duplicated
    assert sorted(seen[0] + seen[1]) == list(range(n))
    for rec in recs:
        # every step ran a collective on both ranks (the loop did not hang) and gather_for_metrics has len(dataset)
        assert sorted(rec["epochs"][0]["gathered"]) == list(range(n))
        assert rec["epochs"][0]["last_reduce"] == 2
    if (n, bs) == (10, 4):  # 3 batches: rank 1 runs out first and gets an empty batch instead of hanging
        assert [len(b) for b in recs[0]["epochs"][0]["local"]] == [4, 2]
        assert [len(b) for b in recs[1]["epochs"][0]["local"]] == [4, 0]


@pytest.mark.multiprocess
def test_shuffle_ranks_agree_on_the_permutation(api: dict[str, Any]) -> None:
    recs = [rec["data"]["shuffle_10_3"] for rec in api["ranks"]]
    epochs = []
    for e in range(2):
        gathered = [rec["epochs"][e]["gathered"] for rec in recs]
        assert gathered[0] == gathered[1]
        assert sorted(gathered[0]) == list(range(10))  # a permutation: each item exactly once
        seen = [[i for b in rec["epochs"][e]["local"] for i in b] for rec in recs]
        assert set(seen[0]) | set(seen[1]) == set(range(10))
        # what each rank iterated is its slice of the shared permutation (rank r: batches r, r+2, ...)
        order = [i for pair in zip(recs[0]["epochs"][e]["local"], recs[1]["epochs"][e]["local"], strict=True) for b in pair for i in b]
        assert order[:10] == gathered[0]
        epochs.append(gathered[0])
    assert epochs[0] != list(range(10))  # really shuffled
    assert epochs[0] != epochs[1]  # reseeded per epoch


@pytest.mark.multiprocess
def test_accumulate_one_allreduce_per_optimizer_step(api: dict[str, Any]) -> None:
    for rec in api["ranks"]:
        acc = rec["accumulate"]
        assert acc["model_type"] == "DistributedDataParallel"
        steps = acc["steps"]
        assert [s["sync"] for s in steps] == [False, False, False, True] * 2
        # one bucket for this small model: the comm hook fires once per optimizer step and never in between
        assert [s["allreduces"] for s in steps] == [0, 0, 0, 1] * 2
        assert acc["total_allreduces"] == 2
        # clip_grad_norm_ does nothing (returns None) on accumulation steps, returns the norm on sync steps
        assert [s["norm"] is None for s in steps] == [True, True, True, False] * 2
        assert all(s["norm"] > 0 for s in steps if s["sync"])
        # local gradients differ between ranks until the all-reduce, then they are identical
        assert [s["grads_equal_across_ranks"] for s in steps] == [False, False, False, True] * 2
    assert [s["norm"] for s in api["ranks"][0]["accumulate"]["steps"]] == \
        [s["norm"] for s in api["ranks"][1]["accumulate"]["steps"]]


@pytest.mark.multiprocess
def test_process_properties(api: dict[str, Any]) -> None:
    for r, rec in enumerate(api["ranks"]):
        c = rec["collectives"]
        assert (c["process_index"], c["local_process_index"], c["num_processes"]) == (r, r, 2)
        assert c["is_main_process"] is (r == 0)
        assert c["is_local_main_process"] is (r == 0)
        assert c["device"] == "cpu"


@pytest.mark.multiprocess
def test_gather_reduce_pad_broadcast(api: dict[str, Any]) -> None:
    for r, rec in enumerate(api["ranks"]):
        c = rec["collectives"]
        assert c["gather_rows"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]  # 1 row from rank 0, 2 from rank 1
        assert c["gather_nested"] == {"a": [0, 1], "b": [[0, 0], [1, 1]]}
        assert c["gather_scalar"] == [0.0, 1.0]
        assert c["reduce"] == {"sum": [3.0, 30.0], "mean": [1.5, 15.0], "max": [2.0, 20.0]}
        assert c["reduce_input_untouched"] == [r + 1.0, 10.0 * (r + 1)]
        assert c["pad"] == ([0, 1, -1] if r == 0 else [0, 1, 2])
        assert c["pad_first"] == ([-1, 0, 1] if r == 0 else [0, 1, 2])
        assert c["pad_dim1"] == ([[1.0, 0.0], [1.0, 0.0]] if r == 0 else [[1.0, 1.0], [1.0, 1.0]])
        assert c["broadcast_tensor"] == [7, 8]
        assert c["broadcast_from_1"] == [1.0]
        assert c["broadcast_object"] == {"rank": 0, "words": ["x"]}


@pytest.mark.multiprocess
def test_split_between_processes(api: dict[str, Any]) -> None:
    s0, s1 = (rec["collectives"]["split"] for rec in api["ranks"])
    assert (s0["list5"], s1["list5"]) == ([0, 1, 2], [3, 4])
    assert (s0["list5_padded"], s1["list5_padded"]) == ([0, 1, 2], [3, 4, 4])
    assert (s0["list4"], s1["list4"]) == ([0, 1], [2, 3])
    assert s0["dict"] == {"a": [0, 1, 2], "b": ["p", "q", "r"]}
    assert s1["dict"] == {"a": [3, 4], "b": ["s", "t"]}
    assert (s0["tensor"], s1["tensor"]) == ([0, 1, 2], [3, 4])
    assert (s0["tensor_padded"], s1["tensor_padded"]) == ([0, 1, 2], [3, 4, 4])


@pytest.mark.multiprocess
def test_wait_for_everyone_and_main_process_first(api: dict[str, Any]) -> None:
    assert all(rec["collectives"]["saw_late_marker"] for rec in api["ranks"])
    lines = (api["out"] / "order.txt").read_text().splitlines()
    assert lines == ["0 in", "0 out", "1 in", "1 out"]


@pytest.mark.multiprocess
def test_on_main_process_logging_and_print(api: dict[str, Any]) -> None:
    main, other = (rec["collectives"]["on_main_process"] for rec in api["ranks"])
    assert main == {"returned": 42, "ran": [21]}
    assert other == {"returned": None, "ran": []}
    log0 = (api["out"] / "log_rank0.txt").read_text()
    log1 = (api["out"] / "log_rank1.txt").read_text()
    assert "from main only" in log0 and "from main only" not in log1
    assert "warning main only" in log0 and "warning main only" not in log1
    assert "from every process" in log0 and "from every process" in log1
    assert "[RANK 1]" in log1  # messages say which process wrote them
    assert api["stdout"].count("KERNEL-PRINT-MARKER") == 1


# ---- training: 2 processes = 1 process on the global batch ---------------------------------------------------


def check_mapping_and_params(two: list[dict[str, Any]], one: dict[str, Any], b: int) -> None:
    """Global step i on 2 ranks = batches 2i and 2i+1 (size b each) = the 1-process batch i of size 2b."""
    assert [r["world"] for r in two] == [2, 2] and one["world"] == 1
    assert two[0]["wrapped"] == "DistributedDataParallel" and one["wrapped"] != "DistributedDataParallel"
    assert two[0]["steps"] == two[1]["steps"]
    assert len(two[0]["steps"]) == len(one["steps"]) > 1
    for i, (step2, step1) in enumerate(zip(two[0]["steps"], one["steps"], strict=True)):
        assert step2 == list(range(2 * i * b, (2 * i + 2) * b)) == step1
    assert two[0]["params"] == two[1]["params"]  # the replicas stayed identical
    for key, value in one["params"].items():
        assert torch.allclose(torch.tensor(two[0]["params"][key]), torch.tensor(value), atol=1e-6), key


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``python train_equiv.py`` with batch size 6: one process, kernel only (no launcher, no process group)."""
    tmp = tmp_path_factory.mktemp("one")
    out = tmp / "out"
    env = isolated_env(tmp / "home")
    subprocess.run([sys.executable, str(SCRIPTS / "train_equiv.py"), str(out), "--batch_size", "6"], env=env,
                   cwd=tmp, check=True, timeout=TIMEOUT, capture_output=True, text=True)
    (rec,) = read_ranks(out, world=1)
    assert rec["env_world_size"] is None and "ddp:strategy" not in rec["components"]
    return rec


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_process_ddp_equals_one_process_on_the_global_batch(tmp_path: Path, one_process: dict[str, Any]) -> None:
    out = tmp_path / "out"
    launch(tmp_path, "train_equiv.py", str(out), "--batch_size", "3")
    check_mapping_and_params(read_ranks(out), one_process, b=3)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_plain_torchrun_activates_ddp(tmp_path: Path, one_process: dict[str, Any]) -> None:
    """No accel launch: torchrun's WORLD_SIZE=2 is enough for the ddp plugin to take over."""
    out = tmp_path / "out"
    env = isolated_env(tmp_path / "home", registered=["ddp"])
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    str(SCRIPTS / "train_equiv.py"), str(out), "--batch_size", "3"], env=env, cwd=tmp_path,
                   check=True, timeout=TIMEOUT, capture_output=True, text=True)
    two = read_ranks(out)
    assert all("ddp:strategy" in r["components"] for r in two)
    check_mapping_and_params(two, one_process, b=3)


def launch_two_machines(tmp: Path, out: Path, rdzv: tuple[str, ...]) -> list[subprocess.CompletedProcess[str]]:
    port = free_port()
    procs = []
    for machine in (0, 1):
        cmd = [sys.executable, "-m", "accel.commands.launch", "-q", "--num_machines", "2", "--machine_rank",
               str(machine), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), *rdzv,
               "-n", "2", str(SCRIPTS / "train_equiv.py"), str(out), "--batch_size", "3"]
        env = isolated_env(tmp / "home", registered=["ddp"])
        procs.append(subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, stdin=subprocess.DEVNULL))
    results = []
    for proc in procs:
        try:
            stdout, _ = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, ""))
    for res in results:
        assert res.returncode == 0, res.stdout[-4000:]
    return results


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("rdzv", [(), ("--rdzv_backend", "c10d")], ids=["static", "c10d"])
def test_two_machines_on_one_host_train_together(tmp_path: Path, one_process: dict[str, Any],
                                                 rdzv: tuple[str, ...]) -> None:
    out = tmp_path / "out"
    launch_two_machines(tmp_path, out, rdzv)
    two = read_ranks(out)  # one process per machine; with c10d either launcher may hold rank 0
    assert [r["rank"] for r in two] == [0, 1]
    check_mapping_and_params(two, one_process, b=3)


# ---- restarts --------------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_max_restarts_recovers_from_a_failed_first_attempt(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    launch(tmp_path, "flaky.py", str(out), "once", flags=("--max_restarts", "1", "--monitor_interval", "0.5"))
    assert (out / "failed_once").exists()
    recs = read_ranks(out)
    assert [(r["world"], r["restart"], r["sum"]) for r in recs] == [(2, "1", [3])] * 2
    for r in range(2):
        assert (out / f"attempts_rank{r}.txt").read_text().splitlines() == ["restart 0", "restart 1"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_script_that_always_fails_makes_launch_fail(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = launch(tmp_path, "flaky.py", str(out), "always", check=False,
                  flags=("--max_restarts", "1", "--monitor_interval", "0.5"))
    assert proc.returncode != 0
    assert not list(out.glob("rank*.json"))
    # it was tried twice (the first attempt and one restart), then gave up
    assert (out / "attempts_rank1.txt").read_text().splitlines() == ["restart 0", "restart 1"]


# ---- the example ---------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_digits_example_on_two_processes_learns(tmp_path: Path) -> None:
    proc = run_launch(["-q", str(ROOT / "examples" / "train_digits.py")], num_processes=2, home=tmp_path / "home",
                      registered=["ddp"], cwd=tmp_path, timeout=TIMEOUT)
    found = re.findall(r"accuracy ([0-9.]+) on (\d+) test images \(2 processes\)", proc.stdout)
    assert found, proc.stdout[-2000:]
    accuracy, total = float(found[-1][0]), int(found[-1][1])
    assert total == 297  # gather_for_metrics: every test image exactly once
    assert accuracy >= 0.8, proc.stdout
