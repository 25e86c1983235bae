"""Fault injection: forged, corrupt and unwritable checkpoints, and the error messages around them.

Each test prints what it tried and what survived (run with ``-s`` to see it). Loading never runs code from a
checkpoint: every forged file carries a pickle whose unpickling would create a marker file, and the marker must
never appear; every case ends with one clear error line (``accel.CheckpointError``, an ``Exception``) on every
process, within seconds; nothing published is lost.

Full disk: a small tmpfs mounted by the test (needs root, or CAP_SYS_ADMIN); without it, RLIMIT_FSIZE (``ulimit
-f``) in the process. Read-only: the tmpfs remounted read-only (chmod does not stop root).
(Kill -9 during saves: tests of the asynchronous save; killing the launcher: tests of ``accel launch``.)
"""

from __future__ import annotations

import io
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from clitools import deepspeed_env
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import CheckpointError, Kernel, ProjectConfiguration, UsageError
from accel.checkpoint import MANIFEST, dcp_load

HERE = Path(__file__).parent
ACCEL = str(Path(sys.executable).parent / "accel")
ROOT = HERE.parent


class Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def torch_pickle(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"state": Exploit(marker)}, buf)
    return buf.getvalue()


def fix_manifest(ckpt: Path) -> None:
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"] = {name: (ckpt / name).stat().st_size for name in manifest["files"]}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def small_run(project: Path | None = None, **kwargs: Any) -> tuple[Kernel, nn.Module, Any]:
    config = ProjectConfiguration(automatic_checkpoint_naming=True) if project else None
    kernel = Kernel(cpu=True, project_dir=project, project_config=config, **kwargs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 2)), batch_size=4, shuffle=True)
    model, optimizer, loader = kernel.prepare(model, optimizer, loader)
    for x, y in loader:
        kernel.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        break
    return kernel, model, optimizer


# ---------------------------------------------------------------------------------------------------------------
# forged and corrupt files, one process


def test_a_pickle_in_place_of_every_file_of_the_kernel_format_is_refused(tmp_path: Path) -> None:
    kernel, _, _ = small_run()
    good = kernel.save_state(tmp_path / "good")
    marker = tmp_path / "pwned"
    names = sorted(json.loads((good / MANIFEST).read_text())["files"]) + [MANIFEST]
    for name in names:
        for kind, payload in (("pickle", pickle.dumps(Exploit(marker))), ("torch file", torch_pickle(marker))):
            bad = tmp_path / "bad"
            shutil.rmtree(bad, ignore_errors=True)
            shutil.copytree(good, bad)
            (bad / name).write_bytes(payload)
            if name != MANIFEST:
                fix_manifest(bad)
            with pytest.raises(CheckpointError) as info:
                kernel.load_state(bad)
            print(f"{kind} in place of {name}: {one_line(info.value)}")
            assert not marker.exists(), f"{kind} in place of {name} ran code"
    kernel.load_state(good)  # the original is untouched and loads


def test_same_size_corruption_of_every_kernel_file_is_one_line(tmp_path: Path) -> None:
    kernel, _, _ = small_run()
    good = kernel.save_state(tmp_path / "good")
    for name in sorted(json.loads((good / MANIFEST).read_text())["files"]):
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(good, bad)
        with open(bad / name, "r+b") as fh:
            fh.write(b"\xff" * min(8, (bad / name).stat().st_size))
        with pytest.raises(CheckpointError) as info:
            kernel.load_state(bad)
        print(f"first bytes of {name} overwritten: {one_line(info.value)}")


