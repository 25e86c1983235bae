"""The Kernel API and the DDP plugin on real processes (gloo on 127.0.0.1).

Workers live in tests/scripts/ and write one JSON file per process; the tests assert on those files. Every
multi-process run goes through the venv's ``accel`` executable (or plain torchrun / python where that is the point).
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from accel.distributed import first_slurm_host

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
ACCEL = Path(sys.executable).with_name("accel")
TIMEOUT = 240

multiprocess = pytest.mark.multiprocess


def free_port(lo: int = 0, hi: int = 0) -> int:
    """A port nobody listens on now: any (lo=hi=0) or one in [lo, hi)."""
    for _ in range(200):
        port = random.randrange(lo, hi) if hi else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise RuntimeError("no free port")


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """This environment without launcher/SLURM/accel variables, with a private ACCEL_HOME."""
    drop = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in drop and not k.startswith(("SLURM_", "ACCEL_", "ACCELERATE_", "TORCHELASTIC_"))
    }
    env.update(ACCEL_HOME=str(home), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def run(cmd: list[str], env: dict[str, str], expect_ok: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    if expect_ok and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
            f"--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def ranks(out: Path, expected: int) -> dict[int, dict[str, Any]]:
    files = sorted(out.glob("rank*.json"))
    found = {int(f.stem[4:]): json.loads(f.read_text()) for f in files}
    assert sorted(found) == list(range(expected)), f"result files: {[f.name for f in files]}"
    return found


def assert_same_params(got: dict[str, Any], reference: dict[str, Any]) -> None:
    """Both trainings (plain and with 2 accumulation steps) end with the parameters of the one-process run."""
    for mode in ("plain", "accumulate"):
        assert got[mode]["in_sync"], f"{mode}: processes disagree on the parameters"
        assert got[mode]["optimizer_steps"] == reference[mode]["optimizer_steps"]
        assert got[mode]["lr"] == pytest.approx(reference[mode]["lr"])
        torch.testing.assert_close(
            torch.tensor(got[mode]["params"]),
            torch.tensor(reference[mode]["params"]),
            atol=1e-6,
            rtol=0,
            msg=lambda m, mode=mode: f"{mode}: {m}",
        )


# ---- SLURM translation (unit) ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node07", "node07"),
        ("gpu1,gpu2", "gpu1"),
        ("node[03-05,7],gpu1", "node03"),
        ("node[7,3-5]", "node7"),
        ("rack1-n[0012-0015]-ib", "rack1-n0012-ib"),
        ("a[1-2],b[3-4]", "a1"),
        ("127.0.0.[1-2]", "127.0.0.1"),
    ],
)
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


# ---- one-process reference ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """train_equiv.py under plain `python script.py`: one process, kernel alone, same global batches."""
    tmp = tmp_path_factory.mktemp("reference")
    run([sys.executable, str(SCRIPTS / "train_equiv.py"), str(tmp / "out")], clean_env(tmp / "home"))
    return ranks(tmp / "out", 1)[0]


def test_script_runs_under_plain_python(reference: dict[str, Any]) -> None:
    assert reference["num_processes"] == 1 and reference["process_index"] == 0
    assert reference["components"] == []  # no plugin activates for one plain process
    assert reference["plain"]["model_type"] == "Sequential"
    assert reference["plain"]["optimizer_steps"] == 24  # 96 samples / global batch 8, 2 epochs
    assert reference["accumulate"]["optimizer_steps"] == 24


# ---- the Kernel API on two processes (one launch, many checks) ------------------------------------------------


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("checks")
    out = tmp / "out"
    out.mkdir()
    proc = run([str(ACCEL), "launch", "-n", "2", str(SCRIPTS / "dist_checks.py"), str(out)], clean_env(tmp / "home"))
    return {"ranks": ranks(out, 2), "stdout": proc.stdout, "out": out}


@pytest.mark.smoke
@multiprocess
def test_topology_on_two_processes(checks: dict[str, Any]) -> None:
    for r, res in checks["ranks"].items():
        top = res["topology"]
        assert top["process_index"] == r and top["local_process_index"] == r and top["num_processes"] == 2
        assert top["is_main_process"] == (r == 0) and top["is_local_main_process"] == (r == 0)
        assert top["is_last_process"] == (r == 1)
        assert top["env"] == {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"}
        assert top["components"] == ["ddp:strategy"] and top["device"] == "cpu"


@pytest.mark.smoke
@multiprocess
def test_gather_reduce_pad_broadcast_on_two_processes(checks: dict[str, Any]) -> None:
    for r, res in checks["ranks"].items():
        c = res["collectives"]
        assert c["gather_uneven"] == [0, 10, 11]  # rank 0 has 1 row, rank 1 has 2
        assert c["gather_scalar"] == [0.0, 1.0]
        assert c["gather_nested"] == {"a": [0, 1], "b": [[[0, 0], [1, 1]]]}
        assert c["gather_object"] == ["r0", "r1"]
        assert c["reduce_sum"] == [3.0, 30.0]
        assert c["reduce_mean"] == [1.5, 15.0]
        assert c["reduce_max"] == [2.0, 20.0]
        assert c["reduce_sum_scaled"] == [1.5, 15.0]
        assert c["reduce_nested"] == {"x": [3]}
        assert c["reduce_input_after"] == [float(r + 1), float(10 * (r + 1))]  # inputs untouched
        assert c["pad"] == ([[1, 1], [-1, -1]] if r == 0 else [[2, 2], [2, 2]])
        assert c["pad_first"] == ([-1, 0] if r == 0 else [0, 1])
        assert c["pad_dim1"] == ([[1.0, 0.0]] if r == 0 else [[1.0, 1.0]])
        assert c["pad_then_gather"] == [0, -1, 0, 1]
        assert c["broadcast_from_1"] == [2.0, 2.0, 2.0]
        assert c["broadcast_nested"] == {"w": [0.0, 0.0], "n": [0]}
        assert c["broadcast_object"] == {"seed": 3, "name": "rank0"}


@multiprocess
def test_split_between_processes_on_two_processes(checks: dict[str, Any]) -> None:
    c0, c1 = (checks["ranks"][r]["collectives"] for r in (0, 1))
    assert (c0["split_list"], c1["split_list"]) == ([0, 1, 2], [3, 4])
    assert (c0["split_list_padded"], c1["split_list_padded"]) == ([0, 1, 2], [3, 4, 4])
    assert (c0["split_tensor"], c1["split_tensor"]) == ([0, 1, 2], [3, 4, 5])
    assert (c0["split_tensor_padded"], c1["split_tensor_padded"]) == ([0, 1, 2], [3, 4, 4])
    assert c0["split_dict"] == {"a": [1, 2], "b": [0, 1]} and c1["split_dict"] == {"a": [3, 4], "b": [2, 3]}


@multiprocess
def test_wait_main_first_decorators_print_logger_save(checks: dict[str, Any]) -> None:
    c0, c1 = (checks["ranks"][r]["coordination"] for r in (0, 1))
    assert c0["marker_seen_after_wait"] and c1["marker_seen_after_wait"]  # written by rank 1 after a 1 s sleep
    assert c1["first_marker_seen_inside"]  # rank 1 entered the block only after the main process left it
    assert (c0["on_main_process"], c1["on_main_process"]) == (100, None)
    assert (c0["on_local_main_process"], c1["on_local_main_process"]) == (200, None)
    assert (c0["on_last_process"], c1["on_last_process"]) == (None, 301)
    assert (c0["on_process_1"], c1["on_process_1"]) == (None, 401)
    assert "KERNEL-PRINT from process 0" in checks["stdout"]
    assert "KERNEL-PRINT from process 1" not in checks["stdout"]
    assert c0["logged"] == ["[RANK 0] main only", "[RANK 0] every process", "[RANK 0] in order"]
    assert c1["logged"] == ["[RANK 1] every process", "[RANK 1] in order"]
    assert c0["saved_files"] == c1["saved_files"] == ["saved_by_rank0.safetensors"]  # main process only
    from safetensors.torch import load_file

    assert load_file(str(checks["out"] / "saved_by_rank0.safetensors"))["w"].tolist() == [0.0, 0.0]


GATHER_CASES = ["10_3", "7_4", "8_2", "12_3", "9_3", "3_4"]


@multiprocess
@pytest.mark.parametrize("case", GATHER_CASES)
@pytest.mark.parametrize("mode", ["even", "uneven"])
def test_gather_for_metrics_returns_each_item_exactly_once(checks: dict[str, Any], case: str, mode: str) -> None:
    n = int(case.split("_")[0])
    for res in checks["ranks"].values():
        got = res["sharding"][f"{mode}_{case}"]["gathered"]
        assert len(got) == n
        assert sorted(got) == list(range(n))


@multiprocess
@pytest.mark.parametrize("case", GATHER_CASES)
def test_even_batches_gives_equal_full_batches(checks: dict[str, Any], case: str) -> None:
    n, bs = map(int, case.split("_"))
    b0, b1 = (checks["ranks"][r]["sharding"][f"even_{case}"] for r in (0, 1))
    assert len(b0["batches"]) == len(b1["batches"]) == b0["len"] == b1["len"]
    assert all(len(b) == bs for b in b0["batches"] + b1["batches"])  # completed from the start of the data
    seen = [i for b in b0["batches"] + b1["batches"] for i in b]
    assert set(seen) == set(range(n))
    # only the padding is seen twice, and it is taken from the start of the data
    padding = len(seen) - n
    assert 0 <= padding < 2 * bs
    repeated = sorted(seen)
    for i in range(n):
        repeated.remove(i)
    assert repeated == sorted(i % n for i in range(padding))
    if n % (2 * bs) == 0:  # divisible: disjoint shards, nothing repeated; rank r takes batches r, r+2, ...
        assert sorted(seen) == list(range(n))
        for r, b in enumerate((b0, b1)):
            assert b["batches"] == [list(range((2 * j + r) * bs, (2 * j + r + 1) * bs)) for j in range(b["len"])]
    if case == "10_3":  # as Accelerate: the last short batch is completed from the start of the data
        assert (b0["batches"], b1["batches"]) == ([[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]])


@multiprocess
@pytest.mark.parametrize("case", GATHER_CASES)
def test_uneven_batches_are_disjoint_and_do_not_hang(checks: dict[str, Any], case: str) -> None:
    n, _ = map(int, case.split("_"))
    b0, b1 = (checks["ranks"][r]["sharding"][f"uneven_{case}"] for r in (0, 1))
    seen = [i for b in b0["batches"] + b1["batches"] for i in b]
    assert sorted(seen) == list(range(n))  # every item once: no padding duplicates
    # Both processes ran the same number of steps (a rank that ran out got empty batches), so the collective in
    # every step of the worker's loop was matched and nothing hung.
    assert len(b0["batches"]) == len(b1["batches"])


@multiprocess
def test_uneven_batches_with_unequal_counts(checks: dict[str, Any]) -> None:
    b1 = checks["ranks"][1]["sharding"]["uneven_9_3"]["batches"]
    assert b1 == [[3, 4, 5], []]  # 3 batches over 2 processes: the second has only one real batch
    training = [checks["ranks"][r]["uneven_training"] for r in (0, 1)]
    assert training[0]["rows"] == [3, 3] and training[1]["rows"] == [3, 0]
    assert all(t["finite"] for t in training)
    assert training[0]["all_params"][0] == training[0]["all_params"][1] == training[1]["params"]


@multiprocess
def test_shuffled_and_iterable_loaders_on_two_processes(checks: dict[str, Any]) -> None:
    b0, b1 = (checks["ranks"][r]["sharding"]["even_shuffle_10_3"] for r in (0, 1))
    assert b0["gathered"] == b1["gathered"] and sorted(b0["gathered"]) == list(range(10))
    assert b0["gathered"] != list(range(10))  # shuffled, with the same permutation on both processes
    assert not set(b0["batches"][0]) & set(b1["batches"][0])
    for e0, e1 in zip(b0["epochs"], b1["epochs"], strict=True):  # each process iterates its slice: batches r, r+2, ...
        order = [i for pair in zip(e0["batches"], e1["batches"], strict=True) for b in pair for i in b]
        assert order[:10] == e0["gathered"] == e1["gathered"]
    assert b0["epochs"][0]["gathered"] != b0["epochs"][1]["gathered"]  # reshuffled in each epoch
    for mode in ("even", "uneven"):
        i0, i1 = (checks["ranks"][r]["sharding"][f"{mode}_iterable_10_3"] for r in (0, 1))
        assert sorted(i0["gathered"]) == list(range(10)) and i0["gathered"] == i1["gathered"]


@pytest.mark.smoke
@multiprocess
def test_accumulate_all_reduces_once_per_optimizer_step(checks: dict[str, Any]) -> None:
    for res in checks["ranks"].values():
        acc = res["accumulation"]
        assert acc["model_type"] == "DistributedDataParallel"
        expected_sync = [False, False, False, True, False, False, False, True, False, True]
        assert acc["syncs"] == expected_sync
        # local gradients differ between processes until the all-reduce, then they are identical
        assert acc["grads_equal_across_processes"] == expected_sync
        assert acc["optimizer_steps"] == 3
        # The comm hook fired exactly on the sync micro-batches (4, 8 and the last one): one all-reduce per step.
        assert acc["hook_calls"] == [4, 8, 10]
        assert acc["params_equal_everywhere"]


@pytest.mark.smoke
@multiprocess
def test_clip_grad_norm_under_accumulation_clips_only_on_sync_steps(checks: dict[str, Any]) -> None:
    for res in checks["ranks"].values():
        acc = res["accumulation"]
        for sync, (norm, after) in zip(acc["syncs"], acc["norms"], strict=True):
            if sync:
                assert norm is not None and norm > 0.1
                assert after == pytest.approx(0.1, rel=1e-4)
            else:
                assert norm is None
                assert after > 0.1  # left alone
    # The norm on sync steps is computed from the all-reduced gradients: the same on both processes.
    n0, n1 = (checks["ranks"][r]["accumulation"]["norms"] for r in (0, 1))
    assert [n[0] for n in n0] == [n[0] for n in n1]


# ---- equivalence, launchers ----------------------------------------------------------------------------------


@pytest.mark.smoke
@multiprocess
def test_two_process_ddp_matches_one_process(checks: dict[str, Any], reference: dict[str, Any]) -> None:
    """train_equiv.py's trainings, run by dist_checks.py at the end of the `accel launch -n 2` of ``checks``."""
    for res in (checks["ranks"][r]["equiv"] for r in (0, 1)):
        assert res["num_processes"] == 2 and res["plain"]["model_type"] == "DistributedDataParallel"
        assert_same_params(res, reference)


