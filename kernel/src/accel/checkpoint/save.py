"""``save_state``: plugins write the items they claim (``accel_save_state``), the kernel's own default
implementation of that hook, called last, writes every item nobody claimed, and the main process publishes the
checkpoint (:mod:`accel.checkpoint.manifest`). ``save_state(asynchronous=True)`` copies the kernel's items to CPU
memory on the calling thread, then writes and publishes them on a background thread
(:mod:`accel.checkpoint.asynchronous`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import shutil
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accel.checkpoint.asynchronous import finish_pending, pending_save, snapshot, start_async
from accel.checkpoint.files import TREE_FORMAT, fsync_all, write_tree
from accel.checkpoint.items import Item, _file_stem, _state_of, call_by_owner, collect_items
from accel.checkpoint.manifest import (
    _agreed,
    _publish,
    _recover,
    _remove_stale,
    checkpoints_folder,
    is_complete,
    numbered_checkpoints,
)
from accel.checkpoint.solo import LATE, SOLO, meet
from accel.checkpoint.user_hooks import run_save_hooks
from accel.contract import ItemRecord
from accel.errors import CheckpointError, PluginError, UsageError
from accel.options import KERNEL

if TYPE_CHECKING:
    import torch

    from accel.checkpoint.items import CheckpointKernel
    from accel.contract import KernelView


def save_state(
    kernel: CheckpointKernel, output_dir: str | os.PathLike[str] | None = None, asynchronous: bool | None = None
) -> Path:
    """See :meth:`accel.kernel.Kernel.save_state`."""
    if meet(kernel, output_dir) in (SOLO, LATE):
        return _save_alone(kernel, output_dir)
    finish_pending(kernel)  # an asynchronous save still in flight is published (or its error raised) first
    if asynchronous is None:
        asynchronous = bool(kernel.settings.get("async_save", False))
    items = collect_items(kernel)
    plan = _agreed(kernel, "save_state", lambda: _plan_target(kernel, output_dir) if kernel.is_main_process else None)
    target, tmp, index = kernel.collectives.broadcast_object(plan, 0)
    target, tmp = Path(target), Path(tmp)
    try:
        items = run_save_hooks(kernel, items, tmp, alone=False)
        # 1. plugins write the items they claim (every process), 2. the kernel's default implementation writes the
        # rest (main process; every process its per-process items), 3. the main process writes the manifest and
        # renames. Each step ends with every process learning whether any process failed.
        records = _gather_records(
            kernel,
            items,
            _agreed(kernel, "save_state (plugins)", lambda: _save_hook(kernel, items, tmp, asynchronous, False)),
        )
        unclaimed = {key: item for key, item in items.items() if key not in records}
        positions = kernel.settings.get("script_skips_batches")  # the script skips: each epoch's start instead
        _WRITING[kernel] = _Writing(
            {k: _as_accelerate_saves(i) for k, i in unclaimed.items()} if positions else unclaimed
        )
        try:
            own = _agreed(
                kernel,
                "save_state (copying)" if asynchronous else "save_state (writing)",
                lambda: _save_hook(kernel, items, tmp, asynchronous, True),
            )
            packed = _WRITING[kernel].packed
        finally:
            del _WRITING[kernel]
        records.update(_gather_records(kernel, unclaimed, own))
        _check_all_written(items, records)
        if asynchronous:
            start_async(kernel, items, records, target, tmp, index, packed or {})
        else:
            _agreed(
                kernel,
                "save_state (publishing)",
                lambda: _publish(kernel, items, records, target, tmp, index) if kernel.is_main_process else None,
            )
    except BaseException:
        if kernel.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if index is not None:
        kernel.project_configuration.iteration = index + 1
    return target


def _save_alone(kernel: CheckpointKernel, output_dir: str | os.PathLike[str] | None) -> Path:
    """A save reached by the main process alone, in a run whose state is replicated (:mod:`accel.checkpoint.solo`):
    the main process writes every shared item and its own per-process items (their records list the processes
    that wrote them, ``extra["ranks"]``) and publishes, with no collective; a process that came too late
    (:data:`~accel.checkpoint.solo.LATE`) writes nothing. Always synchronous."""
    if not kernel.is_main_process:
        return Path(os.fspath(output_dir or "")).absolute()
    if pending_save(kernel) is not None:
        raise UsageError(
            "save_state on the main process alone while an asynchronous save_state of every process is in flight: "
            "call kernel.wait_for_save() on every process first"
        )
    items = collect_items(kernel)
    target_s, tmp_s, index = _plan_target(kernel, output_dir)
    target, tmp = Path(target_s), Path(tmp_s)
    try:
        items = run_save_hooks(kernel, items, tmp, alone=True)
        _WRITING[kernel] = _Writing({key: _as_accelerate_saves(item) for key, item in items.items()})
        try:
            written = _save_hook(kernel, items, tmp, False, True)
        finally:
            del _WRITING[kernel]
        records = {}
        for key, fields in written.items():
            rec = ItemRecord(**fields)
            if items[key].per_rank:
                rec = dataclasses.replace(rec, extra={**rec.extra, "ranks": [kernel.process_index]})
            records[key] = rec
        _check_all_written(items, records)
        _publish(kernel, items, records, target, tmp, index)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if kernel not in _TOLD_ALONE:
        _TOLD_ALONE.add(kernel)
        others = kernel.num_processes - 1
        logging.getLogger("accel.checkpoint").warning(
            f"save_state({target}) ran on the main process alone: it holds the shared state and process 0's random "
            f"states; the other {others} process(es)' random states are not saved, so a resume is not bitwise on "
            "them (as in Accelerate; call save_state on every process to save them)"
        )
    return target


_TOLD_ALONE: weakref.WeakSet[Any] = weakref.WeakSet()


@dataclass
class _PassStart:
    """A prepared dataloader as a save by the main process alone records it: where its current pass started
    (:meth:`accel.data.PreparedDataLoader.pass_start_state`)."""

    loader: Any

    def state_dict(self) -> dict[str, Any]:
        return dict(self.loader.pass_start_state())


def _as_accelerate_saves(item: Item) -> Item:
    if item.kind == "dataloader" and callable(getattr(item.obj, "pass_start_state", None)):
        return dataclasses.replace(item, obj=_PassStart(item.obj))
    return item


def _check_all_written(items: Mapping[str, Item], records: Mapping[str, ItemRecord]) -> None:
    nobody = sorted(set(items) - set(records))
    if nobody:
        raise CheckpointError(f"save_state: nobody wrote checkpoint item(s) {nobody}")


@dataclass
class _Writing:
    """What the kernel's default ``accel_save_state`` of a save in progress writes: the items nobody claimed, and
    (asynchronous saves) their CPU copies for the background writer, by key."""

    items: dict[str, Item]
    packed: dict[str, tuple[str, Any, dict[str, torch.Tensor]]] | None = None


_WRITING: weakref.WeakKeyDictionary[Any, _Writing] = weakref.WeakKeyDictionary()


def _save_hook(
    kernel: CheckpointKernel, items: Mapping[str, Item], tmp: Path, asynchronous: bool, kernel_only: bool
) -> dict[str, dict[str, Any]]:
    """Call ``accel_save_state`` of the plugins (``kernel_only=False``) or of the kernel's own default
    implementation (``True``) on this process; their records by key, as dicts (for ``all_gather_object``)."""
    objects = {key: item.obj for key, item in items.items()}
    args = {"kernel": kernel, "items": objects, "directory": tmp, "asynchronous": asynchronous}
    claims: dict[str, ItemRecord] = {}
    for name, answers in call_by_owner(
        kernel, "accel_save_state", lambda owner: args if (owner == KERNEL) == kernel_only else None
    ):
        for answer in answers:
            for key, rec in (answer or {}).items():
                if not isinstance(rec, ItemRecord):
                    raise PluginError(
                        f"plugin {name!r}: accel_save_state must return {{key: ItemRecord}}, got "
                        f"{type(rec).__name__} for {key!r}"
                    )
                if key in claims:
                    raise PluginError(f"checkpoint item {key!r} is claimed by both {claims[key].plugin!r} and {name!r}")
                for f in rec.files:
                    if os.path.isabs(f) or ".." in Path(f).parts:
                        raise PluginError(f"plugin {name!r}: item {key!r} names file {f!r} outside the checkpoint")
                claims[key] = dataclasses.replace(
                    rec, plugin=name, files=tuple(rec.files), version=rec.version or _plugin_version(kernel, name)
                )
    return {key: dataclasses.asdict(rec) for key, rec in claims.items()}


def _gather_records(
    kernel: KernelView, items: Mapping[str, Item], mine: Mapping[str, dict[str, Any]]
) -> dict[str, ItemRecord]:
    """The records of every process, merged (union of files); the writer of a key must be the same everywhere."""
    merged: dict[str, ItemRecord] = {}
    for rank_records in kernel.collectives.all_gather_object(dict(mine)):
        for key, fields in rank_records.items():
            rec = ItemRecord(**fields)
            if key not in merged:
                merged[key] = rec
            elif (merged[key].plugin, merged[key].format) != (rec.plugin, rec.format):
                raise CheckpointError(
                    f"processes disagree on who writes checkpoint item {key!r}: "
                    f"{merged[key].plugin!r} and {rec.plugin!r}"
                )
            else:
                merged[key] = dataclasses.replace(merged[key], files=tuple(sorted({*merged[key].files, *rec.files})))
    unknown = sorted(set(merged) - set(items))
    if unknown:
        raise CheckpointError(
            f"plugin {merged[unknown[0]].plugin!r} claimed checkpoint item(s) {unknown} that this run does not have"
        )
    return merged


def write_unclaimed(kernel: CheckpointKernel, directory: Path, asynchronous: bool) -> dict[str, ItemRecord]:
    """The kernel's default ``accel_save_state`` (:mod:`accel.defaults`): write every item of the save in progress
    that no plugin claimed, in the kernel's format (``accel.tree``): the main process its items, every process its
    per-process items. A model's state is taken on every process (a sharding strategy may gather there).
    Asynchronous: only the copy to CPU memory happens here; the records name the files the background writer
    will write."""
    from accel.version import kernel_version

    writing = _WRITING.get(kernel)
    if writing is None:  # called outside save_state: there is nothing of the kernel's to write
        return {}
    if asynchronous:
        writing.packed = snapshot(kernel, writing.items)
        files = {
            key: [f"{stem}.json", *([f"{stem}.safetensors"] if tensors else [])]
            for key, (stem, _, tensors) in writing.packed.items()
        }
    else:
        files = {}
        for key, item in writing.items.items():
            mine = item.per_rank or kernel.is_main_process
            if item.kind == "model" or mine:
                state = _state_of(kernel, item)
            if mine:
                files[key] = write_tree(directory, _file_stem(item, kernel.process_index), state, sync=False)
        fsync_all(Path(directory) / f for names in files.values() for f in names)  # each process flushes its own
    version = kernel_version()
    return {
        key: ItemRecord(plugin=KERNEL, format=TREE_FORMAT, files=tuple(names), version=version)
        for key, names in files.items()
    }


def _plan_target(kernel: CheckpointKernel, output_dir: str | os.PathLike[str] | None) -> tuple[str, str, int | None]:
    """(target, temporary directory, automatic index or None), on the main process; creates the temporary dir."""
    config = kernel.project_configuration
    token = secrets.token_hex(6)
    index: int | None = None
    if output_dir is None:
        if config.project_dir is None:
            raise UsageError(
                "save_state() needs a directory, or a project: Kernel(project_dir=..., project_config="
                "ProjectConfiguration(automatic_checkpoint_naming=True))"
            )
        folder = checkpoints_folder(config.project_dir)
        folder.mkdir(parents=True, exist_ok=True)
        _remove_stale(folder)
        existing = numbered_checkpoints(folder)
        index = max(int(config.iteration), existing[-1][0] + 1 if existing else 0)
        target = folder / f"checkpoint_{index}"
    else:
        target = Path(output_dir).absolute()
        _recover(target)
        _remove_stale(target.parent, target.name)
        if target.exists() and not target.is_dir():
            raise UsageError(f"save_state: {target} exists and is not a directory")
        if target.is_dir() and any(target.iterdir()) and not is_complete(target):
            raise UsageError(
                f"save_state: {target} is not empty and is not an accel checkpoint; refusing to "
                "overwrite it (choose another directory)"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{token}"
    tmp.mkdir()
    return os.fspath(target), os.fspath(tmp), index


def _plugin_version(kernel: CheckpointKernel, name: str) -> str:
    rec = kernel.plugins.records.get(name)
    return rec.version if rec is not None else ""