def test_forged_dcp_entries_are_refused_and_torch_default_would_run_them(tmp_path: Path) -> None:
    """A pickle appended to a .distcp file, an index entry pointing at it: torch's own load runs it (the control),
    accel.checkpoint.dcp_load refuses it in one line. The same for a tampered .metadata."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    good = tmp_path / "good"
    dcp.save({"w": torch.arange(6.0), "flag": True}, checkpoint_id=good)
    target = {"w": torch.zeros(6), "flag": False}
    dcp_load(target, good)
    assert torch.equal(target["w"], torch.arange(6.0)) and target["flag"] is True

    marker = tmp_path / "pwned"
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    metadata = pickle.loads((bad / ".metadata").read_bytes())
    index = next(k for k in metadata.storage_data if k.fqn == "flag")
    info = metadata.storage_data[index]
    payload = torch_pickle(marker)
    start = (bad / info.relative_path).stat().st_size
    with open(bad / info.relative_path, "ab") as fh:
        fh.write(payload)
    metadata.storage_data[index] = dataclasses.replace(info, offset=start, length=len(payload))
    (bad / ".metadata").write_bytes(pickle.dumps(metadata))

    with pytest.raises(CheckpointError, match="refusing entry 'flag': it is not a weights-only value .*posix.system"):
        dcp_load({"w": torch.zeros(6), "flag": False}, bad)
    assert not marker.exists()
    dcp.load({"w": torch.zeros(6), "flag": False}, checkpoint_id=bad)  # torch's default planner: runs it
    assert marker.exists(), "control: the forged entry is what torch's default load planner executes"
    marker.unlink()

    outside = dict(metadata.storage_data)  # only allowed classes, but data read from elsewhere
    metadata.storage_data = {
        k: dataclasses.replace(v, relative_path="../good/__0_0.distcp") for k, v in outside.items()
    }
    (bad / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="points at data '../good/__0_0.distcp' outside its directory"):
        dcp_load({"w": torch.zeros(6), "flag": False}, bad)

    (bad / ".metadata").write_bytes(pickle.dumps(Exploit(marker)))
    with pytest.raises(CheckpointError, match="references posix.system"):
        dcp_load({"w": torch.zeros(6), "flag": False}, bad)
    assert not marker.exists()

    shutil.rmtree(bad)
    shutil.copytree(good, bad)
    with open(next(bad.glob("*.distcp")), "r+b") as fh:  # same-size corruption
        fh.write(b"\xff" * 64)
    with pytest.raises(CheckpointError) as raised:  # not torch's CheckpointException, a BaseException
        dcp_load({"w": torch.zeros(6), "flag": False}, bad)
    print("corrupt .distcp:", one_line(raised.value))


# ---------------------------------------------------------------------------------------------------------------
# full disk and read-only, one process


@pytest.fixture()
def tmpfs(tmp_path: Path) -> Iterator[Path | None]:
    """A 2 MiB tmpfs under tmp_path, or None where mounting is not permitted."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _checkpoints(project: Path) -> list[str]:
    folder = project / "checkpoints"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_full_disk_save_keeps_the_last_checkpoint(tmp_path: Path, tmpfs: Path | None) -> None:
    project = (tmpfs or tmp_path) / "proj"
    kernel, _, _ = small_run(project)
    first = kernel.save_state()
    if tmpfs is not None:
        with open(tmpfs / "filler", "wb") as fh:
            try:
                while True:
                    fh.write(b"\0" * 65536)
                    fh.flush()
            except OSError:
                pass
        how = "tmpfs of 2 MiB filled up"
    else:
        how = "RLIMIT_FSIZE of 1 KiB (no tmpfs: mount not permitted)"
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    try:
        with pytest.raises(CheckpointError) as info:
            kernel.save_state()
    finally:
        if tmpfs is None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    print(f"{how}: save_state -> {one_line(info.value)}; on disk: {_checkpoints(project)}")
    assert _checkpoints(project) == [first.name], "the failed save left nothing behind, lost nothing"
    if tmpfs is not None:
        (tmpfs / "filler").unlink()
    assert kernel.load_state() == first
    assert kernel.save_state().name == "checkpoint_1"  # and saving works again once there is room


