"""Stream a safetensors checkpoint into a (meta) model and dispatch it: ``load_checkpoint_in_model``,
``dispatch_model`` and ``load_checkpoint_and_dispatch``.

Checkpoints: one ``.safetensors`` file, or shards with a ``*.safetensors.index.json`` (Hugging Face's layout, which
``Kernel.save_model`` writes too); a directory holding either. Tied weights stored once (``save_pretrained`` drops
them, ``save_model`` records them as ``accel.aliases``) are filled from their twin.

Memory: tensors are read one at a time through safetensors' memory map. CPU tensors whose dtype is unchanged are
views of the map, as ``safetensors.torch.load_file`` gives them (their pages are read at first use and count in the
process's resident memory from then on); so do not overwrite the checkpoint's files in place while the model is in
use (writing new files and renaming them, as ``Kernel.save_model`` does, is safe). Where tensors are converted
(``dtype``) or moved to an accelerator, the map is closed every ``CHUNK_BYTES`` so the pages read do not pile up.
Disk-offloaded tensors are read from the checkpoint's own file at each forward when their dtype is unchanged, else
from a converted copy written to ``offload_folder``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from accel.spi import CheckpointError
from accel_bigmodel.hooks import (
    DiskTensor,
    OffloadHook,
    OffloadStore,
    attach_io_same_device,
    inputs_to,
    remove_hooks,
    set_tensor,
)
from accel_bigmodel.modeling import (
    DISK,
    Device,
    DeviceMapError,
    _dtype,
    check_device_map,
    compute_module_sizes,
    device_of,
    get_balanced_memory,
    get_max_memory,
    human,
    infer_auto_device_map,
    normalize_device,
    target_dtype,
    torch_device,
)

WEIGHTS = "model.safetensors"
CHUNK_BYTES = 32 * 2**20  # reopen the memory map after reading this much (bounds the map's resident pages)
AUTO_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
#: A load still running after this many seconds says so on stderr, then at most every PROGRESS_EVERY_S.
PROGRESS_AFTER_S = 3.0
PROGRESS_EVERY_S = 10.0


class CheckpointLoadError(CheckpointError, ValueError):
    """A checkpoint that cannot be loaded as asked (one line: what is wrong and what to do)."""


class CheckpointMismatch(CheckpointLoadError):
    """The checkpoint's tensor names, shapes or dtype kinds do not match the model's."""


@contextlib.contextmanager
def safetensors_file(file: str | os.PathLike[str], device: str = "cpu") -> Iterator[Any]:
    """``safe_open(file)``: a damaged, truncated, forged or unreadable file (safetensors' own error, an OS error)
    raises :class:`CheckpointLoadError` naming the file and the reason, for the open and every read inside."""
    from safetensors import SafetensorError

    try:
        with safe_open(os.fspath(file), framework="pt", device=device) as fh:
            yield fh
    except CheckpointError:
        raise
    except (SafetensorError, OSError, RuntimeError, ValueError, TypeError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise CheckpointLoadError(
            f"cannot read the safetensors file {file}: {reason}; the file is damaged, truncated or not a "
            "safetensors file: download or save it again"
        ) from None


def _str_map(value: Any, what: str, where: Path) -> dict[str, str]:
    """``value`` as ``{str: str}``, else :class:`CheckpointLoadError` naming ``what`` in ``where``."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise CheckpointLoadError(
            f"{where}: {what} must map tensor names to file or tensor names ({{name: name}}), got "
            f"{_short(value)}; the index is damaged: save or download it again"
        )
    return dict(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _inside(file: Path, folder: Path) -> bool:
    """Whether ``file`` resolves inside ``folder`` (or, for Hugging Face's cache, where a snapshot's files are links
    to ``../../blobs``, inside that repository's ``blobs`` folder)."""
    real, roots = file.resolve(), [folder.resolve()]
    if folder.parent.name == "snapshots":
        roots.append((folder.parent.parent / "blobs").resolve())
    return any(real.is_relative_to(root) for root in roots)


@dataclass(frozen=True)
class Entry:
    """One stored tensor: its file, its name there, its safetensors dtype and shape."""

    file: str
    key: str
    dtype: str
    shape: tuple[int, ...]


def _find(path: Path) -> tuple[list[Path], Path | None]:
    """(files, index) of a checkpoint path: a file, an index json, or a directory holding one of them."""
    if path.is_file():
        if path.name.endswith(".json"):
            return [], path
        if path.suffix != ".safetensors":
            raise CheckpointLoadError(
                f"{path} is not a safetensors checkpoint: accel loads .safetensors files only "
                "(save with safe_serialization=True, or convert with safetensors.torch.save_file)"
            )
        return [path], None
    if not path.is_dir():
        raise CheckpointLoadError(
            f"checkpoint {path} does not exist: pass a .safetensors file, an index .json or a directory holding them"
        )
    if (path / WEIGHTS).is_file():
        return [path / WEIGHTS], None
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if len(indexes) == 1:
        return [], indexes[0]
    if len(indexes) > 1:
        raise CheckpointLoadError(
            f"{path} holds {len(indexes)} index files ({', '.join(p.name for p in indexes)}): pass the one to load"
        )
    singles = sorted(path.glob("*.safetensors"))
    if len(singles) == 1:
        return singles, None
    raise CheckpointLoadError(
        f"no {WEIGHTS} or *.safetensors.index.json in {path}"
        + (
            " (a PyTorch .bin checkpoint: accel loads safetensors only; save with safe_serialization=True)"
            if any(path.glob("*.bin"))
            else ""
        )
    )


class CheckpointIndex:
    """Every tensor of a checkpoint by name (aliases of tied weights included), read from the headers only."""

    def __init__(self, checkpoint: str | os.PathLike[str]) -> None:
        self.path = Path(checkpoint)
        files, index_path = _find(self.path)
        aliases: dict[str, str] = {}
        wanted: dict[Path, set[str] | None] = {f: None for f in files}
        if index_path is not None:
            try:
                index = json.loads(index_path.read_text())
                weight_map = _str_map(index["weight_map"], '"weight_map"', index_path)
                metadata = index.get("metadata") or {}
                aliases = _str_map(metadata.get("accel.aliases") or {}, '"metadata"."accel.aliases"', index_path)
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
                if isinstance(exc, CheckpointError):
                    raise
                raise CheckpointLoadError(f"cannot read the index {index_path}: {_reason(exc)}") from None
            for name, shard in weight_map.items():
                if Path(shard).name != shard:
                    raise CheckpointLoadError(f"{index_path} names a shard outside its directory: {shard!r}")
                found = wanted.setdefault(index_path.parent / shard, set())
                assert found is not None
                found.add(name)
        self.entries: dict[str, Entry] = {}
        unlisted: dict[str, Entry] = {}
        for file, names in wanted.items():
            if not file.is_file():
                raise CheckpointLoadError(
                    f"{index_path} lists the shard {file.name}, which is missing from {file.parent}"
                )
            if index_path is not None and not _inside(file, index_path.parent):
                raise CheckpointLoadError(
                    f"the shard {file} is a link to {file.resolve()}, outside the checkpoint's folder: refused "
                    "(shards must resolve inside their folder); copy the file there instead of linking it"
                )
            with safetensors_file(file) as fh:
                if index_path is None:
                    try:
                        stored = json.loads((fh.metadata() or {}).get("accel.aliases", "{}"))
                    except (ValueError, RecursionError) as exc:
                        raise CheckpointLoadError(
                            f"{file}: unreadable accel.aliases metadata: {_reason(exc)}"
                        ) from None
                    aliases.update(_str_map(stored, "the accel.aliases metadata", file))
                for key in fh.keys():
                    piece = fh.get_slice(key)
                    entry = Entry(os.fspath(file), key, piece.get_dtype(), tuple(piece.get_shape()))
                    if names is None or key in names:
                        self.entries[key] = entry
                    else:  # stored in a shard but not in the index: read as Accelerate does (whole shards)
                        unlisted.setdefault(key, entry)
        for key, entry in unlisted.items():  # a tensor the model lacks is then named like any other
            self.entries.setdefault(key, entry)
        for dropped, kept in aliases.items():
            if kept in self.entries and dropped not in self.entries:
                self.entries[dropped] = self.entries[kept]


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]


