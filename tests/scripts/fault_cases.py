"""Worker of tests/test_fault_injection.py: forged, corrupt and unwritable checkpoints on 2 processes.

    accel launch -n 2 fault_cases.py OUT GROUP [MOUNT]

GROUP ``forge``: for each plugin format (ddp = the kernel's own format, fsdp sharded, fsdp full state dict,
DeepSpeed ZeRO-2 and ZeRO-3) a run trains two steps and saves; process 0 then forges or damages the files of a
copy (a pickle appended to a ``.distcp`` file with an index entry pointing at it, a pickle in place of each file in
turn, a same-size corruption) with manifest sizes fixed, and a fresh Kernel calls ``load_state`` on every process.
The payload would create a marker file. GROUP ``disk``: the project lives on MOUNT (a small tmpfs, mounted by the
test); a first checkpoint is saved, then the disk is filled (or, with ``MOUNT`` = ``rlimit``, RLIMIT_FSIZE limits
file sizes), or MOUNT is remounted read-only, and ``save_state`` runs again; then the first checkpoint is loaded.

Every process appends one JSON line per case to ``OUT/rank<r>.jsonl``: what was tried, the outcome (``error`` with
the exception's type and message, or ``returned``), the seconds it took, whether the marker exists, what survived.
The process group has a 60 s timeout, so a process stranded in a collective shows up as a timeout error.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel, ProjectConfiguration
from accel.checkpoint import MANIFEST

OUT = Path(sys.argv[1])
GROUP = sys.argv[2]
MOUNT = sys.argv[3] if len(sys.argv) > 3 else ""
RANK = int(os.environ["RANK"])
MARKER = OUT / "pwned"


class Exploit:
    """Unpickling this runs ``touch MARKER`` (the pickle references os.system only)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {MARKER}",))


def exploit_torch_file() -> bytes:
    buf = io.BytesIO()
    torch.save({"state": Exploit()}, buf)
    return buf.getvalue()


def exploit_pickle() -> bytes:
    return pickle.dumps(Exploit())


def record(case: str, tried: str, fn: Callable[[], Any], survived: Callable[[], str] = lambda: "") -> None:
    start = time.monotonic()
    try:
        fn()
        outcome, kind, message = "returned", "", ""
    except Exception as exc:  # what a user's `except Exception` sees
        outcome, kind, message = "error", type(exc).__name__, str(exc)
    except BaseException as exc:  # noqa: BLE001 - e.g. torch's CheckpointException: must not get here
        outcome, kind, message = "base-exception", type(exc).__name__, str(exc)
    seconds = round(time.monotonic() - start, 2)
    dist.barrier()
    line = {
        "case": case,
        "tried": tried,
        "outcome": outcome,
        "type": kind,
        "message": message,
        "seconds": seconds,
        "marker": MARKER.exists(),
        "survived": survived(),
    }
    with open(OUT / f"rank{RANK}.jsonl", "a") as fh:
        fh.write(json.dumps(line) + "\n")
    MARKER.unlink(missing_ok=True)
    dist.barrier()


def build(project: str | None = None, **kwargs: Any) -> tuple[Kernel, nn.Module, Any]:
    config = ProjectConfiguration(automatic_checkpoint_naming=True) if project else None
    kernel = Kernel(cpu=True, project_dir=project, project_config=config, **kwargs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    gen = torch.Generator().manual_seed(1)
    loader = DataLoader(
        TensorDataset(torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)), batch_size=4, shuffle=True
    )
    model, optimizer, loader, scheduler = kernel.prepare(model, optimizer, loader, scheduler)
    return kernel, model, (optimizer, loader, scheduler)


def train(kernel: Kernel, model: nn.Module, parts: Any, steps: int = 2) -> None:
    optimizer, loader, scheduler = parts
    for step, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(model(x), y)
        kernel.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step + 1 == steps:
            break


def on_main(fn: Callable[[], Any]) -> None:
    if RANK == 0:
        fn()
    dist.barrier()


def fix_manifest(ckpt: Path) -> None:
    """What an attacker does after changing files: record the new sizes, so the size check passes."""
    path = ckpt / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["files"] = {name: (ckpt / name).stat().st_size for name in manifest["files"]}
    path.write_text(json.dumps(manifest))


def copy_of(ckpt: Path, name: str) -> Path:
    target = ckpt.parent / name
    on_main(lambda: (shutil.rmtree(target, ignore_errors=True), shutil.copytree(ckpt, target)))
    return target


def files_of(ckpt: Path) -> list[str]:
    return sorted(json.loads((ckpt / MANIFEST).read_text())["files"])


# ---------------------------------------------------------------------------------------------------------------
# forge


