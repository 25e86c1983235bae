"""Checkpoints across real processes: exact resume in a new process (1 and 2 DDP processes), automatic
numbering after a restart, kill -9 during save_state, and elastic restarts with `accel launch --max_restarts 2`."""

from __future__ import annotations

import importlib.util
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from clitools import launch_env
from warm_python import WarmPython

from accel.checkpoint import MANIFEST, numbered_checkpoints, read_manifest

SCRIPTS = Path(__file__).parent / "scripts"
TRAIN = SCRIPTS / "ckpt_train.py"
ACCEL = Path(sys.executable).parent / "accel"

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WarmPython]:
    """Fresh processes forked from one Python that imported torch once, for the whole module: a fork instead of a
    start-up for every `accel launch` (the launcher; its workers are the ones torchrun starts, which the suite's warm
    workers fork with Python's and NumPy's random states reseeded: tests/warm_workers) and for every run whose
    subject is not a fresh interpreter (see warm_python.py)."""
    tmp = tmp_path_factory.mktemp("warm")
    with WarmPython(tmp / "warm", launch_env(tmp)) as server:
        yield server


def run(
    warm: WarmPython | None, argv: list[str], tmp_path: Path, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python ARGV`` in a fresh interpreter (``warm`` None) or a fork of the warm Python; fails on a non-zero exit."""
    env = launch_env(tmp_path)
    if warm is None:
        proc = subprocess.run(
            [sys.executable, *argv], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout
        )
    else:
        child = warm.popen(argv, env=env, cwd=tmp_path)
        out, err = child.communicate(timeout=timeout)
        proc = subprocess.CompletedProcess(argv, child.returncode or 0, out, err)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def python(tmp_path: Path, *args: str, warm: WarmPython | None = None) -> subprocess.CompletedProcess[str]:
    return run(warm, [str(TRAIN), *args], tmp_path)


def launch(
    warm: WarmPython, tmp_path: Path, *args: str, launch_args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """`accel launch -n 2 ckpt_train.py ARGS`: the launcher forked from the warm Python, its two workers torchrun's."""
    return run(warm, [str(ACCEL), "launch", "-q", "-n", "2", *launch_args, str(TRAIN), *args], tmp_path, timeout=400)


def assert_same_training_state(a: Path, b: Path) -> None:
    """Parameters, optimizer state and schedule of two runs are bitwise equal."""
    A = torch.load(a, weights_only=True)
    B = torch.load(b, weights_only=True)
    assert A["step"] == B["step"]
    assert A["model"].keys() == B["model"].keys()
    for k in A["model"]:
        assert torch.equal(A["model"][k], B["model"][k]), f"parameter {k} differs"
    assert A["optimizer"]["param_groups"] == B["optimizer"]["param_groups"]
    assert A["optimizer"]["state"].keys() == B["optimizer"]["state"].keys()
    for i, state in A["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, B["optimizer"]["state"][i][name]), f"optimizer state {i}.{name} differs"
    assert A["scheduler"] == B["scheduler"]


def differs(a: Path, b: Path) -> bool:
    try:
        assert_same_training_state(a, b)
    except AssertionError:
        return True
    return False


STEPS, SAVE_AT = "45", "30"  # 26 batches per epoch with one process, 13 with two: the save is mid-epoch


@pytest.mark.slow  # a process start-up and three forks
def test_exact_resume_in_a_new_process(tmp_path: Path, warm: WarmPython) -> None:
    # The reference, the save and the negative control run in forks of the warm Python; the resume, the subject,
    # runs in a fresh interpreter: its hash seed and any generator the script does not seed differ from the forks',
    # so a state the checkpoint misses still shows in the comparison.
    python(tmp_path, "--steps", STEPS, "--out", "a.pt", warm=warm)
    python(tmp_path, "--steps", STEPS, "--save-at", SAVE_AT, "--ckpt", "ck", warm=warm)
    assert not (tmp_path / "b.pt").exists()
    python(tmp_path, "--steps", STEPS, "--resume", "--ckpt", "ck", "--out", "b.pt")
    assert_same_training_state(tmp_path / "a.pt", tmp_path / "b.pt")
    # negative control: the same resume with torch's generator disturbed after loading does not match, so the
    # comparison above is sensitive to dropout and noise (random-state restore matters)
    python(tmp_path, "--steps", STEPS, "--resume", "--ckpt", "ck", "--out", "c.pt", "--disturb", warm=warm)
    assert differs(tmp_path / "a.pt", tmp_path / "c.pt")


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory, warm: WarmPython) -> Path:
    """An uninterrupted 2-process run."""
    tmp = tmp_path_factory.mktemp("ddp_reference")
    launch(warm, tmp, "--steps", STEPS, "--out", "a.pt")
    return tmp / "a.pt"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_exact_resume_two_processes_ddp(tmp_path: Path, ddp_reference: Path, warm: WarmPython) -> None:
    launch(warm, tmp_path, "--steps", STEPS, "--save-at", SAVE_AT, "--ckpt", "ck")
    manifest = json.loads((tmp_path / "ck" / MANIFEST).read_text())
    assert manifest["world_size"] == 2 and "rng_rank1.safetensors" in manifest["files"]
    launch(warm, tmp_path, "--steps", STEPS, "--resume", "--ckpt", "ck", "--out", "b.pt")
    assert_same_training_state(ddp_reference, tmp_path / "b.pt")
    # the same checkpoint in one process: refused, saying what differs
    child = warm.popen(
        [str(TRAIN), "--steps", STEPS, "--resume", "--ckpt", "ck"], env=launch_env(tmp_path), cwd=tmp_path
    )
    _, err = child.communicate(timeout=300)
    assert child.returncode != 0
    assert "holds one state per process for 2 process(es); this run has 1" in err


@pytest.mark.slow  # two launches of 2 processes
@pytest.mark.timeout(600)
def test_save_state_on_the_main_process_alone_then_resume_on_two(tmp_path: Path, warm: WarmPython) -> None:
    """Diffusers' `if accelerator.is_main_process: accelerator.save_state(path)` under DDP (replicated state): the
    main process saves alone at once (its line is inside a test for the main process), saying once that the other process's random states
    are not saved; load_state on 2 processes restores model, optimizer and schedule exactly, the process without
    its random states says so in one line, and training goes on."""
    args = ("--steps", STEPS, "--save-at", SAVE_AT, "--ckpt", "ck", "--save-on-main", "--project", "p", "--out", "a.pt")
    saved = launch(warm, tmp_path, *args)
    assert saved.stderr.count("ran on the main process alone") == 1, saved.stderr
    # first an automatically numbered save on the main process alone: refused in one line at once (the script's
    # line is inside a test for the main process, so no process is waited for)
    refused = [line for line in saved.stdout.splitlines() if line.startswith("refused: ")]
    assert refused == [
        "refused: save_state: called inside `if args.save_on_main and args.project and kernel.is_main_process`, so "
        "the other processes do not call it; with automatic checkpoint naming save_state is collective (as in "
        "Accelerate): call it on every process, not inside `if is_main_process`"
    ], saved.stdout
    assert not (tmp_path / "p" / "checkpoints" / "checkpoint_0").exists()
    manifest = read_manifest(tmp_path / "ck")
    assert "rng_rank0.safetensors" in manifest["files"] and "rng_rank1.safetensors" not in manifest["files"]
    assert manifest["items"]["rng"]["extra"]["ranks"] == [0]
    resumed = launch(
        warm,
        tmp_path,
        "--steps",
        str(int(SAVE_AT) + 4),
        "--resume",
        "--ckpt",
        "ck",
        "--loaded-out",
        "b.pt",
        "--out",
        "c.pt",
    )
    assert_same_training_state(tmp_path / "a.pt", tmp_path / "b.pt")
    assert torch.load(tmp_path / "c.pt", weights_only=True)["step"] == int(SAVE_AT) + 4  # and it trained on
    missing = [line for line in resumed.stderr.splitlines() if "holds no" in line]
    assert len(missing) == 1 and "'rng' of process 1" in missing[0] and "not restored" in missing[0], resumed.stderr


def warm_python(warm: WarmPython, tmp_path: Path, *args: str) -> str:
    """``python ckpt_train.py ARGS`` in a fresh process forked from the warm Python; its stdout."""
    return python(tmp_path, *args, warm=warm).stdout


@pytest.mark.slow  # two runs (forks of one warm Python)
def test_automatic_numbering_continues_after_restart(tmp_path: Path, warm: WarmPython) -> None:
    # first process: checkpoints at steps 4, 8, 12 -> checkpoint_0..2, total_limit=2 keeps 1 and 2
    warm_python(warm, tmp_path, "--steps", "12", "--project", "proj", "--save-every", "4")
    folder = tmp_path / "proj" / "checkpoints"
    assert [p.name for _, p in numbered_checkpoints(folder)] == ["checkpoint_1", "checkpoint_2"]
    # a new process resumes from the latest and numbers on (Accelerate's #3306 would write checkpoint_0 again)
    stdout = warm_python(warm, tmp_path, "--steps", "20", "--project", "proj", "--save-every", "4")
    assert "resumed from" in stdout and "checkpoint_2 at step 12" in stdout
    assert [p.name for _, p in numbered_checkpoints(folder)] == ["checkpoint_3", "checkpoint_4"]
    assert json.loads((folder / "checkpoint_4" / MANIFEST).read_text())["iteration"] == 4


def _load_crash_module() -> Any:
    spec = importlib.util.spec_from_file_location("ckpt_crash", SCRIPTS / "ckpt_crash.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(900)  # 20 runs of ckpt_crash.py
def test_kill_9_during_save_state_never_loses_the_last_complete_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warm: WarmPython
) -> None:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    crash = _load_crash_module()
    project = tmp_path / "proj"
    rng = random.Random(20261121)
    mid_save = 0
    last_loaded = 0
    for trial in range(20):
        proc = warm.popen([str(SCRIPTS / "ckpt_crash.py"), str(project)], env=launch_env(tmp_path), cwd=tmp_path)
        assert proc.stdout is not None
        first = proc.stdout.readline()
        while first.startswith(("pid ", "resumed ")):  # ckpt_crash.py's start-up lines
            first = proc.stdout.readline()
        assert first.startswith("saved "), proc.stderr.read() if proc.stderr else first
        time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        published = [int(line.split()[1]) for line in (first + out).splitlines() if line.startswith("saved ")]
        folder = project / "checkpoints"
        if any(p.name.startswith(".checkpoint_") for p in folder.iterdir()):
            mid_save += 1  # the kill landed inside save_state (a temporary or set-aside directory is left)
        for _, path in numbered_checkpoints(folder):
            read_manifest(path)  # every visible checkpoint is complete: no half-written or half-deleted one

        kernel, model, opt, progress = crash.build(str(project))
        loaded = kernel.load_state()
        step = progress.step
        assert step >= max(published), f"trial {trial}: save of step {max(published)} returned but was lost"
        assert step > last_loaded, f"trial {trial}: went back from step {last_loaded} to {step}"
        for p in model.parameters():
            assert torch.all(p == step), f"trial {trial}: {loaded} mixes saves"
        for state in opt.state.values():
            assert torch.all(state["momentum_buffer"] == step)
        kernel.backward(model(torch.ones(1, 1024)).sum())  # and training goes on from there
        opt.step()
        opt.zero_grad()
        assert all(torch.isfinite(p).all() for p in model.parameters())
        kernel.end_training()
        last_loaded = step
    assert mid_save >= 1, "no kill landed inside save_state; the test did not test anything"
    print(f"kills inside save_state: {mid_save}/20")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_elastic_restart_resumes_from_latest_checkpoint(tmp_path: Path, ddp_reference: Path, warm: WarmPython) -> None:
    # checkpoints every 8 steps (automatic naming); the last process SIGKILLs itself at step 21, once;
    # torchrun restarts both workers, which load_state() the latest checkpoint (step 16) on start-up
    proc = launch(
        warm,
        tmp_path,
        "--steps",
        STEPS,
        "--project",
        "proj",
        "--save-every",
        "8",
        "--kill-at",
        "21",
        "--marker",
        "killed",
        "--out",
        "e.pt",
        launch_args=("--max_restarts", "2"),
    )
    assert (tmp_path / "killed").exists()
    assert "resumed from proj/checkpoints/checkpoint_1 at step 16" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert_same_training_state(ddp_reference, tmp_path / "e.pt")


def test_a_late_process_is_released_and_a_save_on_every_process_after_a_main_alone_save_pairs(
    tmp_path: Path, warm: WarmPython
) -> None:
    """The meeting before save_state under load (CI found both): a process more than the join window behind the
    main one gets one warning and is released (no hang, the next steps pair), and a save of every process right
    after one the main process made alone is collective (it is not paired with the earlier save)."""
    out = tmp_path / "out"
    proc = run(warm, [str(ACCEL), "launch", "-q", "-n", "2", str(SCRIPTS / "save_slots.py"), str(out)], tmp_path, 240)
    late = [line for line in proc.stderr.splitlines() if "came more than 0.3 s" in line]
    assert len(late) == 1 and "process 1" in late[0] and "save_join_timeout" in late[0], proc.stderr
    for name in ("late", "alone"):
        assert read_manifest(out / name)["items"]["rng"]["extra"]["ranks"] == [0], name
    both = read_manifest(out / "both")
    assert {"rng_rank0.safetensors", "rng_rank1.safetensors"} <= set(both["files"])
    assert "ranks" not in both["items"]["rng"]["extra"]
    times = [json.loads((out / f"times.rank{r}.json").read_text()) for r in (0, 1)]
    assert 2.9 < times[1]["late"] < 60, times  # ten windows of 0.3 s, then released