@multiprocess
def test_script_runs_under_plain_torchrun(tmp_path: Path, reference: dict[str, Any]) -> None:
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(SCRIPTS / "train_equiv.py"),
        str(out),
    ]
    run(cmd, clean_env(tmp_path / "home"))
    got = ranks(out, 2)
    for res in got.values():
        assert res["components"] == ["ddp:strategy"]
        assert_same_params(res, reference)


@multiprocess
@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_two_machines_on_one_host(tmp_path: Path, reference: dict[str, Any], rdzv: str) -> None:
    port = free_port()
    out = tmp_path / "out"
    procs = []
    for machine_rank in (0, 1):
        cmd = [
            str(ACCEL),
            "launch",
            "--num_machines",
            "2",
            "--machine_rank",
            str(machine_rank),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(port),
            "-n",
            "2",
            "--rdzv_backend",
            rdzv,
            str(SCRIPTS / "train_equiv.py"),
            str(out),
        ]
        env = clean_env(tmp_path / "home", TEST_LAUNCHER=str(machine_rank))
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, text in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, text[-6000:]
    got = ranks(out, 2)
    for r, res in got.items():
        assert res["num_processes"] == 2
        assert res["local_process_index"] == 0  # one process per machine
        assert res["env"]["WORLD_SIZE"] == "2" and res["env"]["LOCAL_WORLD_SIZE"] == "1"
        assert res["env"]["GROUP_RANK"] == str(r)  # one process per machine: machine rank = process rank
        if rdzv == "static":  # --machine_rank i holds rank i; c10d ranks machines by arrival (any order)
            assert res["env"]["TEST_LAUNCHER"] == str(r)
        assert_same_params(res, reference)
    assert {res["env"]["TEST_LAUNCHER"] for res in got.values()} == {"0", "1"}  # one process from each launcher


