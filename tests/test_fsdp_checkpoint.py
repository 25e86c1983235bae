"""accel-plugin-fsdp checkpoints: sharded (torch.distributed.checkpoint) and full state dicts, loaded on the same
and on a different number of processes, load right after save (Accelerate #3896), no code run from metadata."""

from __future__ import annotations

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

from accel import UsageError

HERE = Path(__file__).parent
WORKER = HERE / "fsdp_ckpt_worker.py"
ACCEL = str(Path(sys.executable).parent / "accel")


def launch(tmp: Path, n: int, *args: str, flags: tuple[str, ...] = ()) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_", "FSDP_"))}
    env.update(ACCEL_HOME=str(tmp / "accel_home"), OMP_NUM_THREADS="1")
    proc = subprocess.run([ACCEL, "launch", "-q", "-n", str(n), "--plugin", "fsdp", *flags, str(WORKER), *args],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def state(out: Path, tag: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return (load_file(str(out / f"{tag}_model.safetensors")),
            torch.load(out / f"{tag}_optim.pt", map_location="cpu", weights_only=True))


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
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_save_on_two_load_right_away_and_on_one_and_two(tmp_path: Path, kind: str) -> None:
    """Through the plugin's own hooks (accel_save_state) and accel_fsdp.load_sharded: save on 2 processes, load in
    the same process right after saving (#3896), and in new runs on 1 and on 2 processes (resharding). Every load
    gives back bitwise the parameters and optimizer state that were saved."""
    ckpt = tmp_path / "ckpt"
    extra = ("--fsdp_state_dict_type", kind)
    launch(tmp_path, 2, str(tmp_path / "a"), "--steps", "6", "--save_at", "3", "--ckpt", str(ckpt), "--reload",
           "--direct", flags=extra)
    saved = state(tmp_path / "a", "saved")
    assert saved[1]["state"], "the optimizer had taken steps"
    assert_identical(saved, state(tmp_path / "a", "reloaded"), "reloaded")
    if kind == "SHARDED_STATE_DICT":
        for item in ("model", "optimizer"):
            files = sorted(p.name for p in (ckpt / item).iterdir())
            assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files  # one shard file per process
    else:
        assert sorted(p.name for p in ckpt.iterdir()) == ["model.safetensors", "optimizer.pt"]
        assert_identical(load_file(str(ckpt / "model.safetensors")), saved[0], "model.safetensors")
    for n in (1, 2) if kind == "SHARDED_STATE_DICT" else (1,):
        out = tmp_path / f"b{n}"
        launch(tmp_path, n, str(out), "--steps", "5", "--start", "3", "--load", str(ckpt), "--direct", flags=extra)
        assert_identical(saved, state(out, "loaded"), f"loaded on {n}")
        final = state(out, "final")[0]
        assert all(torch.isfinite(v).all() for v in final.values())
        assert any(not torch.equal(final[k], saved[0][k]) for k in final), "training went on after loading"


def test_dcp_metadata_is_read_without_running_code(tmp_path: Path) -> None:
    """A DCP index (.metadata) that would run code when unpickled is refused; a real one is read."""
    import torch.distributed.checkpoint as dcp

    from accel_fsdp.checkpoint import SafeReader

    good = tmp_path / "good"
    dcp.save({"w": torch.arange(6.0).reshape(2, 3), "lr": 0.5}, checkpoint_id=good)  # one process, no group
    target = {"w": torch.zeros(2, 3), "lr": 0.0}
    dcp.load(target, checkpoint_id=good, storage_reader=SafeReader(good))
    assert torch.equal(target["w"], torch.arange(6.0).reshape(2, 3)) and target["lr"] == 0.5

    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    (bad / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(UsageError, match="refusing to load checkpoint metadata that references posix.system"):
        SafeReader(bad).read_metadata()
    assert not marker.exists()