def test_read_only_target(tmp_path: Path, tmpfs: Path | None) -> None:
    if tmpfs is None and os.geteuid() == 0:
        pytest.skip("root ignores file modes and may not mount here: no way to make a read-only target")
    project = (tmpfs or tmp_path) / "proj"
    kernel, _, _ = small_run(project)
    first = kernel.save_state()
    if tmpfs is not None:
        subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
        how = "tmpfs remounted read-only"
    else:
        for path in (project, project / "checkpoints"):
            path.chmod(0o555)
        how = "chmod 555 on the project"
    try:
        with pytest.raises(CheckpointError) as info:
            kernel.save_state()
        print(f"{how}: save_state -> {one_line(info.value)}; on disk: {_checkpoints(project)}")
        assert kernel.load_state() == first  # loading from a read-only place works
        with pytest.raises(CheckpointError) as info:
            kernel.save_state(project / "elsewhere")
        print(f"{how}: save_state(explicit dir) -> {one_line(info.value)}")
    finally:
        if tmpfs is not None:
            subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
        else:
            for path in (project, project / "checkpoints"):
                path.chmod(0o755)
    assert _checkpoints(project) == [first.name]


# ---------------------------------------------------------------------------------------------------------------
# error messages (the checkpoint part)


def test_load_state_on_a_regular_file_says_so(tmp_path: Path) -> None:
    kernel, _, _ = small_run()
    ck = kernel.save_state(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        kernel.load_state(ck / MANIFEST)
    with pytest.raises(CheckpointError, match="does not exist"):
        kernel.load_state(tmp_path / "nowhere")


@pytest.mark.parametrize("value", ["2", 2.0, True, 0, -1])
def test_project_configuration_total_limit_is_checked_at_construction(value: Any) -> None:
    with pytest.raises(UsageError, match=r"total_limit=\.\.\.\) must be a whole number of at least 1"):
        ProjectConfiguration(total_limit=value)
    assert ProjectConfiguration(total_limit=2).total_limit == 2


def test_project_configuration_other_fields() -> None:
    with pytest.raises(UsageError, match="iteration"):
        ProjectConfiguration(iteration="3")
    with pytest.raises(UsageError, match="automatic_checkpoint_naming"):
        ProjectConfiguration(automatic_checkpoint_naming="yes")
    with pytest.raises(UsageError, match="project_dir"):
        ProjectConfiguration(project_dir=5)


def test_kernel_project_config_must_be_a_project_configuration() -> None:
    with pytest.raises(
        UsageError,
        match=r"takes an accel.ProjectConfiguration, got str 'runs'; for a directory use "
        r"Kernel\(project_dir='runs'\)",
    ):
        Kernel(cpu=True, project_config="runs")


def test_prepare_of_a_prepared_object_returns_it_as_is() -> None:
    kernel = Kernel(cpu=True)
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)
    prepared = kernel.prepare(model, optimizer, loader, scheduler)
    again = kernel.prepare(*prepared)
    assert all(a is b for a, b in zip(prepared, again, strict=True))
    assert kernel.prepare(prepared[0]) is prepared[0]
    assert (len(kernel._models), len(kernel._optimizers), len(kernel._dataloaders), len(kernel._schedulers)) == (
        1,
        1,
        1,
        1,
    )