@multiprocess
@pytest.mark.slow
def test_max_restarts_reaches_torchrun(tmp_path: Path, reference: dict[str, Any]) -> None:
    script = str(SCRIPTS / "train_equiv.py")
    # Without restarts the failure on the first attempt fails the run ...
    marker = tmp_path / "failed-once-a"
    proc = run(
        [
            str(ACCEL),
            "launch",
            "-n",
            "2",
            "--max_restarts",
            "0",
            str(SCRIPTS / "restart_probe.py"),  # no torch in the worker: what fails the run is the launcher's rule
            str(tmp_path / "a"),
            "--fail_once",
            str(marker),
        ],
        clean_env(tmp_path / "home"),
        expect_ok=False,
    )
    assert proc.returncode != 0 and marker.exists()
    assert not list((tmp_path / "a").glob("rank*.json"))
    # ... with one restart torchrun starts the workers again and the second attempt succeeds.
    marker = tmp_path / "failed-once-b"
    run(
        [
            str(ACCEL),
            "launch",
            "-n",
            "2",
            "--max_restarts",
            "1",
            "--monitor_interval",
            "0.2",
            script,
            str(tmp_path / "b"),
            "--fail_once",
            str(marker),
        ],
        clean_env(tmp_path / "home"),
    )
    assert marker.exists()
    for res in ranks(tmp_path / "b", 2).values():
        assert res["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert_same_params(res, reference)


@multiprocess
def test_no_python_runs_an_executable_under_torchrun(tmp_path: Path, reference: dict[str, Any]) -> None:
    wrapper = tmp_path / "train.sh"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{SCRIPTS / "train_equiv.py"}" "$@"\n')
    wrapper.chmod(0o755)
    out = tmp_path / "out"
    run([str(ACCEL), "launch", "-n", "2", "--no_python", str(wrapper), str(out)], clean_env(tmp_path / "home"))
    for res in ranks(out, 2).values():
        assert_same_params(res, reference)


@multiprocess
def test_failing_script_makes_accel_launch_fail(tmp_path: Path) -> None:
    """A script that fails on every attempt: tried once more (--max_restarts 1), then the launch fails with its code."""
    out = tmp_path / "out"
    proc = run(
        [
            str(ACCEL),
            "launch",
            "-n",
            "2",
            "--max_restarts",
            "1",
            "--monitor_interval",
            "0.2",
            str(SCRIPTS / "restart_probe.py"),  # no torch in the worker: the launcher's bookkeeping is checked
            str(out),
            "--exit_code",
            "3",
        ],
        clean_env(tmp_path / "home"),
        expect_ok=False,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "exits with 3 on purpose" in proc.stderr
    for r in (0, 1):
        assert (out / f"attempts_rank{r}.txt").read_text().splitlines() == ["restart 0", "restart 1"]
    assert not list(out.glob("rank*.json"))


# ---- SLURM -----------------------------------------------------------------------------------------------------


def slurm_env(home: Path, port: int, procid: int, ntasks: int) -> dict[str, str]:
    """What srun sets for task ``procid`` of a job on one node; the job id selects MASTER_PORT = 29500 + id % 1000."""
    return clean_env(
        home,
        SLURM_PROCID=str(procid),
        SLURM_NTASKS=str(ntasks),
        SLURM_LOCALID=str(procid),
        SLURM_NTASKS_PER_NODE=f"{ntasks}(x1)",
        SLURM_JOB_NODELIST="127.0.0.[1-4]",
        SLURM_JOB_ID=str(7000 + port - 29500),
    )


@multiprocess
def test_slurm_variables_world_of_one(tmp_path: Path, reference: dict[str, Any]) -> None:
    port = free_port(29500, 30500)
    out = tmp_path / "out"
    run(
        [sys.executable, str(SCRIPTS / "train_equiv.py"), str(out), "--plugin", "ddp"],
        slurm_env(tmp_path / "home", port, 0, 1),
    )
    res = ranks(out, 1)[0]
    assert res["components"] == ["ddp:strategy"] and res["plain"]["model_type"] == "DistributedDataParallel"
    assert res["env"]["RANK"] == "0" and res["env"]["WORLD_SIZE"] == "1" and res["env"]["LOCAL_RANK"] == "0"
    assert res["env"]["LOCAL_WORLD_SIZE"] == "1"
    assert res["env"]["MASTER_ADDR"] == "127.0.0.1"  # first host of the nodelist
    assert res["env"]["MASTER_PORT"] == str(port)
    assert_same_params(res, reference)


@multiprocess
def test_slurm_variables_two_tasks(tmp_path: Path, reference: dict[str, Any]) -> None:
    """Two tasks started the way srun starts them (no torchrun): the plugin turns SLURM variables into a world."""
    port = free_port(29500, 30500)
    out = tmp_path / "out"
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / "train_equiv.py"), str(out)],
            env=slurm_env(tmp_path / "home", port, i, 2),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text[-6000:]
    for r, res in ranks(out, 2).items():
        assert res["env"]["RANK"] == str(r) and res["env"]["WORLD_SIZE"] == "2"
        assert res["env"]["LOCAL_RANK"] == str(r) and res["env"]["LOCAL_WORLD_SIZE"] == "2"
        assert res["env"]["MASTER_PORT"] == str(port)
        assert res["components"] == ["ddp:strategy"]
        assert_same_params(res, reference)


# ---- the example ----------------------------------------------------------------------------------------------


@multiprocess
@pytest.mark.slow
def test_digits_example_learns_on_two_processes(tmp_path: Path) -> None:
    proc = run(
        [str(ACCEL), "launch", "-n", "2", str(ROOT / "examples" / "train_digits.py")], clean_env(tmp_path / "home")
    )
    found = re.findall(r"epoch (\d+): accuracy ([0-9.]+) on (\d+) test images \((\d+) processes\)", proc.stdout)
    assert found, proc.stdout
    epoch, accuracy, total, processes = found[-1]
    assert int(processes) == 2
    assert int(total) == 297  # every test image counted once (gather_for_metrics)
    assert float(accuracy) >= 0.8, proc.stdout
    assert len(found) == int(epoch) + 1  # printed once per epoch: by the main process only
