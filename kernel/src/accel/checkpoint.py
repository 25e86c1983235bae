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

The manifest records, for every item, which plugin wrote it (``"accel"`` for the kernel), the plugin's version,
the format and the files, plus the size of every file in the directory. Loading refuses a directory that holds a
file the manifest does not list (a stray ``*.pkl`` is never opened), a listed file of the wrong size, an item
written by a plugin that is not active, and items or shapes that do not match the run, before anything is loaded.

The kernel's own format (``accel.tree``) stores a state dict as JSON (structure, numbers, strings, with tags for
tuples, non-string keys, dtypes, non-finite floats) plus one safetensors file with every tensor. Nothing in it is
ever unpickled. Plugins may use :func:`write_tree` / :func:`read_tree` for their items too.

Saving is atomic: every process writes into ``.<name>.tmp-<token>`` next to the target, files are fsynced, the
main process writes the manifest, fsyncs, and renames the directory into place. A crash at any moment leaves the
previous complete checkpoint (and perhaps a temporary directory that is ignored and removed later) or the new one.

``save_state(asynchronous=True)`` copies the state to CPU memory on the calling thread, then writes, fsyncs and
publishes it the same way on a background thread (see :class:`_AsyncSave`).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import math
import os
import random
import re
import secrets
import shutil
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from accel.contract import ItemRecord
from accel.errors import CheckpointError, PluginError, UsageError
from accel.options import KERNEL, install_hint

if TYPE_CHECKING:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from accel.kernel import Kernel

MANIFEST = "accel_manifest.json"
MANIFEST_FORMAT = "accel-checkpoint"
MANIFEST_VERSION = 1
TREE_FORMAT = "accel.tree"
CHECKPOINTS = "checkpoints"
RESERVED = ("gradients", "rng", "kernel")  # item keys of the kernel's own per-run state
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
# Durable files


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file or directory to disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_all(paths: Iterable[str | os.PathLike[str]]) -> None:
    """Flush several files at once (fsync releases the GIL: the small files' flushes overlap the big ones').
    Off the main thread (an asynchronous save) one after the other: nobody waits for them, and at interpreter
    exit no new thread pool may start."""
    paths = list(paths)
    if len(paths) <= 1 or threading.current_thread() is not threading.main_thread():
        for path in paths:
            fsync_path(path)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, len(paths))) as pool:
        list(pool.map(fsync_path, paths))


def write_json(path: Path, data: Any, sync: bool = True) -> None:
    """Write JSON (and fsync it unless ``sync=False``: then the caller flushes it with the rest)."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, allow_nan=False, separators=(",", ":"))
        if sync:
            fh.flush()
            os.fsync(fh.fileno())


def read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def load_weights_only(path: str | os.PathLike[str], map_location: Any = "cpu") -> Any:
    """Load a file a plugin wrote with ``torch.save``, refusing anything but tensors and plain containers
    (``torch.load(weights_only=True)``): a pickle that would run code is an error, never executed."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"refusing to load {path}: it is not a weights-only torch file "
                              f"({weights_only_reason(exc)})") from None


def weights_only_reason(exc: BaseException) -> str:
    """The line of a failed ``torch.load(weights_only=True)`` that says what was refused (torch's message opens
    with a paragraph of advice to load with ``weights_only=False``, which a checkpoint must never do)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    advice = ("Check the documentation", "Weights only load", "Please file an issue")
    specific = [line for line in lines[1:] if not line.startswith(advice)]
    return f"{type(exc).__name__}: {(specific or lines or [''])[0]}"


#: The globals a torch.distributed.checkpoint ``.metadata`` file references (dataclasses, enums, torch.Size).
DCP_METADATA_GLOBALS = frozenset({
    "pathlib.PosixPath", "pathlib.WindowsPath", "torch.Size", "torch.serialization._get_layout",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    *(f"torch.distributed.checkpoint.metadata.{name}" for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    *(f"torch.{name}" for name in (
        "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
        "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")),
})


def load_restricted_pickle(path: str | os.PathLike[str], allowed: Iterable[str]) -> Any:
    """Unpickle a file that may only reference the globals named in ``allowed`` (``"module.name"``). Any other
    global (a ``__reduce__`` that calls ``os.system``...) raises :class:`CheckpointError` before it is called.
    For formats that pickle their metadata, such as torch.distributed.checkpoint (``DCP_METADATA_GLOBALS``): a
    plugin's ``FileSystemReader.read_metadata`` can use this instead of ``pickle.load``."""
    import pickle

    names = frozenset(allowed)

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if f"{module}.{name}" not in names:
                raise CheckpointError(f"refusing to load {path}: it references {module}.{name}, which is not allowed "
                                      "in this file")
            return super().find_class(module, name)

    try:
        with open(path, "rb") as fh:
            return Restricted(fh).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None


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
        dcp.load(state_dict, checkpoint_id=path, storage_reader=dcp_reader(path),
                 planner=_dcp_planner_class()())
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        raise CheckpointError(f"cannot load {path}: {_one_line(exc).removeprefix('CheckpointError: ')}") from None
    finally:
        root.removeFilter(no_dcp_tracebacks)


def dcp_reader(path: str | os.PathLike[str]) -> Any:
    """The storage reader :func:`dcp_load` uses: the index is unpickled with :data:`DCP_METADATA_GLOBALS` only, and
    it reads data only for the weights-only planner of :func:`dcp_load`."""
    return _dcp_reader_class()(path)


@functools.cache
def _dcp_planner_class() -> type[DefaultLoadPlanner]:
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
                raise CheckpointError(f"refusing entry {fqn!r}: it is not a weights-only value "
                                      f"({weights_only_reason(exc)})") from None
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
                if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..") or \
                        not all(isinstance(getattr(info, f, None), int) and getattr(info, f) >= 0
                                for f in ("offset", "length")):
                    raise CheckpointError(f"refusing to load {path}: it points at data {name!r} outside its "
                                          "directory or at a negative offset")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            if not isinstance(planner, _dcp_planner_class()):
                raise CheckpointError("refusing to read DCP data with a load planner that may unpickle code; use "
                                      "accel.checkpoint.dcp_load")
            return super().read_data(plan, planner)

    return RestrictedReader


