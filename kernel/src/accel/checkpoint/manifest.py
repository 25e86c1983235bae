"""A checkpoint directory: its manifest, atomic publication, the numbered checkpoints of a project, and how the
processes agree on the outcome of each step.

The manifest records, for every item, which plugin wrote it (``"accel"`` for the kernel), the plugin's version,
the format and the files, plus the size of every file in the directory. :func:`read_manifest` refuses a directory
that holds a file the manifest does not list (a stray ``*.pkl`` is never opened) or a listed file of the wrong size.

Publishing is atomic: every process writes into ``.<name>.tmp-<token>`` next to the target, files are fsynced, the
main process writes the manifest, fsyncs, and renames the directory into place. A crash at any moment leaves the
previous complete checkpoint (and perhaps a temporary directory that is ignored and removed later) or the new one.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from accel.checkpoint.files import fsync_all, fsync_path, read_json, weights_only_reason, write_json
from accel.contract import ItemRecord
from accel.errors import CheckpointError
from accel.options import KERNEL

if TYPE_CHECKING:
    from accel.checkpoint.items import Item
    from accel.contract import KernelView
    from accel.kernel import Kernel

MANIFEST = "accel_manifest.json"
MANIFEST_FORMAT = "accel-checkpoint"
MANIFEST_VERSION = 1
CHECKPOINTS = "checkpoints"
_CHECKPOINT_NAME = re.compile(r"^checkpoint_(\d+)$")
_STALE = re.compile(r"^\.checkpoint_\d+\.(tmp|old|del)-[0-9a-f]+$")


# --------------------------------------------------------------------------------------------------------------
# Project layout


def checkpoints_folder(project_dir: str | os.PathLike[str]) -> Path:
    return Path(project_dir) / CHECKPOINTS


def numbered_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """``checkpoint_<i>`` directories of ``folder`` (complete or not), oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = _CHECKPOINT_NAME.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a published checkpoint (its manifest exists; it is written last)."""
    return (path / MANIFEST).is_file()


def latest_checkpoint(project_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``project_dir/checkpoints`` whose files match its manifest, or None."""
    for _, path in reversed(numbered_checkpoints(checkpoints_folder(project_dir))):
        if not is_complete(path):
            continue
        try:
            read_manifest(path)
        except CheckpointError as exc:
            warnings.warn(f"skipping damaged checkpoint {path}: {exc}", RuntimeWarning, stacklevel=2)
            continue
        return path
    return None


# --------------------------------------------------------------------------------------------------------------
# Agreement between processes