def forge_distcp(dcp_dir: Path, fqn: str) -> str:
    """Append a torch-format pickle to the .distcp file that holds the bytes entry ``fqn`` and point the index at it
    (DCP's default planner would torch.load(weights_only=False) it)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = pickle.loads((dcp_dir / ".metadata").read_bytes())
    assert isinstance(metadata.state_dict_metadata[fqn], BytesStorageMetadata), fqn
    index = next(k for k in metadata.storage_data if k.fqn == fqn)
    info = metadata.storage_data[index]
    data = dcp_dir / info.relative_path
    payload = exploit_torch_file()
    start = data.stat().st_size
    with open(data, "ab") as fh:
        fh.write(payload)
    metadata.storage_data[index] = dataclasses.replace(info, offset=start, length=len(payload))
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    return f"{info.relative_path} (entry {fqn!r})"


def relabel_tensor_as_bytes(dcp_dir: Path) -> str:
    """Turn a tensor entry of the index into a bytes entry pointing at an appended pickle."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    metadata = pickle.loads((dcp_dir / ".metadata").read_bytes())
    fqn = sorted(k for k, v in metadata.state_dict_metadata.items() if not isinstance(v, BytesStorageMetadata))[0]
    infos = {k: v for k, v in metadata.storage_data.items() if k.fqn == fqn}
    first = min(infos, key=lambda k: k.index or 0)
    data = dcp_dir / infos[first].relative_path
    payload = exploit_torch_file()
    start = data.stat().st_size
    with open(data, "ab") as fh:
        fh.write(payload)
    for k in infos:
        del metadata.storage_data[k]
    metadata.storage_data[MetadataIndex(fqn)] = dataclasses.replace(infos[first], offset=start, length=len(payload))
    metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    return f"{infos[first].relative_path} (tensor {fqn!r} relabelled as bytes)"


def every_file_replaced(case: str, kernel: Kernel, ckpt: Path, load: Callable[[Path], Any] | None = None) -> None:
    """A pickle in place of each file of the checkpoint in turn (torch-format for .pt/.distcp, raw otherwise)."""
    load = load or kernel.load_state
    for name in files_of(ckpt) + [MANIFEST]:
        bad = copy_of(ckpt, f"{ckpt.name}_replaced")

        def forge(name: str = name, bad: Path = bad) -> None:
            raw = name.endswith((".pt", ".distcp", ".bin"))
            (bad / name).write_bytes(exploit_torch_file() if raw else exploit_pickle())
            if name != MANIFEST:
                fix_manifest(bad)

        on_main(forge)
        record(
            f"{case}: pickle in place of {name}",
            f"replaced {name} by a pickle that runs code, manifest sizes fixed",
            lambda bad=bad: load(bad),
        )


def forge_group() -> None:
    base = OUT / "ck"
    # ---- the kernel's own format under DDP
    kernel, model, parts = build(plugins=["ddp"])
    train(kernel, model, parts)
    ddp_ck = Path(kernel.save_state(base / "ddp"))
    every_file_replaced("ddp", kernel, ddp_ck)
    kernel.end_training()

    # ---- FSDP, sharded (DCP)
    kernel, model, parts = build(plugins=["fsdp"])
    train(kernel, model, parts)
    ck = Path(kernel.save_state(base / "fsdp_sharded"))
    bad = copy_of(ck, "fsdp_forged_distcp")
    where: list[str] = []
    on_main(lambda: where.append(forge_distcp(bad / "optimizer", "accel_fsdp_fresh")) or fix_manifest(bad))
    record(
        "fsdp sharded: pickle appended to a .distcp, index entry points at it",
        "appended a torch-format pickle to optimizer/*.distcp, pointed the bytes entry 'accel_fsdp_fresh' at it, "
        "fixed the manifest sizes",
        lambda: kernel.load_state(bad),
    )
    from accel_fsdp import load_sharded

    record(
        "fsdp sharded: the same forged .distcp through accel_fsdp.load_sharded",
        "load_sharded(model, optimizer)",
        lambda: load_sharded(kernel, bad, model=model, optimizer=parts[0]),
    )
    bad = copy_of(ck, "fsdp_relabelled")
    on_main(lambda: relabel_tensor_as_bytes(bad / "model") and fix_manifest(bad))
    record(
        "fsdp sharded: a tensor entry relabelled as bytes, pointing at an appended pickle",
        "model/.metadata: tensor entry turned into a bytes entry at an appended pickle, sizes fixed",
        lambda: kernel.load_state(bad),
    )
    bad = copy_of(ck, "fsdp_metadata")
    on_main(lambda: ((bad / "model" / ".metadata").write_bytes(exploit_pickle()), fix_manifest(bad)))
    record(
        "fsdp sharded: tampered .metadata",
        "model/.metadata replaced by a pickle that runs code, sizes fixed",
        lambda: kernel.load_state(bad),
    )
    bad = copy_of(ck, "fsdp_corrupt")

    def corrupt() -> None:
        data = sorted((bad / "model").glob("*.distcp"))[0]
        with open(data, "r+b") as fh:
            fh.write(b"\xff" * 64)

    on_main(corrupt)
    record(
        "fsdp sharded: same-size corruption of a .distcp",
        "overwrote the first 64 bytes of model/__0_0.distcp",
        lambda: kernel.load_state(bad),
    )
    every_file_replaced("fsdp sharded", kernel, ck)
    kernel.end_training()

    # ---- a DDP checkpoint into an FSDP run
    kernel, model, parts = build(plugins=["fsdp"])
    record(
        "ddp checkpoint loaded under fsdp",
        "load_state of the ddp run's checkpoint with --plugin fsdp",
        lambda: kernel.load_state(ddp_ck),
    )
    kernel.end_training()

    # ---- FSDP, full state dict
    kernel, model, parts = build(plugins=["fsdp"], fsdp_state_dict_type="FULL_STATE_DICT")
    train(kernel, model, parts)
    ck = Path(kernel.save_state(base / "fsdp_full"))
    bad = copy_of(ck, "fsdp_full_corrupt")

    def corrupt_header() -> None:
        with open(bad / "model.safetensors", "r+b") as fh:
            fh.write(b"\xff" * 8)

    on_main(corrupt_header)
    record(
        "fsdp full: same-size corruption of model.safetensors (only process 0 reads it)",
        "overwrote the 8-byte header length of model.safetensors",
        lambda: kernel.load_state(bad),
    )
    every_file_replaced("fsdp full", kernel, ck)
    kernel.end_training()

    # ---- DeepSpeed ZeRO-2 and ZeRO-3
    for stage in (2, 3):
        kernel, model, parts = build(plugins=["deepspeed"], zero_stage=stage)
        train(kernel, model, parts)
        ck = Path(kernel.save_state(base / f"zero{stage}"))
        bad = copy_of(ck, f"zero{stage}_rank0_optim")

        def forge_rank0_optim(bad: Path = bad) -> None:
            target = next(p for p in sorted(bad.rglob("*optim_states.pt")) if "pp_rank_0_" in p.name)
            target.write_bytes(exploit_torch_file())
            fix_manifest(bad)

        on_main(forge_rank0_optim)
        record(
            f"deepspeed ZeRO-{stage}: process 0's optimizer partition forged",
            "replaced zero_pp_rank_0_*_optim_states.pt by a torch file that runs code",
            lambda kernel=kernel, bad=bad: kernel.load_state(bad),
        )
        every_file_replaced(f"deepspeed ZeRO-{stage}", kernel, ck)
        kernel.end_training()


