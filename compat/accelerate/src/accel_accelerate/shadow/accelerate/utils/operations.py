"""``accelerate.utils.operations``: the collectives of the process's Kernel (accel.utils.operations), plus the
helpers libraries call on nested data."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from accel.utils.operations import *  # noqa: F403
from accel.utils.operations import __all__ as _ACCEL


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] | None = None,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """``func`` applied to every tensor (or what ``test_type`` accepts) in nested lists, tuples and mappings."""
    import torch

    test = test_type or (lambda t: isinstance(t, torch.Tensor))
    if isinstance(data, list | tuple):
        items = [
            recursively_apply(func, o, *args, test_type=test_type, error_on_other_type=error_on_other_type, **kwargs)
            for o in data
        ]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    if isinstance(data, Mapping):
        kind: Any = type(data)
        return kind(
            {
                k: recursively_apply(
                    func, v, *args, test_type=test_type, error_on_other_type=error_on_other_type, **kwargs
                )
                for k, v in data.items()
            }
        )
    if test(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        raise TypeError(f"unsupported type {type(data).__name__} passed to {func.__name__}")
    return data


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Every process's ``object_list`` replaced in place by process ``from_process``'s (picklable objects)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def concatenate(data: list[Any], dim: int = 0) -> Any:
    import torch

    first = data[0]
    if isinstance(first, list | tuple):
        return type(first)(concatenate([d[i] for d in data], dim=dim) for i in range(len(first)))
    if isinstance(first, Mapping):
        kind: Any = type(first)
        return kind({k: concatenate([d[k] for d in data], dim=dim) for k in first})
    return torch.cat(data, dim=dim)


__all__ = [*_ACCEL, "broadcast_object_list", "concatenate", "recursively_apply"]