# --------------------------------------------------------------------------------------------------------------
# The accel.tree format: JSON structure + one safetensors file of tensors


class _Packer:
    """Turns a state dict into JSON-able structure plus a flat dict of CPU tensors for safetensors."""

    def __init__(self, stage: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._names: dict[tuple[Any, ...], str] = {}  # identity of a tensor already stored -> its name
        self._storages: set[int] = set()
        self._stage = stage  # (name, tensor) -> a CPU copy of its own (asynchronous saves); None: no copy of CPU tensors

    def encode(self, obj: Any, path: str = "") -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"__float__": repr(obj)}
        if isinstance(obj, torch.Tensor):
            return {"__tensor__": self.add(obj, path)}
        if isinstance(obj, torch.dtype):
            return {"__dtype__": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"__device__": str(obj)}
        if isinstance(obj, torch.Size):
            return {"__size__": list(obj)}
        if type(obj).__module__ == "numpy":
            import numpy as np

            if isinstance(obj, np.ndarray):
                return {"__ndarray__": self.add(torch.from_numpy(np.ascontiguousarray(obj)), path)}
            if isinstance(obj, np.generic):
                return self.encode(obj.item(), path)
        if isinstance(obj, tuple):
            return {"__tuple__": [self.encode(v, f"{path}.{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.encode(v, f"{path}.{i}") for i, v in enumerate(obj)]
        if isinstance(obj, (set, frozenset)):
            return {"__set__": [self.encode(v, f"{path}.{i}") for i, v in enumerate(sorted(obj, key=repr))]}
        if isinstance(obj, bytes):
            return {"__bytes__": base64.b64encode(obj).decode("ascii")}
        if isinstance(obj, Mapping):
            def sub(k: Any) -> str:
                return f"{path}.{k}" if path else str(k)

            if all(isinstance(k, str) and not k.startswith("__") for k in obj):
                return {k: self.encode(v, sub(k)) for k, v in obj.items()}
            return {"__dict__": [[self.encode(k, sub("key")), self.encode(v, sub(k))] for k, v in obj.items()]}
        where = f" at {path!r}" if path else ""
        raise CheckpointError(f"cannot store an object of type {type(obj).__module__}.{type(obj).__qualname__}{where}: "
                              "state_dict() must return tensors, numbers, strings, None and lists/tuples/dicts of "
                              "them (checkpoints hold no pickled objects)")

    def add(self, t: torch.Tensor, path: str) -> str:
        """Name under which ``t`` is stored. The same tensor twice (tied weights) is stored once; a different view
        of memory already stored gets its own copy (safetensors refuses shared memory)."""
        t = t.detach()
        ident = (t.device, t.dtype, t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and ident in self._names:
            return self._names[ident]
        name, n = path or "tensor", 1
        while name in self.tensors:
            n += 1
            name = f"{path}#{n}"
        # resolve_conj/resolve_neg: safetensors writes memory as it is, without a view's lazy conjugation
        out = t.to("cpu").resolve_conj().resolve_neg().contiguous() if self._stage is None else self._stage(name, t)
        if out.numel():
            if out.untyped_storage().data_ptr() in self._storages:
                out = out.clone()
            self._storages.add(out.untyped_storage().data_ptr())
            self._names[ident] = name
        self.tensors[name] = out
        return name


def _decode(doc: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(doc, list):
        return [_decode(v, tensors) for v in doc]
    if not isinstance(doc, dict):
        return doc
    if len(doc) == 1:
        (tag, value), = doc.items()
        if tag == "__tensor__":
            return tensors[value]
        if tag == "__ndarray__":
            array = tensors[value]
            return None if array is None else array.numpy()
        if tag == "__tuple__":
            return tuple(_decode(v, tensors) for v in value)
        if tag == "__float__":
            return float(value)
        if tag == "__dtype__":
            dtype = getattr(torch, value, None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"unknown dtype {value!r} in checkpoint")
            return dtype
        if tag == "__device__":
            return torch.device(value)
        if tag == "__size__":
            return torch.Size(value)
        if tag == "__set__":
            return {_decode(v, tensors) for v in value}
        if tag == "__bytes__":
            return base64.b64decode(value)
        if tag == "__dict__":
            return {_decode(k, tensors): _decode(v, tensors) for k, v in value}
    return {k: _decode(v, tensors) for k, v in doc.items()}


def write_tree(directory: str | os.PathLike[str], name: str, obj: Any, sync: bool = True) -> list[str]:
    """Write ``obj`` (a state dict) as ``name.json`` (+ ``name.safetensors`` when it holds tensors) and fsync them
    (``sync=False``: the caller flushes them). Returns the file names written, relative to ``directory``."""
    packer = _Packer()
    doc = packer.encode(obj)
    return _write_packed(Path(directory), name, doc, packer.tensors, sync)


def _write_packed(directory: Path, name: str, doc: Any, tensors: Mapping[str, torch.Tensor], sync: bool) -> list[str]:
    """The files of :func:`write_tree` from what :class:`_Packer` made of the object."""
    from safetensors.torch import save_file

    files = [f"{name}.json"]
    if tensors:
        files.append(f"{name}.safetensors")
        save_file(dict(tensors), os.fspath(directory / files[1]), metadata={"format": "pt"})
    write_json(directory / files[0], {"format": TREE_FORMAT, "tree": doc, "tensors": files[1] if len(files) > 1 else None},
               sync=False)
    if sync:
        fsync_all(directory / f for f in files)
    return files


def read_tree(directory: str | os.PathLike[str], name: str) -> Any:
    """Read what :func:`write_tree` wrote (safetensors + JSON only: nothing is unpickled)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    doc = _tree_doc(directory, name)
    tensors: Mapping[str, torch.Tensor] = {}
    if doc["tensors"]:
        try:
            tensors = load_file(os.fspath(directory / doc["tensors"]))
        except Exception as exc:
            raise CheckpointError(f"cannot read {directory / doc['tensors']}: {exc}") from None
    try:
        return _decode(doc["tree"], tensors)
    except KeyError as exc:
        raise CheckpointError(f"{directory / (name + '.json')} names tensor {exc} that its safetensors file lacks") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{directory / (name + '.json')} is malformed: {type(exc).__name__}: {exc}") from None


def _tree_doc(directory: Path, name: str) -> dict[str, Any]:
    doc = read_json(directory / f"{name}.json")
    if not isinstance(doc, dict) or doc.get("format") != TREE_FORMAT or "tree" not in doc:
        raise CheckpointError(f"{directory / (name + '.json')} is not an {TREE_FORMAT} file")
    tensors = doc.get("tensors")
    if tensors is not None and (not isinstance(tensors, str) or Path(tensors).name != tensors or tensors in ("", ".", "..")):
        raise CheckpointError(f"{directory / (name + '.json')} names a tensor file outside its directory: {tensors!r}")
    doc.setdefault("tensors", None)
    return doc


def tree_shapes(directory: Path, name: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{key: (shape, dtype)}`` of the top-level tensors of a tree, from the safetensors header only."""
    from safetensors import safe_open

    doc = _tree_doc(directory, name)
    tree = doc["tree"]
    if not isinstance(tree, dict) or not doc["tensors"]:
        return {}
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    try:
        with safe_open(os.fspath(directory / doc["tensors"]), framework="pt") as fh:
            for key, value in tree.items():
                if isinstance(value, dict) and set(value) == {"__tensor__"}:
                    sl = fh.get_slice(value["__tensor__"])
                    out[key] = (tuple(sl.get_shape()), str(sl.get_dtype()))
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot read {directory / doc['tensors']}: {exc}") from None
    return out


# --------------------------------------------------------------------------------------------------------------
# Items


class RNGState:
    """The random states of this process: python, numpy, torch CPU and every device of the current accelerator
    (through ``torch.accelerator`` and the accelerator's device module, whatever its type), and the states the
    prepared dataloaders need to replay their current pass (``rng_state_dict``: per process, like the others)."""

    def __init__(self, loaders: Sequence[Any] = ()):
        self.loaders = [dl for dl in loaders if callable(getattr(dl, "rng_state_dict", None))]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if self.loaders:
            state["dataloaders"] = [dl.rng_state_dict() for dl in self.loaders]
        try:
            import numpy as np

            state["numpy"] = np.random.get_state()
        except ImportError:  # pragma: no cover - numpy is a dependency
            pass
        acc = _accelerator_module()
        if acc is not None:
            kind, module = acc
            if hasattr(module, "get_rng_state_all"):
                states = list(module.get_rng_state_all())
            else:
                states = [module.get_rng_state()]
            state["accelerator"] = {"type": kind, "states": states}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "numpy" in state:
            import numpy as np

            np.random.set_state(state["numpy"])
        for loader, loader_state in zip(self.loaders, state.get("dataloaders", ()), strict=False):
            loader.load_rng_state_dict(loader_state)
        saved = state.get("accelerator")
        if saved is None:
            return
        acc = _accelerator_module()
        if acc is None or acc[0] != saved["type"]:
            warnings.warn(f"the checkpoint holds random states of {saved['type']} devices, which this run does not "
                          "use; they are not restored", RuntimeWarning, stacklevel=2)
            return
        _, module = acc
        states = list(saved["states"])
        if hasattr(module, "set_rng_state_all"):
            count = torch.accelerator.device_count()
            if count != len(states):
                warnings.warn(f"the checkpoint holds random states of {len(states)} {saved['type']} devices, this "
                              f"machine has {count}; restoring the first {min(count, len(states))}",
                              RuntimeWarning, stacklevel=2)
            for index, st in enumerate(states[:count]):
                module.set_rng_state(st, index)
        else:
            module.set_rng_state(states[0])


def _accelerator_module() -> tuple[str, Any] | None:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return None
    kind = accelerator.current_accelerator().type
    try:
        module = torch.get_device_module(kind)
    except Exception:
        return None
    if not hasattr(module, "get_rng_state"):
        return None
    return kind, module


class KernelState:
    """The Kernel's own position: the gradient-accumulation micro-step counter and whether the last micro-step
    synchronised."""

    def __init__(self, kernel: Kernel):
        self.kernel = kernel

    def state_dict(self) -> dict[str, Any]:
        state = self.kernel.gradient_state
        return {"accumulation_step": state.step, "sync_gradients": state.sync_gradients}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.kernel.gradient_state.step = int(state["accumulation_step"])
        self.kernel.gradient_state.sync_gradients = bool(state.get("sync_gradients", True))


class GradientsState:
    """Gradients accumulated since the last optimizer step, per process (under DDP's ``no_sync`` they differ
    between processes). Saved only when the last micro-step did not synchronise (``save_state`` in the middle
    of gradient accumulation); otherwise empty, so checkpoints taken on optimizer steps carry no gradients."""

    def __init__(self, kernel: Kernel):
        self.kernel = kernel

    def _parameters(self) -> dict[str, torch.nn.Parameter]:
        return {f"{i}.{name}": p for i, m in enumerate(self.kernel._models)
                for name, p in self.kernel.unwrap_model(m).named_parameters()}

    def state_dict(self) -> dict[str, Any]:
        grads: dict[str, torch.Tensor] = {}
        if not self.kernel.gradient_state.sync_gradients:
            for name, p in self._parameters().items():
                if p.grad is None:
                    continue
                if type(p.grad) is not torch.Tensor:
                    raise CheckpointError(
                        f"save_state in the middle of gradient accumulation: the gradient of {name} is a "
                        f"{type(p.grad).__name__}, which the kernel cannot store; save on a step that synchronises "
                        "(if kernel.sync_gradients: ...) or use a strategy plugin that claims the 'gradients' item")
                grads[name] = p.grad
        return {"grads": grads}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        grads = state["grads"]
        params = self._parameters()
        unknown = sorted(set(grads) - set(params))
        if unknown:
            raise CheckpointError(f"the checkpoint holds gradients of parameters this run does not have: {unknown[:5]}")
        for name, p in params.items():
            g = grads.get(name)
            p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).reshape(p.shape)


@dataclass
class Item:
    """One thing a checkpoint holds. ``kind``: model, optimizer, scheduler, dataloader, custom, plugin, rng,
    kernel. ``per_rank`` items hold one state per process; the others are written by the main process."""

    key: str
    obj: Any
    kind: str
    per_rank: bool = False
    provider: str = KERNEL


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def collect_items(kernel: Kernel) -> dict[str, Item]:
    """Every item of this run by key: ``model``, ``model_1``, ..., ``optimizer``..., ``scheduler``...,
    ``dataloader``..., ``custom_<i>`` (``register_for_checkpointing``), the keys plugins give through
    ``accel_state_items``, ``gradients`` and ``rng`` (per process) and ``kernel``."""
    items: dict[str, Item] = {}

    def add(key: str, obj: Any, kind: str, per_rank: bool = False, provider: str = KERNEL) -> None:
        items[key] = Item(key, obj, kind, per_rank, provider)

    loaders = [dl for dl in kernel._dataloaders if _stateful(dl)]
    for kind, objs in (("model", kernel._models), ("optimizer", kernel._optimizers),
                       ("scheduler", kernel._schedulers), ("dataloader", loaders)):
        for i, obj in enumerate(objs):
            add(kind if i == 0 else f"{kind}_{i}", obj, kind)
    for i, obj in enumerate(kernel._custom_objects):
        add(f"custom_{i}", obj, "custom")
    for impl in reversed(kernel.plugins.pm.hook.accel_state_items.get_hookimpls()):
        name = _component_name(impl)
        answer = cast("Mapping[str, Any] | None", impl.function(*[{"kernel": kernel}[a] for a in impl.argnames]))
        for key, obj in (answer or {}).items():
            if key in items or key in RESERVED:
                other = items[key].provider if key in items else KERNEL
                raise PluginError(f"checkpoint item {key!r} is given by both {other!r} and {name!r}")
            if not _stateful(obj):
                raise PluginError(f"plugin {name!r}: checkpoint item {key!r} has no state_dict/load_state_dict")
            add(key, obj, "plugin", provider=name)
    add("gradients", GradientsState(kernel), "gradients", per_rank=True)
    add("rng", RNGState(loaders), "rng", per_rank=True)
    add("kernel", KernelState(kernel), "kernel")
    return items


def _component_name(impl: Any) -> str:
    return getattr(impl.plugin, "name", "") or impl.plugin_name.split(":")[0]


def _state_of(kernel: Kernel, item: Item) -> Any:
    if item.kind == "model":
        return kernel.get_state_dict(item.obj)
    return item.obj.state_dict()


def _restore(kernel: Kernel, item: Item, state: Any) -> None:
    if item.kind == "model":
        kernel.unwrap_model(item.obj).load_state_dict(state)
    else:
        item.obj.load_state_dict(state)


def _file_stem(item: Item, rank: int) -> str:
    return f"{item.key}_rank{rank}" if item.per_rank else item.key


# --------------------------------------------------------------------------------------------------------------
# Agreement between processes


def _agreed(kernel: Kernel, what: str, fn: Callable[[], Any]) -> Any:
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


def agree(kernel: Kernel, what: str, fn: Callable[[], Any]) -> Any:
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
        raise CheckpointError(f"checkpoint {directory} is a file, not a checkpoint directory: give the directory "
                              "that save_state wrote")
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} does not exist")
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a complete accel checkpoint (no {MANIFEST}); it may be a partial "
                              "save or another library's checkpoint, and is not loaded")
    manifest = read_json(path)
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{path} is not an accel checkpoint manifest")
    if int(manifest.get("version", 0)) > MANIFEST_VERSION:
        raise CheckpointError(f"{directory} was written by a newer accel (manifest version {manifest['version']}); "
                              "upgrade accel-kernel to load it")
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not all(isinstance(v, int) for v in listed.values()):
        raise CheckpointError(f"{path} is malformed: 'files' must map file names to sizes")
    present = _files_under(directory)
    present.pop(MANIFEST, None)
    unexpected = sorted(set(present) - set(listed))
    if unexpected:
        raise CheckpointError(f"refusing to load {directory}: it holds file(s) its manifest does not list: "
                              f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''} (remove them if "
                              "you trust them; they are never opened)")
    missing = sorted(set(listed) - set(present))
    if missing:
        raise CheckpointError(f"checkpoint {directory} is damaged: missing file(s) {', '.join(missing[:5])}")
    for name, size in listed.items():
        if present[name] != size:
            raise CheckpointError(f"checkpoint {directory} is damaged: {name} has {present[name]} bytes, the "
                                  f"manifest says {size}")
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
            records[str(key)] = ItemRecord(plugin=str(rec["plugin"]), format=str(rec["format"]),
                                           files=tuple(str(f) for f in rec.get("files", ())),
                                           version=str(rec.get("version", "")), extra=dict(rec.get("extra", {})))
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise CheckpointError(f"malformed checkpoint manifest: {type(exc).__name__}: {exc}") from None
    return records


# --------------------------------------------------------------------------------------------------------------
# save_state


def save_state(kernel: Kernel, output_dir: str | os.PathLike[str] | None = None,
               asynchronous: bool | None = None) -> Path:
    """See :meth:`accel.kernel.Kernel.save_state`."""
    finish_pending(kernel)  # an asynchronous save still in flight is published (or its error raised) first
    if asynchronous is None:
        asynchronous = bool(kernel.settings.get("async_save", False))
    items = collect_items(kernel)
    plan = _agreed(kernel, "save_state", lambda: _plan_target(kernel, output_dir) if kernel.is_main_process else None)
    target, tmp, index = kernel.collectives.broadcast_object(plan, 0)
    target, tmp = Path(target), Path(tmp)
    try:
        if asynchronous:
            _start_async(kernel, items, target, tmp, index)
        else:
            _write_and_publish(kernel, items, target, tmp, index)
    except BaseException:
        if kernel.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if index is not None:
        kernel.project_configuration.iteration = index + 1
    return target


def _write_and_publish(kernel: Kernel, items: Mapping[str, Item], target: Path, tmp: Path, index: int | None) -> None:
    # 1. plugins write the items they claim (every process), 2. the kernel writes the rest (main process; every
    # process its per-process items), 3. the main process writes the manifest and renames. Each step ends with
    # every process learning whether any process failed.
    claims = _gather_claims(kernel, items, tmp, asynchronous=False)

    def write_own() -> dict[str, list[str]]:
        written: dict[str, list[str]] = {}
        for key, item in items.items():
            if key in claims:
                continue
            if item.kind == "model":
                state = _state_of(kernel, item)  # on every process: a sharding strategy may gather here
            elif item.per_rank or kernel.is_main_process:
                state = _state_of(kernel, item)
            if item.per_rank or kernel.is_main_process:
                written[key] = write_tree(tmp, _file_stem(item, kernel.process_index), state, sync=False)
        fsync_all(tmp / f for files in written.values() for f in files)  # each process flushes what it wrote
        return written

    own = _agreed(kernel, "save_state (writing)", write_own)
    all_own = kernel.collectives.all_gather_object(own)
    _agreed(kernel, "save_state (publishing)",
            lambda: _publish(kernel, items, claims, all_own, target, tmp, index) if kernel.is_main_process else None)


def _gather_claims(kernel: Kernel, items: Mapping[str, Item], tmp: Path, asynchronous: bool) -> dict[str, ItemRecord]:
    """Plugins write the items they claim (every process, this thread); their records, merged over processes."""
    claimed_by_rank = _agreed(kernel, "save_state (plugins)", lambda: _plugin_save(kernel, items, tmp, asynchronous))
    claims: dict[str, ItemRecord] = {}
    for rank_records in kernel.collectives.all_gather_object(claimed_by_rank):
        for key, fields in rank_records.items():
            rec = ItemRecord(**fields)
            if key not in claims:
                claims[key] = rec
            elif (claims[key].plugin, claims[key].format) != (rec.plugin, rec.format):
                raise CheckpointError(f"processes disagree on who writes checkpoint item {key!r}: "
                                      f"{claims[key].plugin!r} and {rec.plugin!r}")
            else:
                claims[key] = dataclasses.replace(claims[key], files=tuple(sorted({*claims[key].files, *rec.files})))
    unknown = sorted(set(claims) - set(items))
    if unknown:
        raise CheckpointError(f"plugin {claims[unknown[0]].plugin!r} claimed checkpoint item(s) {unknown} that this "
                              "run does not have")
    return claims


def _plan_target(kernel: Kernel, output_dir: str | os.PathLike[str] | None) -> tuple[str, str, int | None]:
    """(target, temporary directory, automatic index or None), on the main process; creates the temporary dir."""
    config = kernel.project_configuration
    token = secrets.token_hex(6)
    index: int | None = None
    if output_dir is None:
        if config.project_dir is None:
            raise UsageError("save_state() needs a directory, or a project: Kernel(project_dir=..., project_config="
                             "ProjectConfiguration(automatic_checkpoint_naming=True))")
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
            raise UsageError(f"save_state: {target} is not empty and is not an accel checkpoint; refusing to "
                             "overwrite it (choose another directory)")
        target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{token}"
    tmp.mkdir()
    return os.fspath(target), os.fspath(tmp), index


def _plugin_save(kernel: Kernel, items: Mapping[str, Item], tmp: Path, asynchronous: bool) -> dict[str, dict[str, Any]]:
    objects = {key: item.obj for key, item in items.items()}
    claims: dict[str, ItemRecord] = {}
    for impl in reversed(kernel.plugins.pm.hook.accel_save_state.get_hookimpls()):
        name = _component_name(impl)
        args = {"kernel": kernel, "items": objects, "directory": tmp, "asynchronous": asynchronous}
        answer = cast("Mapping[str, Any] | None", impl.function(*[args[a] for a in impl.argnames])) or {}
        for key, rec in answer.items():
            if not isinstance(rec, ItemRecord):
                raise PluginError(f"plugin {name!r}: accel_save_state must return {{key: ItemRecord}}, got "
                                  f"{type(rec).__name__} for {key!r}")
            if key in claims:
                raise PluginError(f"checkpoint item {key!r} is claimed by both {claims[key].plugin!r} and {name!r}")
            for f in rec.files:
                if os.path.isabs(f) or ".." in Path(f).parts:
                    raise PluginError(f"plugin {name!r}: item {key!r} names file {f!r} outside the checkpoint")
            claims[key] = dataclasses.replace(rec, plugin=name, version=rec.version or _plugin_version(kernel, name),
                                              files=tuple(rec.files))
    return {key: dataclasses.asdict(rec) for key, rec in claims.items()}


def _plugin_version(kernel: Kernel, name: str) -> str:
    rec = kernel.plugins.records.get(name)
    return rec.version if rec is not None else ""


def _publish(kernel: Kernel, items: Mapping[str, Item], claims: Mapping[str, ItemRecord],
             all_own: list[dict[str, list[str]]], target: Path, tmp: Path, index: int | None) -> None:
    from accel import __version__

    records: dict[str, dict[str, Any]] = {}
    for key, item in items.items():
        if key in claims:
            rec = dataclasses.asdict(claims[key])
            rec["files"] = list(rec["files"])
            rec["extra"] = {"kind": item.kind, "provider": item.provider, "per_rank": item.per_rank, **rec["extra"]}
        else:
            files = sorted({f for rank_files in all_own for f in rank_files.get(key, [])})
            rec = {"plugin": KERNEL, "format": TREE_FORMAT, "files": files, "version": __version__,
                   "extra": {"kind": item.kind, "provider": item.provider, "per_rank": item.per_rank}}
        if item.per_rank:
            rec["extra"]["world_size"] = kernel.num_processes
        records[key] = rec
    present = _files_under(tmp)
    for key, rec in records.items():
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
        "items": records,
        "files": present,
    }
    own = {f for rank_files in all_own for files in rank_files.values() for f in files}
    dirs = [Path(root, d) for root, subdirs, _ in os.walk(tmp) for d in subdirs]
    fsync_all([tmp / name for name in present if name not in own] + dirs)  # what plugins wrote
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


# --------------------------------------------------------------------------------------------------------------
# Asynchronous save


#: How long the main process waits at interpreter exit for the other processes' files of an asynchronous save
#: (after its own are written) before it abandons the save; and, at a sync point where every process reported its
#: files written, how long it waits to see them on the shared file system.
PEER_WAIT_S = 60.0
_MARKER = ".accel-async-rank{}.json"  # in the temporary directory: what a process wrote (or its error)


class _Staging:
    """CPU copies of the tensors of asynchronous saves. Kept from one save to the next and refilled in place: a
    fresh allocation is touched page by page on first write, which costs several times the copy itself; the
    price is one checkpoint's worth of CPU memory held while the run saves asynchronously."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, str], torch.Tensor] = {}
        self.used: set[tuple[str, str]] = set()

    def copy(self, stem: str, name: str, t: torch.Tensor) -> torch.Tensor:
        key = (stem, name)
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = None
            if t.device.type != "cpu":  # pinned memory: the copy off the device is a direct transfer
                try:
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                except RuntimeError:
                    buf = None
            if buf is None:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            self.buffers[key] = buf
        _copy_into(buf, t.detach())
        self.used.add(key)
        return buf

    def forget_unused(self) -> None:
        """Drop buffers this save did not use (an item that went away), so memory follows the current state."""
        self.buffers = {k: v for k, v in self.buffers.items() if k in self.used}
        self.used = set()


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; between contiguous CPU tensors, one plain memcpy of the bytes (numpy): torch's copy is
    split over its intra-op threads, which on a machine with busy cores wait for each other (bench: 1.5 GiB in
    0.37 s with one thread against 1.5-2.6 s with two on 2 loaded cores)."""
    if src.device.type == "cpu" and src.is_contiguous() and src.numel() and not (src.is_conj() or src.is_neg()):
        try:
            import numpy as np

            np.copyto(dst.view(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
            return
        except (RuntimeError, TypeError, ValueError):  # a dtype or layout without a byte view: torch copies it
            pass
    dst.copy_(src)


class _Saver:
    """A Kernel's asynchronous saving: its staging buffers and the save in flight, if any."""

    def __init__(self) -> None:
        self.staging = _Staging()
        self.job: _AsyncSave | None = None


_SAVERS: weakref.WeakKeyDictionary[Any, _Saver] = weakref.WeakKeyDictionary()


class _AsyncSave:
    """One asynchronous save, after the copy off the device. A background thread on every process writes and
    fsyncs that process's files into the temporary directory; a process other than the main one then writes a
    marker file listing them (or its error). The main process's thread waits for every marker, then writes the
    manifest and renames the directory into place exactly as a synchronous save does. The thread issues no
    collective: processes agree on the outcome at the next sync point (:func:`finish_pending`), on the main thread."""

    def __init__(self, kernel: Kernel, items: Mapping[str, Item], claims: Mapping[str, ItemRecord], target: Path,
                 tmp: Path, index: int | None, packed: dict[str, tuple[str, Any, dict[str, torch.Tensor]]]):
        self.kernel, self.items, self.claims = kernel, items, claims
        self.target, self.tmp, self.index = target, tmp, index
        self.rank, self.world = kernel.process_index, kernel.num_processes
        self.packed: dict[str, tuple[str, Any, dict[str, torch.Tensor]]] | None = packed
        self.written = threading.Event()  # this process's files are on disk (or failed: write_error)
        self.write_error: BaseException | None = None
        self.publish_error: BaseException | None = None
        self.published = False
        self.deadline: float | None = None  # the main process stops waiting for the others' markers then
        self.thread = threading.Thread(target=self._run, name=f"accel-save-{target.name}", daemon=True)

    def _run(self) -> None:
        own: dict[str, list[str]] = {}
        try:
            assert self.packed is not None
            for key, (stem, doc, tensors) in self.packed.items():
                own[key] = _write_packed(self.tmp, stem, doc, tensors, sync=False)
            fsync_all(self.tmp / f for files in own.values() for f in files)
            if self.rank != 0:
                write_json(self.tmp / _MARKER.format(self.rank), {"files": own})
        except BaseException as exc:
            self.write_error = exc
            if self.rank != 0:
                try:  # best effort: lets the main process give up early; the sync point agrees anyway
                    write_json(self.tmp / _MARKER.format(self.rank), {"error": _one_line(exc)})
                except Exception:
                    pass
        finally:
            self.packed = None
            self.written.set()
        if self.rank != 0:
            return
        try:
            if self.write_error is not None:
                return
            all_own = [own, *self._peer_files()]
            _publish(self.kernel, self.items, self.claims, all_own, self.target, self.tmp, self.index)
            self.published = True
        except BaseException as exc:
            self.publish_error = exc
        finally:
            if not self.published:
                shutil.rmtree(self.tmp, ignore_errors=True)

    def _peer_files(self) -> list[dict[str, list[str]]]:
        """Each other process's written files, from its marker (waiting for it), in rank order."""
        found: dict[int, dict[str, list[str]]] = {}
        while len(found) < self.world - 1:
            for rank in range(1, self.world):
                path = self.tmp / _MARKER.format(rank)
                if rank in found or not path.is_file():
                    continue
                try:
                    data = read_json(path)
                except CheckpointError:
                    continue  # being written
                if "error" in data:
                    raise CheckpointError(f"process {rank} failed: {data['error']}")
                found[rank] = {str(k): [str(f) for f in v] for k, v in data["files"].items()}
            if len(found) < self.world - 1:
                if self.deadline is not None and time.monotonic() > self.deadline:
                    missing = sorted(set(range(1, self.world)) - set(found))
                    raise CheckpointError(f"the files of process(es) {missing} did not appear in {self.tmp} within "
                                          f"{PEER_WAIT_S:g} s (the processes must share the file system, and be alive)")
                time.sleep(0.01)
        for rank in found:
            os.unlink(self.tmp / _MARKER.format(rank))
        return [found[rank] for rank in sorted(found)]

    def finish_at_exit(self) -> None:
        """At interpreter exit (no collectives any more): wait for this process's files; the main process also
        for the other processes' files (at most :data:`PEER_WAIT_S`), then publishes or abandons. A failure is
        one line on stderr."""
        self.written.wait()
        if self.rank == 0:
            self.deadline = time.monotonic() + PEER_WAIT_S
            self.thread.join()
        error = self.write_error or self.publish_error
        if error is not None:
            print(f"accel: asynchronous save_state to {self.target} failed on process {self.rank}: {_one_line(error)}; "
                  "it was not published (the previous checkpoints are unchanged)", file=sys.stderr, flush=True)


def _start_async(kernel: Kernel, items: Mapping[str, Item], target: Path, tmp: Path, index: int | None) -> None:
    """The blocking part of an asynchronous save: plugins' items, the copy of everything else to CPU memory (on
    every process, agreed), then the background write."""
    claims = _gather_claims(kernel, items, tmp, asynchronous=True)
    saver = _SAVERS.setdefault(kernel, _Saver())

    def snapshot() -> dict[str, tuple[str, Any, dict[str, torch.Tensor]]]:
        packed: dict[str, tuple[str, Any, dict[str, torch.Tensor]]] = {}
        for key, item in items.items():
            if key in claims:
                continue
            mine = item.per_rank or kernel.is_main_process
            if item.kind == "model" or mine:
                state = _state_of(kernel, item)  # a model on every process: a sharding strategy may gather here
            if mine:
                stem = _file_stem(item, kernel.process_index)
                packer = _Packer(stage=functools.partial(saver.staging.copy, stem))
                packed[key] = (stem, packer.encode(state), packer.tensors)
        saver.staging.forget_unused()
        return packed

    packed = _agreed(kernel, "save_state (copying)", snapshot)
    job = _AsyncSave(kernel, items, claims, target, tmp, index, packed)
    saver.job = job
    job.thread.start()


def pending_save(kernel: Kernel) -> Path | None:
    """The target of this kernel's asynchronous save in flight (not yet agreed on), or None."""
    saver = _SAVERS.get(kernel)
    return None if saver is None or saver.job is None else saver.job.target


def finish_pending(kernel: Kernel, at_exit: bool = False, release: bool = False) -> None:
    """Finish this kernel's asynchronous save in flight, if any: every process waits for its own files, the
    processes agree (one collective), the main process publishes; a failure anywhere raises the same one-line
    :class:`CheckpointError` on every process, after the temporary directory is removed. Called on every process
    by ``save_state``, ``load_state``, ``latest_checkpoint``, ``end_training`` and ``wait_for_save``; at
    interpreter exit (``at_exit``) without collectives (see :meth:`_AsyncSave.finish_at_exit`). ``release``: also
    free the CPU copies kept for the next save (``end_training``)."""
    saver = _SAVERS.get(kernel)
    job = None if saver is None else saver.job
    if saver is not None and (release or at_exit):
        del _SAVERS[kernel]
    if saver is None or job is None:
        return
    saver.job = None
    if at_exit:
        job.finish_at_exit()
        return
    job.written.wait()
    messages = kernel.collectives.all_gather_object(None if job.write_error is None else _one_line(job.write_error))
    failed = [(rank, message) for rank, message in enumerate(messages) if message is not None]
    if job.rank == 0:
        job.deadline = time.monotonic() + (0.0 if failed else PEER_WAIT_S)  # failed: stop waiting for markers
        job.thread.join()
    publish = None if failed or job.publish_error is None else _one_line(job.publish_error)
    publish = kernel.collectives.broadcast_object(publish, 0)
    where = f"asynchronous save_state to {job.target} failed on process"
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"{where} {rank}: {message}; it was not published (the previous checkpoints are "
                              "unchanged)")
    if publish is not None:
        raise CheckpointError(f"{where} 0: {publish}; it was not published (the previous checkpoints are unchanged)")


# --------------------------------------------------------------------------------------------------------------
# load_state


def load_state(kernel: Kernel, input_dir: str | os.PathLike[str] | None = None) -> Path:
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

    def check() -> tuple[dict[str, Any], dict[str, ItemRecord]]:
        manifest = read_manifest(directory)
        records = _records(manifest)
        check_compatible(kernel, items, records, directory)
        return manifest, records

    manifest, records = _agreed(kernel, "load_state (checking)", check)

    def restore() -> None:
        done = _plugin_load(kernel, items, records, directory)
        order = sorted(items, key=lambda k: items[k].kind == "rng")  # random states last: nothing draws after them
        for key in order:
            if key in done:
                continue
            item = items[key]
            stem = _file_stem(item, kernel.process_index)
            _restore(kernel, item, read_tree(directory, stem))

    _agreed(kernel, "load_state (restoring)", restore)
    if manifest.get("iteration") is not None:
        kernel.project_configuration.iteration = int(manifest["iteration"]) + 1
    return directory


def check_compatible(kernel: Kernel, items: Mapping[str, Item], records: Mapping[str, ItemRecord],
                     directory: Path) -> None:
    """Raise :class:`CheckpointError` saying what differs between the checkpoint and this run, before anything
    is loaded: a plugin that wrote items is not active, items missing on either side, a different number of
    processes for per-process items or dataloader positions, different parameter names or shapes."""
    active = {c.name for c in kernel.components}
    for key, rec in sorted(records.items()):
        if rec.plugin != KERNEL and rec.plugin not in active:
            raise CheckpointError(f"checkpoint item {key!r} of {directory} was written by plugin {rec.plugin!r}"
                                  f"{' ' + rec.version if rec.version else ''} in format {rec.format!r}; "
                                  f"{_plugin_advice(kernel, rec.plugin)}")
        if rec.plugin == KERNEL and rec.format != TREE_FORMAT:
            raise CheckpointError(f"checkpoint item {key!r} has unknown kernel format {rec.format!r}")
    missing = [k for k in items if k not in records]
    if missing:
        held = ", ".join(sorted(records)) or "nothing"
        raise CheckpointError(f"checkpoint {directory} has no {', '.join(repr(k) for k in missing)} "
                              f"(this run has {_describe(items, missing)}); it holds: {held}")
    extra = [k for k in records if k not in items]
    if extra:
        hints = []
        for k in extra:
            provider = records[k].extra.get("provider", KERNEL)
            if provider != KERNEL:
                hints.append(f"{k!r} came from plugin {provider!r}: {_plugin_advice(kernel, provider)}")
        raise CheckpointError(f"checkpoint {directory} holds {', '.join(repr(k) for k in extra)} that this run does "
                              f"not have (prepare/register the same objects as the run that saved it)"
                              f"{'; ' + '; '.join(hints) if hints else ''}")
    for key, rec in records.items():
        size = rec.extra.get("world_size")
        if items[key].per_rank and size is not None and int(size) != kernel.num_processes:
            raise CheckpointError(f"checkpoint item {key!r} holds one state per process for {size} process(es); "
                                  f"this run has {kernel.num_processes}: resume with {size} process(es)")
    for key, item in items.items():
        rec = records[key]
        if rec.plugin != KERNEL:
            continue
        if item.kind == "model":
            _check_model(kernel, key, item, directory)
        elif item.kind == "optimizer":
            _check_optimizer(key, item, directory)
        elif item.kind == "dataloader":
            _check_dataloader(key, item, directory)


def _describe(items: Mapping[str, Item], keys: list[str]) -> str:
    parts = []
    for k in keys:
        item = items[k]
        if item.kind == "custom":
            parts.append(f"{k!r}: an object given to register_for_checkpointing ({type(item.obj).__name__})")
        elif item.kind == "plugin":
            parts.append(f"{k!r} from plugin {item.provider!r}")
        else:
            parts.append(f"{k!r}: a prepared {item.kind}")
    return "; ".join(parts)


def _plugin_advice(kernel: Kernel, name: str) -> str:
    rec = kernel.plugins.records.get(name)
    if rec is not None and rec.status == "loaded":
        return f"it is installed ({rec.distribution} {rec.version}) but not active in this run: select it with " \
               f"--plugin {name} (or Kernel(plugins=[{name!r}]))"
    if rec is not None:
        return f"it is installed ({rec.distribution} {rec.version}) but {rec.status}: {rec.reason}"
    hint = install_hint(name)
    return f"install it with `{hint}`" if hint else f"install the plugin that provides {name!r}"


def _check_model(kernel: Kernel, key: str, item: Item, directory: Path) -> None:
    saved = tree_shapes(directory, key)
    current = {k: v for k, v in kernel.unwrap_model(item.obj).state_dict().items() if isinstance(v, torch.Tensor)}
    kinds = sorted({type(v).__name__ for v in current.values() if hasattr(v, "placements")})  # distributed tensors
    if kinds:  # the kernel restores whole tensors; a strategy that shards the model writes (and reads) it itself
        raise CheckpointError(f"checkpoint item {key!r} of {directory} holds the full model as written without a "
                              f"sharding strategy, but this run's model holds {', '.join(kinds)} values (its strategy "
                              "shards it): resume with the strategy that saved the checkpoint, or load the weights "
                              "into the model before prepare() (accel.load_model for save_model's files)")
    problems = []
    for name in current:
        if name not in saved:
            problems.append(f"{name} is missing from the checkpoint")
        elif tuple(current[name].shape) != saved[name][0]:
            problems.append(f"{name} has shape {tuple(saved[name][0])} in the checkpoint, "
                            f"{tuple(current[name].shape)} in this model")
    for name in saved:
        if name not in current:
            problems.append(f"{name} is in the checkpoint but not in this model")
    if problems:
        more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
        raise CheckpointError(f"checkpoint item {key!r} does not fit this model: {'; '.join(problems[:6])}{more}")


def _check_optimizer(key: str, item: Item, directory: Path) -> None:
    tree = _decode(_tree_doc(directory, key)["tree"], _NoTensors())
    saved = [len(g.get("params", ())) for g in tree.get("param_groups", [])] if isinstance(tree, dict) else []
    current = [len(g["params"]) for g in item.obj.param_groups]
    if saved != current:
        raise CheckpointError(f"checkpoint item {key!r} does not fit this optimizer: parameters per group "
                              f"{saved} in the checkpoint, {current} in this run")


def _check_dataloader(key: str, item: Item, directory: Path) -> None:
    state = _decode(_tree_doc(directory, key)["tree"], _NoTensors())
    check = getattr(item.obj, "check_state", None)
    if callable(check):
        problem = check(state)
        if problem:
            raise CheckpointError(f"checkpoint item {key!r}: {problem}")


class _NoTensors(dict):  # type: ignore[type-arg]
    """Tensor lookups during checks, which only read the JSON structure."""

    def __missing__(self, key: str) -> None:
        return None


def _plugin_load(kernel: Kernel, items: Mapping[str, Item], records: Mapping[str, ItemRecord],
                 directory: Path) -> set[str]:
    objects = {key: item.obj for key, item in items.items()}
    done: set[str] = set()
    for impl in reversed(kernel.plugins.pm.hook.accel_load_state.get_hookimpls()):
        name = _component_name(impl)
        mine = {k: r for k, r in records.items() if r.plugin == name}
        if not mine:
            continue
        args = {"kernel": kernel, "items": objects, "directory": directory, "records": mine}
        restored = set(cast("Iterable[str] | None", impl.function(*[args[a] for a in impl.argnames])) or ())
        left = sorted(set(mine) - restored)
        if left:
            raise PluginError(f"plugin {name!r} did not restore checkpoint item(s) {left} that it wrote")
        done |= set(mine)
    left = sorted(k for k, r in records.items() if r.plugin != KERNEL and k not in done)
    if left:
        raise PluginError(f"no active plugin restored checkpoint item(s) {left} (written by "
                          f"{', '.join(sorted({records[k].plugin for k in left}))})")
    return done


# --------------------------------------------------------------------------------------------------------------
# save_model / load_model

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
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


def save_model(kernel: Kernel, model: torch.nn.Module, save_directory: str | os.PathLike[str],
               max_shard_size: int | str = "10GB") -> list[Path]:
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
    names = [WEIGHTS] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for i in range(len(shards))]
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
    stale = [p for p in directory.iterdir() if re.match(r"^model-\d{5}-of-\d{5}\.safetensors$", p.name)
             and p.name not in names]
    if len(shards) == 1:
        stale += [p for p in (directory / WEIGHTS_INDEX,) if p.exists()]
    else:
        index = {"metadata": {"total_size": total, "accel.aliases": aliases},
                 "weight_map": {n: names[i] for i, shard in enumerate(shards) for n in shard}}
        tmp = directory / f".{WEIGHTS_INDEX}.tmp-{token}"
        write_json(tmp, index)
        os.replace(tmp, directory / WEIGHTS_INDEX)
        written.append(directory / WEIGHTS_INDEX)
        stale += [p for p in (directory / WEIGHTS,) if p.exists()]
    for p in stale:
        p.unlink()
    fsync_path(directory)
    return written


def load_model(model: torch.nn.Module, directory: str | os.PathLike[str], strict: bool = True,
               device: str | torch.device = "cpu") -> torch.nn.Module:
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


