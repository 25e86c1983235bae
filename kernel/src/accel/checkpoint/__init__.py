"""Checkpoints: ``save_state`` / ``load_state`` that never lose work and never unpickle, and ``save_model``.

A checkpoint is a directory::

    checkpoint_3/
        accel_manifest.json        written last: its presence is what makes the checkpoint complete
        model.json                 structure of the model's state dict (JSON) ...
        model.safetensors          ... and its tensors
        optimizer.json / optimizer.safetensors
        scheduler.json, dataloader.json, kernel.json, custom_0.json, ...
        rng_rank0.json / rng_rank0.safetensors, rng_rank1.json, ...   one per process
        <whatever a plugin wrote for the items it claimed>

The package, by concern:

- :mod:`~accel.checkpoint.files`: durable files (fsync), the kernel's format ``accel.tree`` (JSON + safetensors,
  never unpickled), and weights-only / allow-listed loading of files other libraries write;
- :mod:`~accel.checkpoint.manifest`: the manifest, atomic publication, the numbered checkpoints of a project
  (latest, pruning, recovery after a crash), and how processes agree on each step's outcome (:func:`agree`);
- :mod:`~accel.checkpoint.items`: the items of a run (``accel_state_items``; the kernel's own answer is its
  default implementation, called last) and the kernel's per-run state (random states, accumulation position);
- :mod:`~accel.checkpoint.save` / :mod:`~accel.checkpoint.asynchronous` / :mod:`~accel.checkpoint.load`:
  ``save_state`` (``accel_save_state``; the kernel's writer of unclaimed items is the hook's default
  implementation, called last), asynchronous saves, ``load_state`` (``accel_load_state``, likewise);
- :mod:`~accel.checkpoint.compat`: what is checked against the run before anything is loaded;
- :mod:`~accel.checkpoint.export`: ``save_model`` / ``load_model`` (Hugging Face's safetensors layout);
- :mod:`~accel.checkpoint.dcp`: torch.distributed.checkpoint directories read without running code from them,
  for the plugins that write DCP (fsdp, parallel).

Every name other code uses is importable from ``accel.checkpoint`` itself.
"""

from __future__ import annotations

from accel.checkpoint.asynchronous import _SAVERS, PEER_WAIT_S, exit_if_lost, finish_pending, pending_save
from accel.checkpoint.compat import check_compatible
from accel.checkpoint.dcp import DCP_METADATA_GLOBALS, dcp_load, dcp_reader
from accel.checkpoint.export import WEIGHTS, WEIGHTS_INDEX, load_model, parse_size, save_model, write_model
from accel.checkpoint.files import (
    TREE_FORMAT,
    fsync_all,
    fsync_path,
    load_restricted_pickle,
    load_weights_only,
    read_json,
    read_tree,
    tree_shapes,
    weights_only_reason,
    write_json,
    write_tree,
)
from accel.checkpoint.items import RESERVED, GradientsState, Item, KernelState, RNGState, collect_items, kernel_items
from accel.checkpoint.load import load_state, restore_own
from accel.checkpoint.manifest import (
    CHECKPOINTS,
    MANIFEST,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    agree,
    checkpoints_folder,
    error_line,
    is_complete,
    latest_checkpoint,
    numbered_checkpoints,
    read_manifest,
)
from accel.checkpoint.save import save_state, write_unclaimed
from accel.errors import CheckpointError

__all__ = [
    "CHECKPOINTS",
    "DCP_METADATA_GLOBALS",
    "MANIFEST",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "PEER_WAIT_S",
    "RESERVED",
    "TREE_FORMAT",
    "WEIGHTS",
    "WEIGHTS_INDEX",
    "_SAVERS",
    "CheckpointError",
    "GradientsState",
    "Item",
    "KernelState",
    "RNGState",
    "agree",
    "check_compatible",
    "checkpoints_folder",
    "collect_items",
    "dcp_load",
    "dcp_reader",
    "error_line",
    "exit_if_lost",
    "finish_pending",
    "fsync_all",
    "fsync_path",
    "is_complete",
    "kernel_items",
    "latest_checkpoint",
    "load_model",
    "load_restricted_pickle",
    "load_state",
    "load_weights_only",
    "numbered_checkpoints",
    "parse_size",
    "pending_save",
    "read_json",
    "read_manifest",
    "read_tree",
    "restore_own",
    "save_model",
    "save_state",
    "tree_shapes",
    "weights_only_reason",
    "write_json",
    "write_model",
    "write_tree",
    "write_unclaimed",
]