def test_deepspeed_stage_must_be_a_number(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from accel import Settings
    from accel.options import resolve
    from accel.plugins import Plugins
    from accel_deepspeed import config

    path = tmp_path / "ds.json"
    for stage in ("two", "2", 4, True):
        path.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
        plugins = Plugins.load(env={})
        values, sources = resolve(plugins.options(), env={}, flags={"deepspeed_config_file": str(path)})
        settings = Settings(values, sources, world_size=1, phase="launch", env={})
        with pytest.raises(UsageError) as info:
            config.base_config(settings)
        assert f"zero_optimization.stage is {stage!r}; write a number 0, 1, 2 or 3" in one_line(info.value)


# ---------------------------------------------------------------------------------------------------------------
# two processes, every plugin format


def launch(tmp: Path, *args: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess[str], list[list[dict]]]:
    env = deepspeed_env(tmp)
    out = tmp / "out"
    proc = subprocess.run(
        [ACCEL, "launch", "-q", "-n", "2", str(HERE / "scripts" / "fault_cases.py"), str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp,
    )
    ranks = []
    for rank in (0, 1):
        path = out / f"rank{rank}.jsonl"
        ranks.append([json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [])
    return proc, ranks


def report(ranks: list[list[dict]]) -> None:
    for line0, line1 in zip(*ranks, strict=True):
        print(f"- {line0['case']}: tried {line0['tried']}")
        for rank, line in ((0, line0), (1, line1)):
            print(
                f"    process {rank}: {line['outcome']} {line['type']}: {line['message']} ({line['seconds']} s, "
                f"marker {'CREATED' if line['marker'] else 'absent'}){' | ' + line['survived'] if line['survived'] else ''}"
            )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_forged_and_corrupt_checkpoints_of_every_plugin_on_two_processes(tmp_path: Path) -> None:
    """ddp (the kernel's format), fsdp sharded and full, DeepSpeed ZeRO-2/3: forged .distcp entries, a tampered
    .metadata, same-size corruption, a forged partition of process 0 only, a pickle in place of every file; a ddp
    checkpoint under fsdp. Every case: CheckpointError on both processes within seconds, the marker never made."""
    pytest.importorskip("deepspeed")
    proc, ranks = launch(tmp_path, "forge")
    report(ranks)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert len(ranks[0]) == len(ranks[1]) > 40
    assert "Traceback" not in proc.stderr, proc.stderr[-6000:]  # no process printed one (DCP logs them itself)
    for line0, line1 in zip(*ranks, strict=True):
        assert line0["case"] == line1["case"]
        for line in (line0, line1):
            assert not line["marker"], f"{line['case']}: code from the checkpoint ran"
            if line["case"].endswith(".py"):  # DeepSpeed's recovery scripts (run by hand): loading never opens them
                assert line["outcome"] == "returned", line
                continue
            assert line["outcome"] == "error" and line["type"] == "CheckpointError", line
            assert "\n" not in line["message"] and line["seconds"] < 30, line
    by_case = {line["case"]: line["message"] for line in ranks[1]}
    assert "holds DTensor values" in by_case["ddp checkpoint loaded under fsdp"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["tmpfs", "rlimit"])
def test_full_disk_and_read_only_saves_on_two_processes(tmp_path: Path, tmpfs: Path | None, how: str) -> None:
    """ddp, fsdp sharded and full, DeepSpeed ZeRO-2: save_state onto a full disk (a tmpfs, or RLIMIT_FSIZE) and a
    read-only file system (the tmpfs remounted) fails with one line on both processes; the checkpoint saved before
    survives and loads."""
    pytest.importorskip("deepspeed")
    if how == "rlimit":
        tmpfs = None
    elif tmpfs is None:
        pytest.skip("mounting a tmpfs is not permitted here (the rlimit case covers a full disk)")
    if tmpfs is not None:
        subprocess.run(["mount", "-o", "remount,size=4m", str(tmpfs)], check=True)
    proc, ranks = launch(tmp_path, "disk", str(tmpfs) if tmpfs is not None else "rlimit")
    report(ranks)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert len(ranks[0]) == len(ranks[1]) == (16 if tmpfs is not None else 8)
    for line0, line1 in zip(*ranks, strict=True):
        for line in (line0, line1):
            expected = (
                "returned"
                if line["case"].endswith(("after the failed save", "read-only file system"))
                and "load_state" in line["case"]
                else "error"
            )
            assert line["outcome"] == expected, line
            assert "\n" not in line["message"] and line["seconds"] < 30, line
            assert line["survived"].startswith("latest complete checkpoint: checkpoint_0; leftovers: []"), line
            if expected == "error":
                assert line["type"] == "CheckpointError", line