# ---- matching the model ----------------------------------------------------------------------------------------------


@dataclass
class Slot:
    """A tensor of the model: where it is, what it was, and what to load into it."""

    name: str
    module: nn.Module
    local: str
    is_param: bool
    original: torch.Tensor
    entry: Entry | None = None


def model_slots(model: nn.Module) -> dict[str, Slot]:
    """Every parameter and buffer by full name, tied ones under each of their names."""
    slots: dict[str, Slot] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for local, param in module._parameters.items():
            if param is not None:
                slots[prefix + local] = Slot(prefix + local, module, local, True, param)
        for local, buf in module._buffers.items():
            if buf is not None:
                slots[prefix + local] = Slot(prefix + local, module, local, False, buf)
    return slots


def _persistent(slot: Slot) -> bool:
    return slot.is_param or slot.local not in slot.module._non_persistent_buffers_set


def match(model: nn.Module, index: CheckpointIndex, strict: bool) -> dict[str, Slot]:
    """Slots with their checkpoint entries; a missing tensor (not filled by a tied twin), a shape mismatch, or with
    ``strict`` an unexpected tensor raises :class:`CheckpointMismatch` listing the first ones."""
    slots = model_slots(model)
    by_tensor: dict[int, Entry] = {}
    for name, slot in slots.items():
        entry = index.entries.get(name)
        if entry is not None:
            slot.entry = entry
            by_tensor.setdefault(id(slot.original), entry)
    for slot in slots.values():  # tied twins the checkpoint stores once
        if slot.entry is None and id(slot.original) in by_tensor:
            slot.entry = by_tensor[id(slot.original)]
    missing = [n for n, s in slots.items() if s.entry is None and _persistent(s)]
    unexpected = [n for n in index.entries if n not in slots]
    where = f"checkpoint {index.path}"
    if missing or (strict and unexpected):
        parts = []
        if missing:
            parts.append(f"{len(missing)} model tensor(s) missing from it, first: {', '.join(missing[:5])}")
        if unexpected:
            parts.append(
                f"{len(unexpected)} checkpoint tensor(s) the model does not have, first: {', '.join(unexpected[:5])}"
            )
        raise CheckpointMismatch(
            f"{where} does not match the model: {'; '.join(parts)}; check that it was saved from "
            "this model class and config (a renamed or prefixed module?)"
        )
    if unexpected:
        warnings.warn(
            f"{where}: {len(unexpected)} tensor(s) the model does not have were not loaded, first: "
            f"{', '.join(unexpected[:5])}",
            stacklevel=3,
        )
    shapes = [
        f"{n} {tuple(s.entry.shape)} vs model {tuple(s.original.shape)}"
        for n, s in slots.items()
        if s.entry is not None and tuple(s.entry.shape) != tuple(s.original.shape)
    ]
    if shapes:
        raise CheckpointMismatch(
            f"{where} does not match the model: {len(shapes)} tensor(s) have another shape, "
            f"first: {'; '.join(shapes[:3])}; check the model's config"
        )
    return slots


