"""One walk over nested structures of tensors, used by the kernel and the plugins alike.

:func:`map_tensors` applies a function to every tensor of a structure made of mappings (rebuilt with their own
type: ``dict``, ``OrderedDict``, a ``ModelOutput``, ``BatchEncoding``...), named tuples (rebuilt field by field),
lists and tuples, and returns the same structure. Anything else (strings, numbers, dataclass instances, ``None``)
is returned as it is, or refused with ``strict=True``. ``leaf`` widens what counts as a tensor: ``send_to_device``
moves any object with a ``to`` method whole, as Accelerate does.

Why not ``torch.utils._pytree``: it is private (its API changes between torch releases), and it treats every
container type it was not told about as a leaf, so a ``UserDict`` or ``Mapping`` batch would silently keep its
tensors where they were. Dataclass instances stay leaves (as everywhere in accel before): rebuilding one calls its
``__init__``, which may validate or compute fields.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def is_namedtuple(obj: Any) -> bool:
    """Whether ``obj`` is a named tuple (``collections.namedtuple`` or ``typing.NamedTuple``)."""
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def is_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor)


def map_tensors(
    fn: Callable[[Any], Any], data: Any, *, leaf: Callable[[Any], bool] = is_tensor, strict: bool = False
) -> Any:
    """``data`` with ``fn(x)`` in place of every ``x`` for which ``leaf(x)`` (default: every tensor), through
    mappings, named tuples, lists and tuples. Other objects are kept, or with ``strict=True`` raise ``TypeError``."""

    def walk(obj: Any) -> Any:
        if leaf(obj):
            return fn(obj)
        if isinstance(obj, Mapping):
            return type(obj)({k: walk(v) for k, v in obj.items()})  # type: ignore[call-arg]
        if is_namedtuple(obj):
            return type(obj)(*(walk(v) for v in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(v) for v in obj)
        if strict:
            raise TypeError(f"expected tensors (or lists/tuples/dicts of tensors), got {type(obj).__name__}")
        return obj

    return walk(data)
