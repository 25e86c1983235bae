"""torch.distributed.checkpoint (DCP) directories read without running code from the files, for the plugins that
write their items as DCP (a plugin cannot import another's helpers, so the one safe reader lives here): the index
(``.metadata``) is unpickled with an allow-list of DCP's own record classes (:data:`DCP_METADATA_GLOBALS`, through
:func:`accel.checkpoint.files.load_restricted_pickle`), and every non-tensor entry of the ``.distcp`` files with
``torch.load(weights_only=True)`` (torch's default load planner uses ``weights_only=False``).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from accel.checkpoint.files import load_restricted_pickle, weights_only_reason
from accel.checkpoint.manifest import error_line
from accel.errors import CheckpointError

#: The globals a torch.distributed.checkpoint ``.metadata`` file references (dataclasses, enums, torch.Size).
DCP_METADATA_GLOBALS = frozenset(
    {
        "pathlib.PosixPath",
        "pathlib.WindowsPath",
        "torch.Size",
        "torch.serialization._get_layout",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        *(
            f"torch.distributed.checkpoint.metadata.{name}"
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        *(
            f"torch.{name}"
            for name in (
                "float64",
                "float32",
                "float16",
                "bfloat16",
                "int64",
                "int32",
                "int16",
                "int8",
                "uint8",
                "bool",
                "complex64",
                "complex128",
                "float8_e4m3fn",
                "float8_e5m2",
                "uint16",
                "uint32",
                "uint64",
            )
        ),
    }
)


def dcp_load(state_dict: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """``torch.distributed.checkpoint.load(state_dict, checkpoint_id=path)`` that never runs code from the files:
    the index (``.metadata``) is unpickled with :data:`DCP_METADATA_GLOBALS` only, and every non-tensor entry of the
    ``.distcp`` files with ``torch.load(weights_only=True)`` (torch's default load planner uses
    ``weights_only=False``). Collective, like DCP's load; a failure on any process raises :class:`CheckpointError`
    on every process, in one line. Plugins that load DCP checkpoints call this."""
    import logging

    import torch.distributed.checkpoint as dcp

    def no_dcp_tracebacks(record: logging.LogRecord) -> bool:  # DCP logs each refused file with its traceback
        return not (record.exc_info and "distributed" in record.pathname and "checkpoint" in record.pathname)

    root = logging.getLogger()  # the logger torch.distributed.checkpoint's loader writes to
    root.addFilter(no_dcp_tracebacks)
    try:
        dcp.load(state_dict, checkpoint_id=path, storage_reader=dcp_reader(path), planner=_dcp_planner_class()())
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        raise CheckpointError(f"cannot load {path}: {error_line(exc).removeprefix('CheckpointError: ')}") from None
    finally:
        root.removeFilter(no_dcp_tracebacks)


def dcp_reader(path: str | os.PathLike[str]) -> Any:
    """The storage reader :func:`dcp_load` uses: the index is unpickled with :data:`DCP_METADATA_GLOBALS` only, and
    it reads data only for the weights-only planner of :func:`dcp_load`."""
    return _dcp_reader_class()(path)


@functools.cache
def _dcp_planner_class() -> type:
    import io

    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        """torch's default load planner, except that non-tensor entries are read weights-only."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._traverse import set_element

            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as exc:
                raise CheckpointError(
                    f"refusing entry {fqn!r}: it is not a weights-only value ({weights_only_reason(exc)})"
                ) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return WeightsOnlyLoadPlanner


@functools.cache
def _dcp_reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class RestrictedReader(FileSystemReader):
        """FileSystemReader whose index is unpickled with an allow-list and that loads with the weights-only
        planner only (``read_data`` refuses any other planner)."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank"))
            metadata = load_restricted_pickle(path, DCP_METADATA_GLOBALS)
            for info in (getattr(metadata, "storage_data", None) or {}).values():
                name = getattr(info, "relative_path", None)
                # data files sit next to the index: a path elsewhere (../, /etc/...) is refused, not read
                if (
                    not isinstance(name, str)
                    or Path(name).name != name
                    or name in ("", ".", "..")
                    or not all(
                        isinstance(getattr(info, f, None), int) and getattr(info, f) >= 0 for f in ("offset", "length")
                    )
                ):
                    raise CheckpointError(
                        f"refusing to load {path}: it points at data {name!r} outside its "
                        "directory or at a negative offset"
                    )
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            if not isinstance(planner, _dcp_planner_class()):
                raise CheckpointError(
                    "refusing to read DCP data with a load planner that may unpickle code; use accel.checkpoint.dcp_load"
                )
            return super().read_data(plan, planner)  # type: ignore[arg-type]

    return RestrictedReader
