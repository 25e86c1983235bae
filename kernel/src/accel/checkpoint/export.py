"""``save_model`` / ``load_model``: a model's weights in Hugging Face's layout (``model.safetensors``, or shards
plus ``model.safetensors.index.json``), for other tools; unlike ``save_state`` it holds the weights only.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from accel.checkpoint.files import fsync_path, read_json, write_json
from accel.checkpoint.manifest import _agreed
from accel.errors import CheckpointError, UsageError

if TYPE_CHECKING:
    from accel.checkpoint.items import CheckpointKernel

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def parse_size(size: int | str) -> int:
    """Bytes from ``10_000`` or ``"500MB"`` (10**6), ``"2GiB"`` (2**30)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size < 1:
            raise UsageError(f"max_shard_size must be positive, got {size}")
        return size
    match = _SIZE.match(str(size))
    if not match:
        raise UsageError(f"max_shard_size must be a number of bytes or a size such as '10GB' or '500MiB', got {size!r}")
    unit = (match.group(2) or "").lower().removesuffix("b")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise UsageError(f"max_shard_size must be positive, got {size!r}")
    return value


def _split_shared(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors to store, {dropped name: stored name}) where names that are the same tensor are stored once."""
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    storages: set[int] = set()
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"save_model stores tensors only; the state dict has other values at {bad[:5]}")
    for name, t in state.items():
        t = t.detach()
        ident = (t.device, t.dtype, t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and ident in seen:
            aliases[name] = seen[ident]
            continue
        c = t.to("cpu").contiguous()
        if c.numel():
            ptr = c.untyped_storage().data_ptr()
            if ptr in storages:
                c = c.clone()
                ptr = c.untyped_storage().data_ptr()
            storages.add(ptr)
            seen[ident] = name
        out[name] = c
    return out, aliases


def save_model(
    kernel: CheckpointKernel,
    model: torch.nn.Module,
    save_directory: str | os.PathLike[str],
    max_shard_size: int | str = "10GB",
) -> list[Path]:
    """See :meth:`accel.kernel.Kernel.save_model`."""
    limit = parse_size(max_shard_size)
    state = kernel.get_state_dict(model)  # every process: a sharding strategy gathers here

    def write() -> list[str]:
        if not kernel.is_main_process:
            return []
        return [os.fspath(p) for p in write_model(state, save_directory, limit)]

    written = _agreed(kernel, "save_model", write)
    return [Path(p) for p in kernel.collectives.broadcast_object(written, 0)]


def write_model(state: Mapping[str, Any], save_directory: str | os.PathLike[str], max_shard_size: int) -> list[Path]:
    """Write a state dict as ``model.safetensors``, or as ``model-0000i-of-0000n.safetensors`` shards plus
    ``model.safetensors.index.json`` (Hugging Face's layout) when it exceeds ``max_shard_size`` bytes. Tensors
    that share memory (tied weights) are stored once; the others are recorded as aliases. Each file is written
    under a temporary name, fsynced and renamed; the index is written last."""
    from safetensors.torch import save_file

    directory = Path(save_directory)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"save_model: {directory} exists and is not a directory")
    directory.mkdir(parents=True, exist_ok=True)
    tensors, aliases = _split_shared(state)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    names = (
        [WEIGHTS]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    metadata = {"format": "pt"}
    if len(shards) == 1 and aliases:
        metadata["accel.aliases"] = json.dumps(aliases)
    token = secrets.token_hex(6)
    written = []
    for name, shard in zip(names, shards, strict=True):
        tmp = directory / f".{name}.tmp-{token}"
        save_file(shard, os.fspath(tmp), metadata=metadata)
        fsync_path(tmp)
        os.replace(tmp, directory / name)
        written.append(directory / name)
    stale = [
        p
        for p in directory.iterdir()
        if re.match(r"^model-\d{5}-of-\d{5}\.safetensors$", p.name) and p.name not in names
    ]
    if len(shards) == 1:
        stale += [p for p in (directory / WEIGHTS_INDEX,) if p.exists()]
    else:
        index = {
            "metadata": {"total_size": total, "accel.aliases": aliases},
            "weight_map": {n: names[i] for i, shard in enumerate(shards) for n in shard},
        }
        tmp = directory / f".{WEIGHTS_INDEX}.tmp-{token}"
        write_json(tmp, index)
        os.replace(tmp, directory / WEIGHTS_INDEX)
        written.append(directory / WEIGHTS_INDEX)
        stale += [p for p in (directory / WEIGHTS,) if p.exists()]
    for p in stale:
        p.unlink()
    fsync_path(directory)
    return written


def load_model(
    model: torch.nn.Module, directory: str | os.PathLike[str], strict: bool = True, device: str | torch.device = "cpu"
) -> torch.nn.Module:
    """Load what ``save_model`` wrote (one file or shards + index) into ``model``; returns ``model``."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    directory = Path(directory)
    index_path = directory / WEIGHTS_INDEX
    state: dict[str, torch.Tensor] = {}
    if index_path.is_file():
        index = read_json(index_path)
        aliases = dict(index.get("metadata", {}).get("accel.aliases", {}))
        for shard in sorted(set(index["weight_map"].values())):
            if Path(shard).name != shard:
                raise CheckpointError(f"{index_path} names a shard outside the directory: {shard!r}")
            state.update(load_file(os.fspath(directory / shard), device=str(device)))
    elif (directory / WEIGHTS).is_file():
        with safe_open(os.fspath(directory / WEIGHTS), framework="pt") as fh:
            aliases = json.loads((fh.metadata() or {}).get("accel.aliases", "{}"))
        state = load_file(os.fspath(directory / WEIGHTS), device=str(device))
    else:
        raise CheckpointError(f"no {WEIGHTS} or {WEIGHTS_INDEX} in {directory}")
    for dropped, kept in aliases.items():
        state[dropped] = state[kept]
    model.load_state_dict(state, strict=strict)
    return model
