"""Files that survive a crash, and the kernel's own format (``accel.tree``), which never unpickles.

``accel.tree`` stores a state dict as JSON (structure, numbers, strings, with tags for tuples, non-string keys,
dtypes, non-finite floats) plus one safetensors file with every tensor. Plugins may use :func:`write_tree` /
:func:`read_tree` for their items too; :func:`load_weights_only` and :func:`load_restricted_pickle` read files
other libraries write without running code from them.
"""

from __future__ import annotations

import base64
import json
import math
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from accel.errors import CheckpointError

TREE_FORMAT = "accel.tree"


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
        raise CheckpointError(
            f"refusing to load {path}: it is not a weights-only torch file ({weights_only_reason(exc)})"
        ) from None


def weights_only_reason(exc: BaseException) -> str:
    """The line of a failed ``torch.load(weights_only=True)`` that says what was refused (torch's message opens
    with a paragraph of advice to load with ``weights_only=False``, which a checkpoint must never do)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    advice = ("Check the documentation", "Weights only load", "Please file an issue")
    specific = [line for line in lines[1:] if not line.startswith(advice)]
    return f"{type(exc).__name__}: {(specific or lines or [''])[0]}"


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
                raise CheckpointError(
                    f"refusing to load {path}: it references {module}.{name}, which is not allowed in this file"
                )
            return super().find_class(module, name)

    try:
        with open(path, "rb") as fh:
            return Restricted(fh).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None


class _Packer:
    """Turns a state dict into JSON-able structure plus a flat dict of CPU tensors for safetensors."""

    def __init__(self, stage: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._names: dict[tuple[Any, ...], str] = {}  # identity of a tensor already stored -> its name
        self._storages: set[int] = set()
        self._stage = (
            stage  # (name, tensor) -> a CPU copy of its own (asynchronous saves); None: no copy of CPU tensors
        )

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
        raise CheckpointError(
            f"cannot store an object of type {type(obj).__module__}.{type(obj).__qualname__}{where}: "
            "state_dict() must return tensors, numbers, strings, None and lists/tuples/dicts of "
            "them (checkpoints hold no pickled objects)"
        )

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
        ((tag, value),) = doc.items()
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
    write_json(
        directory / files[0],
        {"format": TREE_FORMAT, "tree": doc, "tensors": files[1] if len(files) > 1 else None},
        sync=False,
    )
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
        raise CheckpointError(
            f"{directory / (name + '.json')} names tensor {exc} that its safetensors file lacks"
        ) from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{directory / (name + '.json')} is malformed: {type(exc).__name__}: {exc}") from None


def _tree_doc(directory: Path, name: str) -> dict[str, Any]:
    doc = read_json(directory / f"{name}.json")
    if not isinstance(doc, dict) or doc.get("format") != TREE_FORMAT or "tree" not in doc:
        raise CheckpointError(f"{directory / (name + '.json')} is not an {TREE_FORMAT} file")
    tensors = doc.get("tensors")
    if tensors is not None and (
        not isinstance(tensors, str) or Path(tensors).name != tensors or tensors in ("", ".", "..")
    ):
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