def _agreed(kernel: KernelView, what: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every process and make every process raise if any of them failed (so no process waits
    forever in a collective that a failed process never reaches). Returns ``fn``'s result."""
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except OSError as exc:  # a full disk, a read-only file system: one line like any checkpoint error
        error = CheckpointError(f"{what} failed: {_one_line(exc)}")
    except Exception as exc:
        error = exc if type(exc).__name__ != "SafetensorError" else CheckpointError(f"{what} failed: {_one_line(exc)}")
    except BaseException as exc:  # torch's CheckpointException is a BaseException: not an interrupt, an error
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        error = CheckpointError(f"{what} failed: {_one_line(exc)}")
    messages = kernel.collectives.all_gather_object(None if error is None else _one_line(error))
    if error is not None:
        raise error
    for rank, message in enumerate(messages):
        if message is not None:
            raise CheckpointError(f"{what} failed on process {rank}: {message}")
    return result


def agree(kernel: KernelView, what: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every process; if it failed on any, raise :class:`CheckpointError` (one line, naming the
    process) on every process. Plugins call it around work that can fail on some processes only (a file only the
    main process reads or writes) BEFORE the next collective, so that no process waits in a collective that a
    failed process never reaches. Collective: call it on every process. Returns ``fn``'s result."""
    return _agreed(kernel, what, fn)


def error_line(exc: BaseException) -> str:
    """``"Type: first line"`` of an error; for torch.distributed.checkpoint's ``CheckpointException`` (one
    traceback per process), the first failing process's error."""
    return _one_line(exc)


def _one_line(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint's CheckpointException: {rank: (exc, tb)}
    if isinstance(failures, dict) and failures:
        rank, wrapped = min(failures.items())
        inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
        if isinstance(inner, BaseException):
            return f"{_one_line(inner)} (process {rank})"
    if str(exc).startswith("Weights only load failed"):
        return weights_only_reason(exc)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


# --------------------------------------------------------------------------------------------------------------
# Manifest


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a checkpoint, after checking that the directory holds exactly the files it lists, with
    their recorded sizes. Raises :class:`CheckpointError` saying what is wrong."""
    path = directory / MANIFEST
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(
            f"checkpoint {directory} is a file, not a checkpoint directory: give the directory that save_state wrote"
        )
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} does not exist")
    if not path.is_file():
        raise CheckpointError(
            f"{directory} is not a complete accel checkpoint (no {MANIFEST}); it may be a partial "
            "save or another library's checkpoint, and is not loaded"
        )
    manifest = read_json(path)
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{path} is not an accel checkpoint manifest")
    if int(manifest.get("version", 0)) > MANIFEST_VERSION:
        raise CheckpointError(
            f"{directory} was written by a newer accel (manifest version {manifest['version']}); "
            "upgrade accel-kernel to load it"
        )
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not all(isinstance(v, int) for v in listed.values()):
        raise CheckpointError(f"{path} is malformed: 'files' must map file names to sizes")
    present = _files_under(directory)
    present.pop(MANIFEST, None)
    unexpected = sorted(set(present) - set(listed))
    if unexpected:
        raise CheckpointError(
            f"refusing to load {directory}: it holds file(s) its manifest does not list: "
            f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''} (remove them if "
            "you trust them; they are never opened)"
        )
    missing = sorted(set(listed) - set(present))
    if missing:
        raise CheckpointError(f"checkpoint {directory} is damaged: missing file(s) {', '.join(missing[:5])}")
    for name, size in listed.items():
        if present[name] != size:
            raise CheckpointError(
                f"checkpoint {directory} is damaged: {name} has {present[name]} bytes, the manifest says {size}"
            )
    return manifest


def _files_under(directory: Path) -> dict[str, int]:
    """Every entry below ``directory`` that is not a directory, with its size (-1 for links: a save never
    writes links, so a link is always refused)."""
    out: dict[str, int] = {}
    for root, dirs, files in os.walk(directory, followlinks=False):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, directory).replace(os.sep, "/")
            out[rel] = -1 if os.path.islink(full) else os.lstat(full).st_size
    return out


def _records(manifest: Mapping[str, Any]) -> dict[str, ItemRecord]:
    records = {}
    try:
        for key, rec in manifest["items"].items():
            records[str(key)] = ItemRecord(
                plugin=str(rec["plugin"]),
                format=str(rec["format"]),
                files=tuple(str(f) for f in rec.get("files", ())),
                version=str(rec.get("version", "")),
                extra=dict(rec.get("extra", {})),
            )
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise CheckpointError(f"malformed checkpoint manifest: {type(exc).__name__}: {exc}") from None
    return records


def _publish(
    kernel: Kernel,
    items: Mapping[str, Item],
    records: Mapping[str, ItemRecord],
    target: Path,
    tmp: Path,
    index: int | None,
) -> None:
    """Main process: write the manifest of ``records`` (every item's writer, merged over processes) into ``tmp``,
    flush what is not flushed yet and rename ``tmp`` to ``target``; then prune old numbered checkpoints."""
    from accel import __version__

    entries: dict[str, dict[str, Any]] = {}
    for key, item in items.items():
        rec = dataclasses.asdict(records[key])
        rec["files"] = list(rec["files"])
        rec["extra"] = {"kind": item.kind, "provider": item.provider, "per_rank": item.per_rank, **rec["extra"]}
        if item.per_rank:
            rec["extra"]["world_size"] = kernel.num_processes
        entries[key] = rec
    present = _files_under(tmp)
    for key, rec in entries.items():
        for f in rec["files"]:
            if f not in present and not any(p.startswith(f.rstrip("/") + "/") for p in present):
                raise CheckpointError(f"checkpoint item {key!r}: file {f!r} was not written")
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "accel_version": __version__,
        "torch_version": torch.__version__,
        "world_size": kernel.num_processes,
        "iteration": index,
        "items": entries,
        "files": present,
    }
    own = {f for rec in records.values() if rec.plugin == KERNEL for f in rec.files}  # flushed by their writer
    dirs = [os.path.join(root, d) for root, subdirs, _ in os.walk(tmp) for d in subdirs]
    fsync_all([*(tmp / name for name in present if name not in own), *dirs])  # what plugins wrote
    write_json(tmp / MANIFEST, manifest)
    fsync_path(tmp)
    aside = None
    if target.exists():
        aside = target.parent / f".{target.name}.old-{tmp.name.rsplit('-', 1)[1]}"
        os.rename(target, aside)
    os.rename(tmp, target)
    fsync_path(target.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    if index is not None:
        _prune(target.parent, kernel.project_configuration.total_limit)


def _remove_stale(folder: Path, name: str | None = None) -> None:
    """Temporary, set-aside and half-deleted directories that crashed saves left in ``folder``: of every
    ``checkpoint_<i>``, or only of the checkpoint called ``name``."""
    if not folder.is_dir():
        return
    pattern = _STALE if name is None else re.compile(rf"^\.{re.escape(name)}\.(tmp|old|del)-[0-9a-f]+$")
    for entry in folder.iterdir():
        if pattern.match(entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def _prune(folder: Path, total_limit: int | None) -> None:
    if total_limit is None:
        return
    complete = [(i, p) for i, p in numbered_checkpoints(folder) if is_complete(p)]
    for _, path in complete[: max(0, len(complete) - total_limit)]:
        doomed = folder / f".{path.name}.del-{secrets.token_hex(6)}"
        os.rename(path, doomed)  # first out of sight, so a half-deleted checkpoint never looks complete
        shutil.rmtree(doomed, ignore_errors=True)
    fsync_path(folder)


def _recover(target: Path) -> None:
    """If a crash happened between setting an old checkpoint aside and renaming the new one into place, put the
    newest complete one back at ``target``."""
    if target.exists():
        return
    parent = target.parent
    if not parent.is_dir():
        return
    for kind in ("tmp", "old"):
        pattern = re.compile(rf"^\.{re.escape(target.name)}\.{kind}-[0-9a-f]+$")
        candidates = [p for p in parent.iterdir() if pattern.match(p.name) and is_complete(p)]
        if candidates:
            newest = max(candidates, key=lambda p: (p / MANIFEST).stat().st_mtime)
            os.rename(newest, target)
            fsync_path(parent)
            return
