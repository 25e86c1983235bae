"""Checkpoint items of sharded models and their optimizers.

``SHARDED_STATE_DICT`` (default): each model and each optimizer is one torch.distributed.checkpoint (DCP)
directory named after its item key (``model/``, ``optimizer/``); every rank writes its own shards, and DCP reshards
on load, so a checkpoint saved on N ranks loads on any number of ranks. ``FULL_STATE_DICT``: the main process
gathers everything and writes ``<key>.safetensors`` (models) or ``<key>.pt`` (optimizers, plain containers of
tensors and numbers that ``torch.load(weights_only=True)`` reads); on load the main process reads them and the
tensors are broadcast and sharded. The manifest record says which format was written, so either loads whatever
``fsdp_state_dict_type`` is set to now.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from accel import ItemRecord, UsageError

if TYPE_CHECKING:
    import torch
    from torch import nn

PLUGIN = "fsdp"
DCP_FORMAT = "torch.distributed.checkpoint"
FULL_MODEL_FORMAT = "safetensors-full"
FULL_OPTIM_FORMAT = "torch-weights-only-full"


def _options(full: bool, broadcast: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if not full:
        return StateDictOptions()
    if broadcast:
        return StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_model(model: nn.Module, key: str, directory: Path, full: bool, is_main: bool) -> ItemRecord:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_options(full))
    if not full:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=directory / key)
        return ItemRecord(plugin=PLUGIN, format=DCP_FORMAT, files=(key,))
    name = f"{key}.safetensors"
    if is_main:
        from safetensors.torch import save_file

        save_file(_unshare(state), str(directory / name), metadata={"format": "pt"})
    return ItemRecord(plugin=PLUGIN, format=FULL_MODEL_FORMAT, files=(name,))


def load_model(model: nn.Module, key: str, directory: Path, record: ItemRecord, is_main: bool) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if record.format == DCP_FORMAT:
        import torch.distributed.checkpoint as dcp

        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=directory / key, storage_reader=SafeReader(directory / key))
        set_model_state_dict(model, state)
    elif record.format == FULL_MODEL_FORMAT:
        from safetensors.torch import load_file

        state = load_file(str(directory / record.files[0])) if is_main else {}
        set_model_state_dict(model, state, options=_options(True, broadcast=True))
    else:
        raise UsageError(f"checkpoint item {key!r} has format {record.format!r}, which accel-plugin-fsdp does not read")


FRESH = "accel_fsdp_fresh"  # saved next to an optimizer's state: it had taken no step yet


def save_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, key: str, directory: Path, full: bool,
                   is_main: bool) -> ItemRecord:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    # torch fills an empty optimizer state with a zero-learning-rate step to learn its layout; undo that, so that
    # saving before the first step changes nothing, and store the fact (loading empties the state again).
    fresh = not optimizer.state
    state: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer, options=_options(full)))
    if fresh:
        optimizer.state.clear()
    state[FRESH] = fresh
    if not full:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=directory / key)
        return ItemRecord(plugin=PLUGIN, format=DCP_FORMAT, files=(key,))
    name = f"{key}.pt"
    if is_main:
        import torch

        torch.save(state, directory / name)
    return ItemRecord(plugin=PLUGIN, format=FULL_OPTIM_FORMAT, files=(name,))


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, key: str, directory: Path,
                   record: ItemRecord, is_main: bool) -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    if record.format == DCP_FORMAT:
        import torch.distributed.checkpoint as dcp

        state: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer))
        state[FRESH] = False
        dcp.load(state, checkpoint_id=directory / key, storage_reader=SafeReader(directory / key))
        fresh = bool(state.pop(FRESH))
        set_optimizer_state_dict(model, optimizer, state)
    elif record.format == FULL_OPTIM_FORMAT:
        from accel.checkpoint import load_weights_only

        state = load_weights_only(directory / record.files[0]) if is_main else {}
        fresh = bool(state.pop(FRESH, False))
        set_optimizer_state_dict(model, optimizer, state, options=_options(True, broadcast=True))
        fresh = _broadcast_flag(fresh)
    else:
        raise UsageError(f"checkpoint item {key!r} has format {record.format!r}, which accel-plugin-fsdp does not read")
    if fresh:
        optimizer.state.clear()


def _broadcast_flag(flag: bool) -> bool:
    import torch.distributed as dist

    box = [flag]
    dist.broadcast_object_list(box, 0)
    return bool(box[0])


def detect_record(directory: Path, key: str) -> ItemRecord | None:
    """The record of an item from the files alone (for ``load_sharded``, which does not read the manifest)."""
    if (directory / key / ".metadata").is_file():
        return ItemRecord(plugin=PLUGIN, format=DCP_FORMAT, files=(key,))
    if (directory / f"{key}.safetensors").is_file():
        return ItemRecord(plugin=PLUGIN, format=FULL_MODEL_FORMAT, files=(f"{key}.safetensors",))
    if (directory / f"{key}.pt").is_file():
        return ItemRecord(plugin=PLUGIN, format=FULL_OPTIM_FORMAT, files=(f"{key}.pt",))
    return None


def _unshare(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied weights): give each its own copy."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach().contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    return out


# ---------------------------------------------------------------------------------------------------------------
# DCP keeps its index (.metadata) as a pickle, and its FileSystemReader reads it with pickle.load. Loading a
# checkpoint must never run code from it: read it with the kernel's allow-list of the records DCP writes there
# (tensors and other values are read by DCP with torch.load(weights_only=True) already).


def _safe_reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    from accel.checkpoint import DCP_METADATA_GLOBALS, load_restricted_pickle

    class Reader(FileSystemReader):
        """FileSystemReader whose ``read_metadata`` unpickles with an allow-list."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = load_restricted_pickle(self._get_metadata_path(kwargs.get("rank")), DCP_METADATA_GLOBALS)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader


def SafeReader(path: Path) -> Any:  # noqa: N802 - builds the class lazily (torch is imported on first use)
    global _READER
    if _READER is None:
        _READER = _safe_reader_class()
    return _READER(path)


_READER: type | None = None