# ---------------------------------------------------------------------------------------------------------------
# disk


def fill(mount: Path) -> None:
    """Write zeros until the file system is full."""
    with open(mount / "filler", "wb") as fh:
        chunk = b"\0" * (1 << 16)
        try:
            while True:
                fh.write(chunk)
                fh.flush()
        except OSError:
            pass


def disk_group() -> None:
    mount = Path(MOUNT) if MOUNT != "rlimit" else None
    plugins: list[tuple[str, dict[str, Any]]] = [
        ("ddp", {"plugins": ["ddp"]}),
        ("fsdp sharded", {"plugins": ["fsdp"]}),
        ("fsdp full", {"plugins": ["fsdp"], "fsdp_state_dict_type": "FULL_STATE_DICT"}),
        ("deepspeed ZeRO-2", {"plugins": ["deepspeed"], "zero_stage": 2}),
    ]
    for i, (name, kwargs) in enumerate(plugins):
        project = (mount or OUT) / f"proj{i}"
        kernel, model, parts = build(project=str(project), **kwargs)
        train(kernel, model, parts)
        first = Path(kernel.save_state())
        train(kernel, model, parts)

        def survived(first: Path = first, kernel: Kernel = kernel) -> str:
            latest = kernel.latest_checkpoint()
            stale = sorted(p.name for p in first.parent.iterdir() if p.name.startswith("."))
            return f"latest complete checkpoint: {latest.name if latest else None}; leftovers: {stale}"

        if mount is not None:
            on_main(lambda: fill(mount))
            record(
                f"{name}: save_state onto a full disk",
                f"filled the {MOUNT} tmpfs, then save_state()",
                kernel.save_state,
                survived,
            )
            on_main(lambda: (mount / "filler").unlink())
        else:

            def limited_save(kernel: Kernel = kernel) -> None:
                soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
                resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
                try:
                    kernel.save_state()
                finally:
                    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

            record(
                f"{name}: save_state with RLIMIT_FSIZE=1 KiB",
                "ulimit -f: files over 1 KiB fail (EFBIG)",
                limited_save,
                survived,
            )
        record(f"{name}: load_state after the failed save", "load_state() of the project", kernel.load_state, survived)
        if mount is not None:
            on_main(lambda: subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True))
            record(
                f"{name}: save_state onto a read-only file system",
                "remounted the tmpfs read-only, save_state()",
                kernel.save_state,
                survived,
            )
            record(
                f"{name}: load_state from the read-only file system",
                "load_state() of the project",
                kernel.load_state,
                survived,
            )
            on_main(lambda: subprocess.run(["mount", "-o", "remount,rw", str(mount)], check=True))
        kernel.end_training()


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    {"forge": forge_group, "disk": disk_group}[GROUP]()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