def _kind(dtype: torch.dtype) -> str:
    return (
        "bool"
        if dtype == torch.bool
        else "float"
        if dtype.is_floating_point
        else "complex"
        if dtype.is_complex
        else "int"
    )


def check_dtypes(slots: Mapping[str, Slot], index: CheckpointIndex, dtype: torch.dtype | None) -> None:
    """Refuse a stored tensor whose kind (float, int, bool, complex) differs from the one it is loaded as: loading
    int64 or bool values into floating-point weights (or the reverse) changes them without a word. Conversions
    between floating-point dtypes happen as ``from_pretrained`` does them (the model's dtype, or ``dtype=``); an
    integer or bool tensor is converted to a floating-point one only when ``dtype=`` asks for that dtype."""
    bad: list[tuple[str, str, torch.dtype]] = []
    for name, slot in slots.items():
        if slot.entry is None:
            continue
        stored = _ST_DTYPES.get(slot.entry.dtype)
        if stored is None:
            raise CheckpointLoadError(
                f"checkpoint {index.path}: {name} is stored as {slot.entry.dtype}, a dtype accel does not load "
                f"(it loads {', '.join(_ST_DTYPES)})"
            )
        to = target_dtype(slot.original, dtype)
        asked = dtype is not None and to == dtype and _kind(stored) in ("int", "bool")
        if _kind(stored) != _kind(to) and not asked:
            bad.append((name, slot.entry.dtype, to))
    if bad:
        fix = (
            "pass dtype=torch.float32 (or the dtype you want) to convert the integer/bool values to floating point"
            if all(_kind(to) == "float" for _, _, to in bad)
            else "fix the checkpoint or the model's dtypes"
        )
        first = "; ".join(f"{n} ({st} into {str(to).replace('torch.', '')})" for n, st, to in bad[:3])
        raise CheckpointMismatch(
            f"checkpoint {index.path} stores {len(bad)} tensor(s) as another kind of number than the model, "
            f"first: {first}: refused (a change of kind changes the values); {fix}"
        )


