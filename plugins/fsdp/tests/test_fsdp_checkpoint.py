"""accel-plugin-fsdp checkpoints: sharded (torch.distributed.checkpoint) and full state dicts, loaded on the same
and on a different number of processes, load right after save (Accelerate #3896), no code run from metadata."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from accel.errors import CheckpointError

HERE = Path(__file__).parent
WORKER = HERE / "fsdp_ckpt_worker.py"
ACCEL = str(Path(sys.executable).parent / "accel")


def launch(tmp: Path, n: int, *args: str, flags: tuple[str, ...] = ()) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_", "FSDP_"))}
    env.update(ACCEL_HOME=str(tmp / "accel_home"), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [ACCEL, "launch", "-q", "-n", str(n), "--plugin", "fsdp", *flags, str(WORKER), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def state(out: Path, tag: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return (
        load_file(str(out / f"{tag}_model.safetensors")),
        torch.load(out / f"{tag}_optim.pt", map_location="cpu", weights_only=True),
    )


def assert_identical(a: Any, b: Any, where: str = "") -> None:
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def manifest_items(ckpt: Path) -> dict[str, tuple[str, str]]:
    items = json.loads((ckpt / "accel_manifest.json").read_text())["items"]
    return {k: (v["plugin"], v["format"]) for k, v in items.items()}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_exact_resume_on_two_processes_and_resharded_load_on_one(tmp_path: Path) -> None:
    """Run A trains 6 steps straight. Run B trains 3, save_state on the main process alone (refused in one line),
    save_state (sharded), load_state at once (Accelerate #3896), exits. Run C (2 processes) load_state and trains to
    6: bitwise A. Run D (1 process): load_state refuses (per-process random states and dataloader positions of 2
    processes), accel_fsdp.load_sharded reshards model and optimizer.
    Run E is killed mid-run and restarted by torchrun (--max_restarts)."""
    ckpt = tmp_path / "ckpt"
    launch(tmp_path, 2, str(tmp_path / "a"), "--steps", "6")
    b = ("--steps", "6", "--save_at", "3", "--ckpt", str(ckpt), "--reload", "--main_only_first")
    launch(tmp_path, 2, str(tmp_path / "b"), *b)
    launch(tmp_path, 2, str(tmp_path / "c"), "--steps", "6", "--start", "3", "--load", str(ckpt))
    launch(tmp_path, 1, str(tmp_path / "d"), "--steps", "5", "--start", "3", "--load", str(ckpt), "--sharded")

    items = manifest_items(ckpt)
    assert items["model"] == items["optimizer"] == ("fsdp", "torch.distributed.checkpoint")
    assert items["scheduler"][0] == items["dataloader"][0] == items["rng"][0] == "accel"
    for item in ("model", "optimizer"):  # one shard file per process, and DCP's index
        assert sorted(p.name for p in (ckpt / item).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    # before saving, run B called save_state inside `if is_main_process` (diffusers' pattern): refused in one line,
    # after 10 join windows of 0.3 s, and nothing was written
    main_only = json.loads((tmp_path / "b" / "main_only.txt").read_text())
    assert main_only["error"].endswith(
        "save_state is collective under fsdp: call it on every process, not inside `if is_main_process`"
    )
    assert "process(es) 1 did not call it within 3 s" in main_only["error"] and "\n" not in main_only["error"]
    assert 2.9 < main_only["seconds"] < 30, main_only
    assert not (tmp_path / "main_only").exists()

    saved = state(tmp_path / "b", "saved")
    assert saved[1]["state"], "the optimizer had taken steps"
    assert_identical(saved, state(tmp_path / "b", "reloaded"), "reloaded right after saving")
    assert_identical(saved, state(tmp_path / "c", "loaded"), "loaded on 2")
    assert_identical(state(tmp_path / "a", "final"), state(tmp_path / "c", "final"), "resumed")
    losses_a = json.loads((tmp_path / "a" / "losses.json").read_text())
    assert json.loads((tmp_path / "c" / "losses.json").read_text()) == losses_a[3:]

    assert_identical(saved, state(tmp_path / "d", "loaded"), "loaded on 1")
    final_d = state(tmp_path / "d", "final")[0]
    assert all(torch.isfinite(v).all() for v in final_d.values())
    assert any(not torch.equal(final_d[k], saved[0][k]) for k in final_d), "training went on after loading"

    # elastic: the last process dies at step 5; torchrun restarts both, they resume from the automatic checkpoint of
    # step 4 and end bitwise where the uninterrupted run ended
    launch(
        tmp_path,
        2,
        str(tmp_path / "e"),
        "--steps",
        "6",
        "--project",
        str(tmp_path / "proj"),
        "--save_every",
        "2",
        "--kill_at",
        "5",
        "--marker",
        str(tmp_path / "killed"),
        flags=("--max_restarts", "1"),
    )
    assert (tmp_path / "killed").exists()
    assert_identical(state(tmp_path / "a", "final"), state(tmp_path / "e", "final"), "after an elastic restart")

    # save_model: plain safetensors that a model without FSDP loads
    sys.path.insert(0, str(HERE))
    from fsdp_ckpt_worker import DropNet

    export = load_file(str(tmp_path / "a" / "export" / "model.safetensors"))
    plain = DropNet()
    plain.load_state_dict(export)
    assert_identical({k: v for k, v in plain.state_dict().items()}, state(tmp_path / "a", "final")[0], "export")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_full_state_dict_checkpoint_saved_on_two_loaded_on_one(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    flags = ("--fsdp_state_dict_type", "FULL_STATE_DICT")
    launch(
        tmp_path, 2, str(tmp_path / "b"), "--steps", "6", "--save_at", "3", "--ckpt", str(ckpt), "--reload", flags=flags
    )
    launch(
        tmp_path, 1, str(tmp_path / "d"), "--steps", "5", "--start", "3", "--load", str(ckpt), "--sharded", flags=flags
    )
    items = manifest_items(ckpt)
    assert items["model"] == ("fsdp", "safetensors-full") and items["optimizer"] == ("fsdp", "torch-weights-only-full")
    saved = state(tmp_path / "b", "saved")
    assert_identical(load_file(str(ckpt / "model.safetensors")), saved[0], "model.safetensors")
    assert_identical(saved, state(tmp_path / "b", "reloaded"), "reloaded right after saving")
    assert_identical(saved, state(tmp_path / "d", "loaded"), "loaded on 1")


@pytest.mark.slow
def test_plain_python_kernel_arguments_and_saving_before_the_first_step(tmp_path: Path) -> None:
    """Kernel(plugins=["fsdp"], fsdp_...=...) in a plain `python` process (a world of one); save_state/load_state
    before the first optimizer step change nothing: training afterwards is bitwise the same as without them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_", "FSDP_"))}
    env.update(ACCEL_HOME=str(tmp_path / "accel_home"), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(HERE / "fsdp_single_worker.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-2000:] + proc.stderr[-4000:]


def test_dcp_metadata_is_read_without_running_code(tmp_path: Path) -> None:
    """A DCP index (.metadata) that would run code when unpickled is refused; a real one is read."""
    import torch.distributed.checkpoint as dcp

    from accel.checkpoint import dcp_load
    from accel_fsdp.checkpoint import SafeReader

    good = tmp_path / "good"
    dcp.save({"w": torch.arange(6.0).reshape(2, 3), "lr": 0.5}, checkpoint_id=good)  # one process, no group
    target = {"w": torch.zeros(2, 3), "lr": 0.0}
    dcp_load(target, good)
    assert torch.equal(target["w"], torch.arange(6.0).reshape(2, 3)) and target["lr"] == 0.5

    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    (bad / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError, match="refusing to load .* it references posix.system"):
        SafeReader(bad).read_metadata()
    assert not marker.exists()
    with pytest.raises(BaseException, match="load planner that may unpickle code"):  # torch: CheckpointException
        dcp.load({"w": torch.zeros(2, 3), "lr": 0.0}, checkpoint_id=good, storage_reader=SafeReader(good))
