"""A reader of W&B's run files (``run-<id>.wandb``), to check what an offline run recorded.

The file is a leveldb-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks of
chunks, each with a 7-byte header (CRC-32 of type byte + data, data length, type: full/first/middle/last).
A record is the concatenated data of its chunks: a ``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def chunks(data: bytes) -> Iterator[bytes]:
    """The records' raw bytes, checksums verified."""
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    if ident != b":W&B" or magic != 0xBEE1 or version != 0:
        raise ValueError(f"not a W&B run file (header {data[:HEADER]!r})")
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer: zero padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:
            pos += left  # padding up to the next block
            continue
        payload = data[pos + HEADER : pos + HEADER + length]
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise ValueError(f"checksum mismatch at offset {pos}")
        pos += HEADER + length
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            yield pending + payload
            pending = b""
        else:
            raise ValueError(f"unknown chunk type {kind} at offset {pos}")


def records(path: str | Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    for raw in chunks(Path(path).read_bytes()):
        yield wandb_internal_pb2.Record.FromString(raw)


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def read_run(path: str | Path, wait: float = 30.0) -> dict[str, Any]:
    """``{"history": [{key: value}], "config": {key: value}, "project": str}`` of one run file.

    wandb's writer may still be flushing the file for a moment after ``run.finish()`` returns: wait up to
    ``wait`` seconds for the run's exit record (the last one written)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            found = list(records(path))
        except ValueError:  # a chunk being written
            found = []
        if any(r.WhichOneof("record_type") == "exit" for r in found) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    history: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    project = ""
    for record in found:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind in ("config", "run"):
            update = record.config.update if kind == "config" else record.run.config.update
            for item in update:
                config[_key(item)] = json.loads(item.value_json)
            if kind == "run":
                project = record.run.project or project
    return {"history": history, "config": config, "project": project}


def run_files(root: str | Path) -> list[Path]:
    """Every ``run-*.wandb`` file under ``root`` (one per run)."""
    return sorted(Path(root).rglob("run-*.wandb"))
