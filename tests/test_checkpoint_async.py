"""Asynchronous save: ``save_state(asynchronous=True)`` / the ``async_save`` option.

The loop is blocked only for the copy to CPU memory; the write, fsync and publish happen on a background thread
with the synchronous save's atomicity, and the next save, load_state, end_training and interpreter exit finish (or
report) the save in flight. Real files, real processes, real DDP on gloo; no mock."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import CheckpointError, Kernel, ProjectConfiguration
from accel.checkpoint import _SAVERS, is_complete, numbered_checkpoints, pending_save, read_manifest

SCRIPTS = Path(__file__).parent / "scripts"
ACCEL = Path(sys.executable).parent / "accel"


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "arr": torch.arange(3) * self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])


def setup(accum: int = 1, width: int = 64, depth: int = 2, **kwargs: Any) -> tuple[Kernel, Any, Any, Any, Counter]:
    torch.manual_seed(0)
    kernel = Kernel(cpu=True, gradient_accumulation_steps=accum, **kwargs)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    model[-1].weight = model[0].weight  # tied weights are stored once either way
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    data = TensorDataset(torch.randn(32, width), torch.randn(32, width))
    dl = DataLoader(data, batch_size=4, shuffle=True)
    model, opt, dl, sched = kernel.prepare(model, opt, dl, sched)
    counter = Counter()
    kernel.register_for_checkpointing(counter)
    return kernel, model, opt, dl, counter


def step(kernel: Kernel, model: Any, opt: Any, x: torch.Tensor | None = None) -> None:
    x = torch.randn(4, model[0].in_features) if x is None else x
    with kernel.accumulate(model):
        kernel.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def job_of(kernel: Kernel) -> Any:
    saver = _SAVERS.get(kernel)
    return None if saver is None else saver.job


@pytest.mark.parametrize("overlap", [False, True], ids=["copy-before-return", "overlap"])
def test_async_save_writes_the_same_bytes_as_the_sync_save(tmp_path: Path, overlap: bool) -> None:
    # in the middle of gradient accumulation (gradients saved too), mid-epoch, Adam state, a scheduler, tied
    # weights, a registered object: every file, the manifest included, is byte-for-byte the synchronous one's
    kernel, model, opt, dl, counter = setup(accum=2, width=1024, depth=8, async_save_overlap=overlap)
    it = iter(dl)
    for _ in range(3):
        x, _y = next(it)
        step(kernel, model, opt, x)
        counter.n += 1
    assert not kernel.sync_gradients
    kernel.save_state(tmp_path / "sync")
    kernel.save_state(tmp_path / "async", asynchronous=True)
    assert pending_save(kernel) == (tmp_path / "async").absolute()
    job = job_of(kernel)
    # overlap: the parameters' and Adam's copies were left to the background thread (the step below waits for
    # them); otherwise everything was copied before save_state returned
    deferred = {stem for stem, *_ in job.deferred}
    assert deferred == ({"model", "optimizer"} if overlap else set()), deferred
    opt.optimizer.step()  # a step right after the call cannot reach the files
    assert job.verified.is_set() and job.changed is None
    kernel.wait_for_save()
    assert pending_save(kernel) is None
    a, b = files(tmp_path / "sync"), files(tmp_path / "async")
    assert a.keys() == b.keys() and "gradients_rank0.safetensors" in a
    different = [name for name in a if a[name] != b[name]]
    print(f"{len(a)} files compared, different: {different}")
    assert not different
    kernel.end_training()


def test_overlap_a_change_in_place_before_the_next_step_fails_the_save_in_one_line(tmp_path: Path) -> None:
    # async_save_overlap: a tensor the copy was left for, changed in place by anything but the optimizer's step
    # before that step (here Adam's last state), must not be written torn: the save fails in one line, nothing is
    # published, and the next save is fine
    kernel, model, opt, _dl, _counter = setup(width=1024, depth=8, async_save_overlap=True)
    step(kernel, model, opt)
    kernel.save_state(tmp_path / "ck", asynchronous=True)
    last = list(opt.optimizer.state.values())[-1]["exp_avg_sq"]
    last.add_(1.0)
    with pytest.raises(CheckpointError, match=r"exp_avg_sq.* was changed in place .* call kernel.wait_for_save\(\)"):
        kernel.wait_for_save()
    assert not (tmp_path / "ck").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".ck.")]
    kernel.save_state(tmp_path / "again", asynchronous=True)
    step(kernel, model, opt)  # the step waits for the copy and checks: nothing changed
    kernel.wait_for_save()
    assert is_complete(tmp_path / "again")
    kernel.end_training()


def test_overlap_a_parameter_rebound_after_the_call_keeps_the_state_at_the_call(tmp_path: Path) -> None:
    # `param.data = other` gives the parameter new memory: the copy reads the memory it had at the call
    kernel, model, opt, _dl, _counter = setup(width=1024, depth=8, async_save_overlap=True)
    step(kernel, model, opt)
    before = model[3].weight.detach().clone()
    kernel.save_state(tmp_path / "ck", asynchronous=True)
    model[3].weight.data = torch.zeros_like(model[3].weight)
    kernel.wait_for_save()
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "ck" / "model.safetensors"))
    assert torch.equal(saved["3.weight"], before)
    kernel.end_training()


@pytest.mark.parametrize("source", ["argument", "env"])
def test_async_save_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    if source == "env":
        monkeypatch.setenv("ACCEL_ASYNC_SAVE", "1")
        kernel, model, opt, _dl, _c = setup()
    else:
        kernel, model, opt, _dl, _c = setup(async_save=True)
    assert kernel.settings["async_save"] is True
    kernel.save_state(tmp_path / "a")
    assert pending_save(kernel) is not None  # the option made it asynchronous
    kernel.save_state(tmp_path / "b", asynchronous=False)  # an explicit argument wins; it waits for "a" first
    assert pending_save(kernel) is None and is_complete(tmp_path / "a") and is_complete(tmp_path / "b")
    kernel.end_training()


def test_training_goes_on_during_the_write_and_the_checkpoint_holds_the_state_at_the_call(tmp_path: Path) -> None:
    # ~100 MB of model + Adam state: save_state returns while the write is still running, the loop trains on
    # (changing parameters and Adam state in place), and the checkpoint still holds the state at the call
    kernel, model, opt, _dl, counter = setup(width=1024, depth=8)
    step(kernel, model, opt)
    overlapped = 0
    for attempt in range(3):
        counter.n = 100 + attempt
        expected_model = copy.deepcopy(kernel.unwrap_model(model).state_dict())
        expected_opt = copy.deepcopy(opt.state_dict())
        target = tmp_path / f"ck{attempt}"
        kernel.save_state(target, asynchronous=True)
        job = job_of(kernel)
        in_flight = job.thread.is_alive() and not is_complete(target)
        step(kernel, model, opt)  # starts while the background write runs (when in_flight)
        counter.n += 1
        still = job.thread.is_alive()
        kernel.wait_for_save()
        print(
            f"attempt {attempt}: write in flight when save_state returned: {in_flight}; still after one "
            f"training step: {still}"
        )
        overlapped += in_flight
        k2, m2, o2, _dl2, c2 = setup(width=1024, depth=8)
        k2.load_state(target)
        assert c2.n == 100 + attempt
        for name, value in k2.unwrap_model(m2).state_dict().items():
            assert torch.equal(value, expected_model[name]), name
        loaded = o2.state_dict()
        for i, state in expected_opt["state"].items():
            for key, value in state.items():
                assert torch.equal(loaded["state"][i][key], value), (i, key)
        assert not torch.equal(kernel.unwrap_model(model)[0].weight, expected_model["0.weight"])  # it did train
        k2.end_training()
        if overlapped:
            break
    assert overlapped, "the write was never in flight when save_state returned (3 attempts); the test tested nothing"
    kernel.end_training()


def test_next_save_and_load_wait_for_the_save_in_flight(tmp_path: Path) -> None:
    config = ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)
    kernel, model, opt, _dl, counter = setup(width=512, depth=4, project_config=config, project_dir=tmp_path / "p")
    returned = []
    for i in range(4):
        counter.n = i
        path = kernel.save_state(asynchronous=True)
        returned.append(Path(path))
        if i:  # when a save_state returns, the previous one is published
            read_manifest(returned[i - 1])
        step(kernel, model, opt)
    folder = tmp_path / "p" / "checkpoints"
    latest = kernel.latest_checkpoint()  # waits too
    assert latest == returned[-1] and is_complete(returned[-1])
    names = [p.name for _, p in numbered_checkpoints(folder)]
    assert names == ["checkpoint_2", "checkpoint_3"], names  # total_limit pruned the oldest, after publishing
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]  # no temporary directory left
    counter.n = 99
    kernel.save_state(asynchronous=True)
    kernel.load_state()  # waits, then loads the newest: the one just saved
    assert counter.n == 99 and kernel.save_iteration == 5
    kernel.end_training()


def test_end_training_waits(tmp_path: Path) -> None:
    kernel, model, opt, _dl, counter = setup(width=1024, depth=4)
    counter.n = 7
    target = tmp_path / "ck"
    kernel.save_state(target, asynchronous=True)
    kernel.end_training()
    assert is_complete(target)
    read_manifest(target)
    k2, _m, _o, _d, c2 = setup(width=1024, depth=4)
    k2.load_state(target)
    assert c2.n == 7
    k2.end_training()


def run_script(
    tmp_path: Path, *args: str, launch: bool = False, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, ACCEL_HOME=str(tmp_path / "home"))
    for name in ("ACCEL_CONFIG", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCEL_ASYNC_SAVE"):
        env.pop(name, None)
    cmd = [sys.executable, str(SCRIPTS / "ckpt_async.py"), *args]
    if launch:
        cmd = [str(ACCEL), "launch", "-q", "-n", "2", "--plugin", "ddp", *cmd[1:]]
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


def test_interpreter_exit_waits(tmp_path: Path) -> None:
    # the script returns right after save_state(asynchronous=True), without end_training (64 MB to write)
    proc = run_script(tmp_path, str(tmp_path), "exit", "--mb", "64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    read_manifest(tmp_path / "ck")  # published by the exit handler
    assert "accel:" not in proc.stderr


@pytest.mark.parametrize("mode", ["next-save", "end-training", "exit"])
def test_background_failure_is_one_line_at_the_next_sync_point(tmp_path: Path, mode: str) -> None:
    # a full disk for the background write (RLIMIT_FSIZE of 1 MB; the model file is 8 MB)
    proc = run_script(tmp_path, str(tmp_path), mode, "--limit-rank", "0", "--limit", str(2**20))
    print(f"{mode}: stdout {proc.stdout.strip()!r}; stderr tail {proc.stderr.strip()[-300:]!r}")
    assert "returned 0" in proc.stdout  # the save itself returned normally
    if mode == "exit":
        lines = [line for line in proc.stderr.splitlines() if line.startswith("accel:")]
    else:
        lines = [line for line in proc.stdout.splitlines() if line.startswith("error 0:")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    assert "asynchronous save_state to" in lines[0] and "failed on process 0" in lines[0]
    assert "File too large" in lines[0] and "it was not published" in lines[0]
    if mode == "exit":  # a save lost at exit is a failed run (a Slurm job must not look successful)
        assert proc.returncode == 1 and "exit code 1" in lines[0], proc.returncode
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ck").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".ck.")]  # temporary directory removed


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("rank", [0, 1])
def test_background_failure_on_one_of_two_processes_is_reported_on_both(tmp_path: Path, rank: int) -> None:
    # process `rank` cannot write (RLIMIT_FSIZE 1000 bytes: its random-state file is larger); the other can
    proc = run_script(tmp_path, str(tmp_path), "next-save", "--limit-rank", str(rank), "--limit", "1000", launch=True)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = sorted(line for line in proc.stdout.splitlines() if line.startswith("error "))
    assert [e.split(":")[0] for e in errors] == ["error 0", "error 1"], proc.stdout + proc.stderr[-3000:]
    messages = {e.split(": ", 1)[1] for e in errors}
    assert len(messages) == 1, messages  # the same one line on every process
    assert f"failed on process {rank}: " in errors[0] and "File too large" in errors[0]
    assert not (tmp_path / "ck").exists()  # nothing published, no temporary directory left
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".ck.")]
    assert not (tmp_path / "ck2").exists()  # the save that reported the error did not start


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_save_lost_at_exit_fails_accel_launch(tmp_path: Path) -> None:
    # process 0 cannot write its files (1 MB limit, 8 MB model): the save is lost at exit, the launch fails
    proc = run_script(tmp_path, str(tmp_path), "exit", "--limit-rank", "0", "--limit", str(2**20), launch=True)
    assert proc.returncode != 0, proc.stdout + proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("accel: asynchronous save_state")]
    # process 0's line only: process 1's files are written (the temporary directory is removed only after every
    # process has stopped writing into it)
    assert len(lines) == 1 and "failed on process 0" in lines[0], proc.stderr[-3000:]
    assert all(f"{tmp_path / 'ck'} failed" in line and line.endswith("exit code 1") for line in lines), lines
    assert not (tmp_path / "ck").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".ck.")]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_two_processes_exit_publishes(tmp_path: Path) -> None:
    proc = run_script(tmp_path, str(tmp_path), "exit", launch=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = read_manifest(tmp_path / "ck")
    assert manifest["world_size"] == 2 and "rng_rank1.safetensors" in manifest["files"]


def _train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, ACCEL_HOME=str(tmp_path / "home"))
    for name in ("ACCEL_CONFIG", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCEL_ASYNC_SAVE"):
        env.pop(name, None)
    cmd = [str(ACCEL), "launch", "-q", "-n", "2", str(SCRIPTS / "ckpt_train.py"), *args]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_two_processes_async_saves_resume_exactly(tmp_path: Path) -> None:
    from test_checkpoint_processes import STEPS, assert_same_training_state

    _train(tmp_path, "--steps", STEPS, "--out", "a.pt")  # uninterrupted
    # automatic checkpoints every 8 steps, all asynchronous (Kernel(async_save=True)); total_limit=2
    _train(tmp_path, "--steps", "40", "--project", "proj", "--save-every", "8", "--async-save")
    folder = tmp_path / "proj" / "checkpoints"
    assert [p.name for _, p in numbered_checkpoints(folder)] == ["checkpoint_3", "checkpoint_4"]
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]
    assert read_manifest(folder / "checkpoint_4")["world_size"] == 2
    proc = _train(tmp_path, "--steps", STEPS, "--project", "proj", "--save-every", "100", "--out", "b.pt")
    assert "checkpoint_4 at step 40" in proc.stdout
    assert_same_training_state(tmp_path / "a.pt", tmp_path / "b.pt")


@pytest.mark.timeout(900)  # the first DeepSpeed process of a clean workspace compiles an op
@pytest.mark.parametrize("plugin", ["fsdp", pytest.param("deepspeed", marks=pytest.mark.slow)])
def test_plugins_that_write_their_own_format_refuse_async_in_one_line(tmp_path: Path, plugin: str) -> None:
    env = dict(
        os.environ,
        ACCEL_HOME=str(tmp_path / "home"),
        OMP_NUM_THREADS="1",
        # DeepSpeed compiles an op on first use: the workspace's cache, as plugins/deepspeed/tests/test_deepspeed.py
        TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR")
        or str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"),
    )
    for name in ("ACCEL_CONFIG", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCEL_ASYNC_SAVE"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "ckpt_async_refused.py"), str(tmp_path / "out"), plugin],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    refused = [line for line in proc.stdout.splitlines() if line.startswith("refused: ")]
    print(refused)
    assert len(refused) == 1 and f"not supported with --plugin {plugin}" in refused[0]
    assert "without asynchronous=True" in refused[0]
    assert "sync ok" in proc.stdout
    read_manifest(tmp_path / "out" / "ck")


def test_the_copy_to_cpu_memory_keeps_every_dtype_and_layout(tmp_path: Path) -> None:
    # the staging copy takes a byte-level memcpy where it can; a state dict of every kind of tensor comes back equal
    # (a conjugate view is stored with its values: the synchronous save wrote its memory unconjugated before)
    class Odd:
        def __init__(self) -> None:
            base = torch.randn(4, 6)
            self.state = {
                "f32": base,
                "bf16": base.bfloat16(),
                "f16": base.half(),
                "i64": base.long(),
                "bool": base > 0,
                "c64": torch.randn(3, dtype=torch.complex64),
                "conj": torch.randn(3, dtype=torch.complex64).conj(),
                "scalar": torch.tensor(2.5),
                "empty": torch.empty(0, 3),
                "transposed": base.t(),
                "f8": base.to(torch.float8_e4m3fn),
            }

        def state_dict(self) -> dict[str, Any]:
            return self.state

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.state = state

    kernel = Kernel(cpu=True)
    odd = Odd()
    kernel.register_for_checkpointing(odd)
    kernel.save_state(tmp_path / "sync")
    kernel.save_state(tmp_path / "async", asynchronous=True)
    kernel.wait_for_save()
    assert files(tmp_path / "sync") == files(tmp_path / "async")
    expected = dict(odd.state)
    kernel.load_state(tmp_path / "async")
    for key, value in expected.items():
        got = odd.state[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(
            got.resolve_conj().reshape(-1).view(torch.uint8), value.resolve_conj().reshape(-1).view(torch.uint8)
        ), key  # bitwise, conj view resolved
    kernel.end_training()
