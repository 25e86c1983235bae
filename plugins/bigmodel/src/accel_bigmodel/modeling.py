"""Sizes and device maps: ``compute_module_sizes``, ``get_max_memory``, ``get_balanced_memory``,
``infer_auto_device_map``, and the checks a given device map must pass.

A device map is ``{module or tensor name: device}`` where a device is an accelerator index (``0``), a device string
(``"cuda:1"``, ``"cpu"``) or ``"disk"``; ``""`` names the whole model. Devices are handled through ``torch.device``
and ``torch.accelerator`` only: no backend is named here.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Union

import torch
from torch import nn

from accel.spi import UsageError

Device = Union[int, str, torch.device]  # noqa: UP007 (a runtime alias: the | form needs Python 3.10 types)
DISK = "disk"


class DeviceMapError(UsageError, ValueError):
    """A device map or memory budget that cannot work (one line: what, by how much, and what to change)."""


# ---- sizes -----------------------------------------------------------------------------------------------------------

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def convert_file_size_to_int(size: int | str) -> int:
    """``"300MB"`` -> 300_000_000, ``"1GiB"`` -> 2**30 (Accelerate's units: MB is 10**6, MiB is 2**20)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), flags=re.IGNORECASE)
    if not match:
        raise DeviceMapError(f"cannot read the memory size {size!r}: write an integer of bytes or e.g. '300MB', '2GiB'")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def human(nbytes: float) -> str:
    """Bytes as the user wrote them: MB/GB (powers of 10, as ``max_memory`` strings)."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def _dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    found = getattr(torch, str(value).replace("torch.", ""), None)
    if not isinstance(found, torch.dtype):
        raise DeviceMapError(f"unknown dtype {value!r}: use a torch dtype such as torch.float16 or 'bfloat16'")
    return found


def target_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor is loaded as: ``dtype`` for floating-point tensors when given, else the model's own."""
    if dtype is not None and tensor.is_floating_point():
        return dtype
    return tensor.dtype


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def named_tensors(module: nn.Module, recurse: bool = True, prefix: str = "") -> Iterable[tuple[str, torch.Tensor]]:
    """Parameters then buffers, each tensor once (tied parameters under their first name)."""
    yield from module.named_parameters(prefix=prefix, recurse=recurse)
    yield from module.named_buffers(prefix=prefix, recurse=recurse)


def compute_module_sizes(
    model: nn.Module,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
) -> dict[str, int]:
    """Bytes of every module and tensor, by name (``""`` is the whole model), as loaded with ``dtype``."""
    dtype = _dtype(dtype)
    special = {k: _dtype(v) for k, v in (special_dtypes or {}).items()}
    sizes: dict[str, int] = {}
    for name, tensor in named_tensors(model):
        loaded = special.get(name) or target_dtype(tensor, dtype)
        nbytes = tensor.numel() * _element_size(loaded)
        parts = name.split(".")
        for i in range(len(parts) + 1):
            key = ".".join(parts[:i])
            sizes[key] = sizes.get(key, 0) + nbytes
    sizes.setdefault("", 0)
    return sizes


# ---- memory budgets --------------------------------------------------------------------------------------------------


def _available_cpu_memory() -> int:
    try:
        import psutil  # optional: what Accelerate uses

        return int(psutil.virtual_memory().available)
    except ImportError:
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def normalize_device(device: Device) -> int | str:
    """A device map value as stored: accelerator index (int), ``"cpu"``, ``"disk"`` or another device string."""
    if isinstance(device, torch.device):
        if device.type == "cpu":
            return "cpu"
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None and device.type == accelerator.type:
            return device.index or 0
        return str(device)
    if isinstance(device, str):
        if device in ("cpu", DISK):
            return device
        if device.isdigit():
            return int(device)
        accelerator = torch.accelerator.current_accelerator()
        try:
            parsed = torch.device(device)
        except RuntimeError:  # torch: "Invalid device string"
            raise DeviceMapError(f"cannot read the device {device!r}: {valid_devices()}") from None
        if accelerator is not None and parsed.type == accelerator.type:
            return parsed.index or 0
        return device
    if isinstance(device, int):
        return device
    raise DeviceMapError(f"cannot read the device {device!r}: {valid_devices()}")


def valid_devices() -> str:
    """The devices a device map or ``max_memory`` may name on this machine, as the end of an error line."""
    count = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or not count:
        return "use 'cpu' or 'disk' (this machine has no accelerator)"
    return f"use an accelerator index 0..{count - 1} (or '{accelerator.type}:N'), 'cpu' or 'disk'"


def torch_device(device: int | str) -> torch.device:
    """The ``torch.device`` a stored device map value runs on."""
    if isinstance(device, int):
        check_device(device, "the device map")
        accelerator = torch.accelerator.current_accelerator()
        assert accelerator is not None
        return torch.device(accelerator.type, device)
    return torch.device(device)


def check_device(device: int | str, where: str) -> None:
    """An accelerator index (or another device string) that this machine has; ``"cpu"`` and ``"disk"`` always."""
    if device in ("cpu", DISK):
        return
    count = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    accelerator = torch.accelerator.current_accelerator()
    have = (
        f"this machine has {count} {accelerator.type} device(s)" if accelerator and count else "this machine has none"
    )
    if isinstance(device, int):
        if not 0 <= device < count:
            raise DeviceMapError(
                f"{where} names accelerator {device}, but {have}: use "
                + (f"0..{count - 1}, " if count else "")
                + "'cpu' or 'disk'"
            )
        return
    raise DeviceMapError(f"{where} names the device {device!r}, which is not an accelerator of this machine ({have})")


def get_max_memory(max_memory: Mapping[Device, int | str] | None = None) -> OrderedDict[int | str, int]:
    """Bytes per device, accelerators first, then ``"cpu"``, then ``"disk"`` when given. Without ``max_memory``:
    each accelerator's free memory and the CPU's available memory."""
    budgets: dict[int | str, int] = {}
    if max_memory is None:
        if torch.accelerator.is_available():
            for index in range(torch.accelerator.device_count()):
                free, _total = torch.accelerator.get_memory_info(index)
                budgets[index] = int(free)
        budgets["cpu"] = _available_cpu_memory()
    else:
        if not isinstance(max_memory, Mapping):
            raise DeviceMapError(
                f"max_memory must be a dict {{device: size}} such as {{0: '10GiB', 'cpu': '30GiB'}}, got "
                f"{type(max_memory).__name__} {max_memory!r:.60}"
            )
        for device, size in max_memory.items():
            try:
                normalized = normalize_device(device)
            except DeviceMapError as exc:
                raise DeviceMapError(f"max_memory ({device!r}): {exc}") from None
            check_device(normalized, f"max_memory ({device!r})")
            budgets[normalized] = convert_file_size_to_int(size)
    order = (
        [d for d in budgets if isinstance(d, int)]
        + [d for d in budgets if isinstance(d, str) and d not in ("cpu", DISK)]
        + [d for d in ("cpu", DISK) if d in budgets]
    )
    return OrderedDict((d, budgets[d]) for d in sorted(order, key=lambda d: (not isinstance(d, int), order.index(d))))


def _no_split(module: nn.Module, no_split_module_classes: Iterable[str]) -> bool:
    return type(module).__name__ in set(no_split_module_classes)


def _children(name: str, module: nn.Module) -> list[tuple[str, nn.Module | torch.Tensor]]:
    """A module's own parameters, its child modules, then its own buffers (Accelerate's order), with full names."""
    prefix = f"{name}." if name else ""
    out: list[tuple[str, nn.Module | torch.Tensor]] = [
        (prefix + n, t) for n, t in module.named_parameters(recurse=False)
    ]
    out += [(prefix + n, m) for n, m in module.named_children()]
    out += [(prefix + n, t) for n, t in module.named_buffers(recurse=False)]
    return out


def get_max_layer_size(
    modules: list[tuple[str, nn.Module | torch.Tensor]],
    sizes: Mapping[str, int],
    no_split_module_classes: Iterable[str],
) -> tuple[int, list[str]]:
    """The largest unit that is loaded at once when offloaded: a leaf module, a tensor or a no-split module."""
    no_split = list(no_split_module_classes)
    best, names = 0, []
    todo = list(modules)
    while todo:
        name, module = todo.pop(0)
        if (
            isinstance(module, nn.Module)
            and next(module.children(), None) is not None
            and not _no_split(module, no_split)
        ):
            todo = _children(name, module) + todo
            continue
        size = sizes.get(name, 0)
        if size > best:
            best, names = size, [name]
        elif size == best:
            names.append(name)
    return best, names


def get_balanced_memory(
    model: nn.Module,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split_module_classes: Iterable[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
    low_zero: bool = False,
) -> OrderedDict[int | str, int]:
    """Budgets that spread the model evenly over the accelerators (with one accelerator or none: ``max_memory``).
    ``low_zero`` leaves accelerator 0 as empty as it can (for generation's extra memory there)."""
    budgets = get_max_memory(max_memory)
    accelerators = [d for d in budgets if isinstance(d, int) and budgets[d] > 0]
    if len(accelerators) <= 1:
        return budgets
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    layer, _ = get_max_layer_size(_children("", model), sizes, no_split_module_classes or [])
    share_count = len(accelerators) - (1 if low_zero else 0)
    per_device = sizes[""] // max(share_count, 1) + layer
    for i, device in enumerate(accelerators[:-1]):
        budgets[device] = min(budgets[device], 0 if low_zero and i == 0 else per_device)
    return budgets


# ---- infer_auto_device_map -------------------------------------------------------------------------------------------


def infer_auto_device_map(
    model: nn.Module,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split_module_classes: Iterable[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
) -> OrderedDict[str, int | str]:
    """A device map filling accelerators in order, then the CPU, then ``"disk"``, never over ``max_memory``.

    Modules are placed whole when they fit; a module that does not fit is split into its own tensors and children,
    unless its class is in ``no_split_module_classes`` (a block with a residual connection must stay on one device).
    When anything is offloaded (to the CPU with an accelerator, to disk), the execution device keeps room for the
    largest offloaded unit, which is loaded there for its forward. ``offload_buffers`` is accepted for Accelerate
    compatibility; buffers are sized with their module either way.
    """
    del offload_buffers
    budgets = get_max_memory(max_memory)
    no_split = list(no_split_module_classes or [])
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    devices: list[int | str] = [d for d in budgets if d != DISK] + [DISK]
    top = _children("", model)
    layer, layer_names = get_max_layer_size(top, sizes, no_split)
    for reserve in (0, layer):  # first try without reserving; reserve only when something is offloaded
        device_map = _fill(top, sizes, budgets, devices, no_split, reserve, verbose)
        placed = set(device_map.values())
        offloaded = DISK in placed or (isinstance(devices[0], int) and "cpu" in placed)
        if not offloaded or devices[0] == DISK:
            break
    main = devices[0]
    if offloaded and main != DISK and layer > budgets[main]:
        raise DeviceMapError(
            f"the largest unit loaded at once, {layer_names[0]} ({human(layer)}), does not fit in max_memory[{main!r}] "
            f"({human(budgets[main])}): {human(layer - budgets[main])} over; raise max_memory[{main!r}] to at least "
            f"{human(layer)} or leave its class out of no_split_module_classes so it can be split"
        )
    return clean_device_map(device_map) if clean_result else device_map


def _fill(
    top: list[tuple[str, nn.Module | torch.Tensor]],
    sizes: Mapping[str, int],
    budgets: Mapping[int | str, int],
    devices: list[int | str],
    no_split: list[str],
    reserve: int,
    verbose: bool,
) -> OrderedDict[str, int | str]:
    device_map: OrderedDict[str, int | str] = OrderedDict()
    todo = list(top)
    current, used = 0, 0
    while todo:
        name, module = todo.pop(0)
        size = sizes.get(name, 0)
        device = devices[current]
        limit = float("inf") if device == DISK else budgets[device] - (reserve if current == 0 else 0)
        if used + size <= limit:
            device_map[name] = device
            used += size
            if verbose:
                print(f"{name} ({human(size)}) -> {device}")
            continue
        if (
            isinstance(module, nn.Module)
            and next(module.children(), None) is not None
            and not _no_split(module, no_split)
        ):
            todo = _children(name, module) + todo
            continue
        current, used = current + 1, 0
        todo.insert(0, (name, module))
    return device_map


def clean_device_map(device_map: Mapping[str, int | str], module_name: str = "") -> OrderedDict[str, int | str]:
    """Merge the entries under a module into one when they share a device (``a.0``, ``a.1`` on cpu -> ``a``)."""
    out: OrderedDict[str, int | str] = OrderedDict(device_map)
    prefix = f"{module_name}." if module_name else ""
    members = [k for k in out if k.startswith(prefix) or k == module_name]
    if len({out[k] for k in members}) == 1 and len(members) > 1:
        first = list(out).index(members[0])
        device = out[members[0]]
        rebuilt: OrderedDict[str, int | str] = OrderedDict()
        for i, (k, d) in enumerate(out.items()):
            if i == first:
                rebuilt[module_name] = device
            if k not in members:
                rebuilt[k] = d
        return rebuilt
    depth = len(module_name.split(".")) + 1 if module_name else 1
    children = dict.fromkeys(".".join(k.split(".")[:depth]) for k in members if len(k) > len(module_name))
    for child in children:
        out = clean_device_map(out, child)
    return out


# ---- checks of a given device map ------------------------------------------------------------------------------------


def entry_of(name: str, device_map: Mapping[str, int | str]) -> str | None:
    """The device map entry a tensor or module name falls under (the longest matching one), or None."""
    key = name
    while True:
        if key in device_map:
            return key
        if not key:
            return None
        key = key.rsplit(".", 1)[0] if "." in key else ""


def device_of(name: str, device_map: Mapping[str, int | str]) -> int | str | None:
    """The device a tensor or module name falls under (longest matching entry), or None."""
    entry = entry_of(name, device_map)
    return None if entry is None else device_map[entry]


def check_device_map(
    model: nn.Module,
    device_map: Mapping[str, int | str],
    max_memory: Mapping[Device, int | str] | None,
    dtype: torch.dtype | None,
) -> None:
    """Every tensor has a device; with ``max_memory``, no device holds more than its budget (the error names the
    module at which the budget is crossed and by how much)."""
    known = {n for n, _ in model.named_modules()} | {n for n, _ in named_tensors(model)}
    unknown = [n for n in device_map if n not in known]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise DeviceMapError(
            f"the device map names {unknown[0]!r}{hint}, which is not a module or tensor of the model"
            + (f" ({len(unknown) - 1} more unknown)" if len(unknown) > 1 else "")
            + "; use the names of model.named_modules()"
        )
    for device in dict.fromkeys(device_map.values()):
        check_device(device, "the device map")
    uncovered = [n for n, _ in named_tensors(model) if device_of(n, device_map) is None]
    if uncovered:
        raise DeviceMapError(
            f"the device map gives no device to {len(uncovered)} tensor(s), first {', '.join(uncovered[:5])}; add "
            "their modules (or '' for everything else) to device_map"
        )
    if max_memory is None:
        return
    budgets = get_max_memory(max_memory)
    used: dict[int | str, int] = {}
    per_entry: dict[str, int] = {}
    crossed: dict[int | str, str] = {}
    for name, tensor in named_tensors(model):
        entry = entry_of(name, device_map)
        assert entry is not None
        device = device_map[entry]
        nbytes = tensor.numel() * _element_size(target_dtype(tensor, dtype))
        per_entry[entry] = per_entry.get(entry, 0) + nbytes
        if device == DISK or device not in budgets:
            continue
        used[device] = used.get(device, 0) + nbytes
        if used[device] > budgets[device] and device not in crossed:
            crossed[device] = entry
    for device, entry in crossed.items():
        raise DeviceMapError(
            f"device_map puts {human(used[device])} on {device!r} but max_memory[{device!r}] is "
            f"{human(budgets[device])}: {human(used[device] - budgets[device])} over, from module {entry!r} "
            f"({human(per_entry[entry])}) on; move it (or the modules after it) to 'cpu'/'disk', or use "
            "device_map='auto'"
        )
