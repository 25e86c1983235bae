"""``load_state``: find the checkpoint, check it against the run before anything is loaded
(:mod:`accel.checkpoint.compat`), then every component restores the items it wrote through ``accel_load_state``,
the kernel's own default implementation last.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accel.checkpoint.compat import check_compatible
from accel.checkpoint.files import read_tree
from accel.checkpoint.items import Item, call_by_owner, collect_items
from accel.checkpoint.manifest import _agreed, _records, _recover, checkpoints_folder, latest_checkpoint, read_manifest
from accel.checkpoint.user_hooks import run_load_hooks
from accel.contract import ItemRecord
from accel.errors import CheckpointError, PluginError, UsageError

if TYPE_CHECKING:
    from accel.checkpoint.items import CheckpointKernel
    from accel.contract import KernelView


def load_state(kernel: CheckpointKernel, input_dir: str | os.PathLike[str] | None = None) -> Path:
    """See :meth:`accel.kernel.Kernel.load_state`."""
    items = collect_items(kernel)

    def resolve() -> str:
        if input_dir is not None:
            path = Path(input_dir).absolute()
            _recover(path)
            return os.fspath(path)
        project = kernel.project_configuration.project_dir
        if project is None:
            raise UsageError("load_state() needs a directory, or a project: Kernel(project_dir=...)")
        latest = latest_checkpoint(project)
        if latest is None:
            raise CheckpointError(f"no complete checkpoint in {checkpoints_folder(project)}")
        return os.fspath(latest)

    chosen = _agreed(kernel, "load_state", lambda: resolve() if kernel.is_main_process else None)
    directory = Path(kernel.collectives.broadcast_object(chosen, 0))

    def check() -> tuple[dict[str, Any], dict[str, Item], dict[str, ItemRecord]]:
        manifest = read_manifest(directory)
        left, records = run_load_hooks(kernel, items, _records(manifest), directory)
        check_compatible(kernel, left, records, directory)
        return manifest, left, records

    manifest, items, records = _agreed(kernel, "load_state (checking)", check)

    _agreed(kernel, "load_state (restoring)", lambda: _load_hook(kernel, items, records, directory))
    if manifest.get("iteration") is not None:
        kernel.project_configuration.iteration = int(manifest["iteration"]) + 1
    return directory


def _load_hook(
    kernel: CheckpointKernel, items: Mapping[str, Item], records: Mapping[str, ItemRecord], directory: Path
) -> None:
    """Call ``accel_load_state`` of every component named by a record (the kernel's own default last), each with
    its records; each must restore every item it wrote."""
    objects = {key: item.obj for key, item in items.items()}
    by_owner: dict[str, dict[str, ItemRecord]] = {}
    for key, rec in records.items():
        by_owner.setdefault(rec.plugin, {})[key] = rec

    def arguments(owner: str) -> dict[str, Any] | None:
        mine = by_owner.get(owner)
        return None if not mine else {"kernel": kernel, "items": objects, "directory": directory, "records": mine}

    done: set[str] = set()
    for name, answers in call_by_owner(kernel, "accel_load_state", arguments):
        restored = {str(key) for answer in answers for key in (answer or ())}
        left = sorted(set(by_owner[name]) - restored)
        if left:
            raise PluginError(f"plugin {name!r} did not restore checkpoint item(s) {left} that it wrote")
        done |= set(by_owner[name])
    left = sorted(k for k in records if k not in done)
    if left:
        raise PluginError(
            f"no active plugin restored checkpoint item(s) {left} (written by "
            f"{', '.join(sorted({records[k].plugin for k in left}))})"
        )


def restore_own(
    kernel: KernelView, items: Mapping[str, Any], directory: Path, records: Mapping[str, ItemRecord]
) -> list[str]:
    """The kernel's default ``accel_load_state`` (:mod:`accel.defaults`): restore the items the kernel wrote
    (``records``: those naming it), random states last (nothing draws after them). Returns their keys."""
    order = sorted(records, key=lambda k: records[k].extra.get("kind") == "rng")
    absent = [k for k in order if kernel.process_index not in records[k].extra.get("ranks", [kernel.process_index])]
    if absent:  # saved by the main process alone (accel.checkpoint.solo): Accelerate logs and goes on
        logging.getLogger("accel.checkpoint").warning(
            f"load_state: {directory} holds no {', '.join(map(repr, absent))} of process {kernel.process_index} "
            "(save_state ran on the main process alone): they are not restored, so this process does not resume "
            "bitwise"
        )
    for key in order:
        rec = records[key]
        if key in absent:
            continue
        stem = f"{key}_rank{kernel.process_index}" if rec.extra.get("per_rank") else key
        state = read_tree(directory, stem)
        if rec.extra.get("kind") == "model":
            kernel.unwrap_model(items[key]).load_state_dict(state)
        else:
            items[key].load_state_dict(state)
    return order