# ---- loading ---------------------------------------------------------------------------------------------------------


def execution_device(device_map: Mapping[str, int | str]) -> torch.device:
    """Where offloaded modules run: the first accelerator of the map, else the CPU."""
    for device in device_map.values():
        if device not in ("cpu", DISK):
            return torch_device(device)
    return torch.device("cpu")


OFFLOAD = "offload"  # kept in CPU memory, loaded onto the execution device for each forward


def placement(
    name: str, is_param: bool, device_map: Mapping[str, int | str], main: torch.device, offload_buffers: bool
) -> torch.device | str:
    """DISK, OFFLOAD, or the device a tensor lives on. Buffers are offloaded only with ``offload_buffers``
    (otherwise they live on the execution device)."""
    device = device_of(name, device_map)
    offloadable = is_param or offload_buffers
    if device == DISK:
        return DISK if offloadable else main
    if device == "cpu":
        if main.type == "cpu":
            return main
        return OFFLOAD if offloadable else main
    assert device is not None
    return torch_device(device)


class _Progress:
    """Lines on stderr (the machine's main process only) for a load that takes long: how much is read so far."""

    def __init__(self, what: Path, total: int) -> None:
        self.what, self.total, self.done = what, total, 0
        self.start = time.monotonic()
        self.next = self.start + PROGRESS_AFTER_S
        self.said = False
        self.quiet = os.environ.get("LOCAL_RANK", "0") != "0"

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if now >= self.next and not self.quiet:
            self.said = True
            self.next = now + PROGRESS_EVERY_S
            print(
                f"accel: loading {self.what}: {human(self.done)} of {human(self.total)} read "
                f"({now - self.start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    def finish(self) -> None:
        if self.said:
            print(f"accel: loaded {self.what} in {time.monotonic() - self.start:.0f} s", file=sys.stderr, flush=True)


def _chunks(items: list[Slot]) -> Iterable[list[Slot]]:
    chunk: list[Slot] = []
    size = 0
    for slot in items:
        chunk.append(slot)
        size += _nbytes([slot])
        if size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _load(
    model: nn.Module,
    slots: Mapping[str, Slot],
    device_map: Mapping[str, int | str],
    dtype: torch.dtype | None,
    offload_folder: str | os.PathLike[str] | None,
    offload_buffers: bool,
) -> OffloadStore:
    """Load every slot that has an entry: resident ones on their device, disk ones recorded in the returned store
    (and set to meta)."""
    main = execution_device(device_map)
    store = OffloadStore()
    resident: dict[str, list[Slot]] = {}
    convert: dict[str, list[Slot]] = {}
    for name, slot in slots.items():
        if slot.entry is None:
            continue
        dtype_to = target_dtype(slot.original, dtype)
        if placement(name, slot.is_param, device_map, main, offload_buffers) == DISK:
            set_tensor(
                slot.module, slot.local, torch.empty(slot.original.shape, dtype=dtype_to, device="meta"), slot.is_param
            )
            if str(dtype_to) == str(_ST_DTYPES.get(slot.entry.dtype)):
                store.disk[name] = DiskTensor(slot.entry.file, slot.entry.key, dtype_to)
            else:
                convert.setdefault(slot.entry.file, []).append(slot)
        else:
            resident.setdefault(slot.entry.file, []).append(slot)
    loaded: dict[tuple[int, str], Any] = {}  # (original tensor, device) -> loaded parameter/buffer (tied weights)
    every = [s for group in (*resident.values(), *convert.values()) for s in group]
    progress = _Progress(Path(every[0].entry.file).parent if every and every[0].entry else Path("."), _nbytes(every))
    for file, items in resident.items():
        for chunk in _chunks(items):
            # a chunk with a conversion or an accelerator copy is copied whole, so no CPU view keeps its map (and
            # the pages read for the others) alive
            copy = any(
                str(target_dtype(s.original, dtype)) != str(_ST_DTYPES.get(s.entry.dtype))
                or placement(s.name, s.is_param, device_map, main, offload_buffers)
                not in (OFFLOAD, torch.device("cpu"))
                for s in chunk
                if s.entry is not None
            )
            with safetensors_file(file) as fh:
                for slot in chunk:
                    assert slot.entry is not None
                    where = placement(slot.name, slot.is_param, device_map, main, offload_buffers)
                    where = torch.device("cpu") if where == OFFLOAD else where
                    assert isinstance(where, torch.device)
                    key = (id(slot.original), str(where))
                    if key in loaded:
                        holder = slot.module._parameters if slot.is_param else slot.module._buffers
                        holder[slot.local] = loaded[key]
                        continue
                    tensor = fh.get_tensor(slot.entry.key)
                    progress.add(tensor.numel() * tensor.element_size())
                    dtype_to = target_dtype(slot.original, dtype)
                    if tensor.dtype != dtype_to:
                        tensor = tensor.to(dtype_to)
                    elif copy and where.type == "cpu":
                        tensor = tensor.clone()
                    set_tensor(slot.module, slot.local, tensor.to(where), slot.is_param, slot.original.requires_grad)
                    holder = slot.module._parameters if slot.is_param else slot.module._buffers
                    loaded[key] = holder[slot.local]
    if convert:
        assert offload_folder is not None
        for file, items in convert.items():
            for chunk in _chunks(items):
                with safetensors_file(file) as fh:
                    for slot in chunk:
                        assert slot.entry is not None
                        target = os.path.join(offload_folder, f"{slot.name}.safetensors")
                        dtype_to = target_dtype(slot.original, dtype)
                        save_file({slot.name: fh.get_tensor(slot.entry.key).to(dtype_to).contiguous()}, target)
                        progress.add(_nbytes([slot]))
                        store.disk[slot.name] = DiskTensor(target, slot.name, dtype_to)
    progress.finish()
    if offload_folder is not None and store.disk:
        store.write_index(offload_folder)
    return store


def _nbytes(slots: Iterable[Slot]) -> int:
    return sum(s.original.numel() * s.original.element_size() for s in slots)


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _still_meta(model: nn.Module, store: OffloadStore) -> None:
    left = [n for n, s in model_slots(model).items() if s.original.is_meta and n not in store]
    if left:
        raise CheckpointMismatch(
            f"{len(left)} tensor(s) are still on the meta device after loading (not in the checkpoint), first: "
            f"{', '.join(left[:5])}; build the model with init_empty_weights(include_buffers=False) so buffers "
            "computed at construction keep their values"
        )


# ---- dispatch --------------------------------------------------------------------------------------------------------


def _dispatch(
    model: nn.Module,
    device_map: Mapping[str, int | str],
    store: OffloadStore,
    offload_buffers: bool,
    main: torch.device | None = None,
) -> nn.Module:
    """Attach the hooks: offloaded tensors loaded just in time on the main device; inputs moved to each entry's
    device when more than one device computes."""
    main = main or execution_device(device_map)
    remove_hooks(model)
    handles: list[Any] = []
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        own: dict[str, str] = {}
        for local, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is None:
                continue
            full = prefix + local
            is_param = local in module._parameters
            if placement(full, is_param, device_map, main, offload_buffers) == OFFLOAD and not tensor.is_meta:
                store.cpu[full] = tensor.detach()
                set_tensor(module, local, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"), is_param)
            if full in store:
                own[local] = full
        if own:
            hook = OffloadHook(module, own, store, main)
            handles.append(module.register_forward_pre_hook(hook.pre))
            handles.append(module.register_forward_hook(hook.post, always_call=True))
    run_on = {main if d in ("cpu", DISK) else torch_device(d) for d in device_map.values()}
    if run_on != {torch.device("cpu")}:
        modules = dict(model.named_modules())
        for name, device in device_map.items():
            if name in modules:
                target = main if device in ("cpu", DISK) else torch_device(device)
                handles.append(modules[name].register_forward_pre_hook(inputs_to(target), with_kwargs=True))
        handles += attach_io_same_device(model)
    model._accel_bigmodel_hooks = handles  # type: ignore[assignment]
    model.hf_device_map = dict(device_map)  # type: ignore[assignment]  # what transformers and users read
    return model


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, Device],
    main_device: Device | None = None,
    offload_dir: str | os.PathLike[str] | None = None,
    offload_buffers: bool = False,
) -> nn.Module:
    """Dispatch a model whose weights are loaded (or on meta for ``"disk"`` entries, with ``offload_dir`` holding
    the ``index.json`` that :func:`load_checkpoint_in_model` wrote): resident tensors are moved to their device,
    ``"cpu"`` entries are offloaded to CPU memory when an accelerator computes, ``"disk"`` entries are written to
    ``offload_dir`` (or found there) and read at each forward. Offloaded modules run on ``main_device`` (default:
    the first accelerator of the map, else the CPU)."""
    dmap = OrderedDict((name, normalize_device(d)) for name, d in device_map.items())
    check_device_map(model, dmap, None, None)
    main = execution_device(dmap) if main_device is None else torch_device(normalize_device(main_device))
    store = OffloadStore()
    index: dict[str, DiskTensor] = {}
    if offload_dir is not None and os.path.isfile(os.path.join(offload_dir, "index.json")):
        index = read_offload_index(os.path.join(offload_dir, "index.json"))
    for name, slot in model_slots(model).items():
        where = placement(name, slot.is_param, dmap, main, offload_buffers)
        tensor = slot.original
        if where == DISK:
            if tensor.is_meta:
                if name not in index:
                    raise DeviceMapError(
                        f"{name} is on meta and not in {offload_dir}/index.json: load it with "
                        "load_checkpoint_in_model(..., offload_folder=...) first"
                    )
                store.disk[name] = index[name]
                continue
            if offload_dir is None:
                raise DeviceMapError(f"device_map puts {name} on disk: pass offload_dir=DIR (a folder for its weights)")
            make_offload_folder(offload_dir, "offload_dir")
            target = os.path.join(offload_dir, f"{name}.safetensors")
            save_file({name: tensor.detach().cpu().contiguous()}, target)
            store.disk[name] = DiskTensor(target, name, tensor.dtype)
            set_tensor(
                slot.module, slot.local, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"), slot.is_param
            )
        elif not tensor.is_meta:
            where = torch.device("cpu") if where == OFFLOAD else where
            if tensor.device != where:
                set_tensor(slot.module, slot.local, tensor.detach().to(where), slot.is_param, tensor.requires_grad)
    if offload_dir is not None and store.disk:
        store.write_index(offload_dir)
    return _dispatch(model, dmap, store, offload_buffers, main)


def read_offload_index(path: str) -> dict[str, DiskTensor]:
    """The ``index.json`` :func:`load_checkpoint_in_model` writes in the offload folder, checked: every entry names
    a file, a tensor and a torch dtype (nothing else is looked up by name)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointLoadError(f"cannot read the offload index {path}: {_reason(exc)}") from None
    out: dict[str, DiskTensor] = {}
    for name, info in data.items() if isinstance(data, dict) else [("", data)]:
        fields = info if isinstance(info, dict) else {}
        file, key, dtype = fields.get("safetensors_file"), fields.get("weight_name"), fields.get("dtype")
        found = getattr(torch, dtype, None) if isinstance(dtype, str) else None
        if not (isinstance(file, str) and isinstance(key, str) and isinstance(found, torch.dtype)):
            raise CheckpointLoadError(
                f"the offload index {path} is damaged at {name!r}: expected {{'safetensors_file': str, "
                f"'weight_name': str, 'dtype': a torch dtype name}}, got {_short(info)}; load the checkpoint "
                "again with load_checkpoint_in_model(..., offload_folder=...)"
            )
        out[name] = DiskTensor(file, key, found)
    return out


# ---- the entry points ------------------------------------------------------------------------------------------------


def _resolve_map(
    model: nn.Module,
    device_map: str | Mapping[str, Device] | None,
    max_memory: Mapping[Device, int | str] | None,
    no_split: list[str] | None,
    dtype: torch.dtype | None,
) -> tuple[OrderedDict[str, int | str], bool]:
    if isinstance(device_map, str):
        if device_map not in AUTO_MAPS:
            raise DeviceMapError(f"device_map={device_map!r} is not one of {', '.join(AUTO_MAPS)} or a dict")
        budgets: Mapping[Any, int | str] | None = max_memory
        if device_map != "sequential":
            budgets = get_balanced_memory(model, max_memory, no_split, dtype, low_zero=device_map == "balanced_low_0")
        return infer_auto_device_map(model, budgets, no_split, dtype), True
    if device_map is None:
        first = next((t.device for t in model.parameters() if not t.is_meta), torch.device("cpu"))
        return OrderedDict([("", normalize_device(first))]), False
    dmap = OrderedDict((name, normalize_device(d)) for name, d in device_map.items())
    check_device_map(model, dmap, max_memory, dtype)
    return dmap, False


def _check_offload_folder(
    model: nn.Module,
    device_map: Mapping[str, int | str],
    offload_folder: Any,
    inferred: bool,
    max_memory: Mapping[Device, int | str] | None,
    dtype: torch.dtype | None,
) -> None:
    on_disk = [n for n, d in device_map.items() if d == DISK]
    if not on_disk:
        return
    if offload_folder is None:
        sizes = compute_module_sizes(model, dtype=dtype)
        total = sum(sizes.get(n, 0) for n in on_disk)
        why = ""
        if inferred:
            budgets = ", ".join(f"{d}: {human(b)}" for d, b in get_max_memory(max_memory).items())
            why = f" because the model ({human(sizes[''])}) exceeds max_memory ({budgets})"
        raise DeviceMapError(
            f"device_map puts {human(total)} of weights on disk (from {on_disk[0]!r} on){why}: pass "
            "offload_folder=DIR, or raise max_memory"
        )
    make_offload_folder(offload_folder, "offload_folder")


def make_offload_folder(folder: str | os.PathLike[str], what: str) -> None:
    """Create the offload folder; one line when it cannot be (a file is in the way, no permission)."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise DeviceMapError(
            f"{what}={os.fspath(folder)!r} is a file, not a folder: give a folder for offloaded weights"
        )
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise DeviceMapError(f"{what}={os.fspath(folder)!r} cannot be created: {exc.strerror or exc}") from None


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: Mapping[str, Device] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    strict: bool = False,
) -> None:
    """Stream ``checkpoint`` into ``model``: each tensor onto its ``device_map`` device; ``"disk"`` tensors stay on
    meta and are recorded in ``offload_folder/index.json`` (for :func:`dispatch_model`). ``offload_state_dict`` is
    accepted for Accelerate compatibility: loading always streams, so there is nothing to offload."""
    del offload_state_dict
    dtype_ = _dtype(dtype)
    index = CheckpointIndex(checkpoint)
    slots = match(model, index, strict)
    check_dtypes(slots, index, dtype_)
    dmap, _ = _resolve_map(model, device_map, None, None, dtype_)
    _check_offload_folder(model, dmap, offload_folder, False, None, dtype_)
    store = _load(model, slots, dmap, dtype_, offload_folder, offload_buffers)
    _still_meta(model, store)  # _load wrote offload_folder/index.json for dispatch_model


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: str | Mapping[str, Device] | None = None,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    offload_buffers: bool = False,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool | None = None,
    strict: bool = False,
) -> nn.Module:
    """Load a safetensors checkpoint into ``model`` (typically built under :func:`init_empty_weights`) and dispatch
    it over ``device_map``: ``"auto"``/``"balanced"``/``"balanced_low_0"``/``"sequential"`` (computed with
    :func:`infer_auto_device_map` from ``max_memory``) or a dict ``{module name: device}`` (checked against
    ``max_memory`` when given). Weights are streamed one tensor at a time; ``"cpu"`` entries are offloaded to CPU
    memory when an accelerator computes, ``"disk"`` entries are read at each forward (``offload_folder`` required).
    Returns ``model``, whose ``hf_device_map`` is the device map used."""
    del offload_state_dict  # Accelerate's RAM-saving option: loading always streams here
    dtype_ = _dtype(dtype)
    index = CheckpointIndex(checkpoint)
    slots = match(model, index, strict)
    check_dtypes(slots, index, dtype_)
    dmap, inferred = _resolve_map(model, device_map, max_memory, no_split_module_classes, dtype_)
    _check_offload_folder(model, dmap, offload_folder, inferred, max_memory, dtype_)
    store = _load(model, slots, dmap, dtype_, offload_folder, offload_buffers)
    _still_meta(model, store)
    return _dispatch(model, dmap, store, offload_buffers)
