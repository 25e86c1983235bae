"""``find_executable_batch_size``: retry a function with a smaller batch size after an out-of-memory error."""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

#: Messages of out-of-memory errors (any accelerator, and the CPU allocator), as Accelerate matches them.
OOM_MESSAGES = (
    " out of memory.",
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",
)


def clear_device_cache() -> None:
    """Collect garbage and empty the current accelerator's cache (nothing more on the CPU)."""
    import torch

    gc.collect()
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        empty = getattr(getattr(accelerator, "memory", None), "empty_cache", None)
        if empty is not None:
            empty()


def release_memory(*objects: Any) -> list[None]:
    """Collect garbage and empty the device cache; returns ``[None] * len(objects)`` so
    ``a, b = release_memory(a, b)`` drops the caller's references."""
    clear_device_cache()
    return [None] * len(objects)


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` is an out-of-memory error (``torch.OutOfMemoryError`` or the CPU allocator's)."""
    import torch

    if isinstance(exception, torch.OutOfMemoryError):
        return True
    if isinstance(exception, RuntimeError) and len(exception.args) == 1 and isinstance(exception.args[0], str):
        return any(text in exception.args[0] for text in OOM_MESSAGES)
    return False


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Any:
    """Decorator: call ``function(batch_size, *args, **kwargs)`` starting at ``starting_batch_size``; after an
    out-of-memory error, empty the caches and try again with ``int(batch_size * 0.9)`` (Accelerate's rule), or
    what ``reduce_batch_size_fn()`` returns. The batch size found is kept for later calls. Raises
    ``RuntimeError`` when it reaches zero."""
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    batch_size = starting_batch_size
    if reduce_batch_size_fn is None:

        def reduce_batch_size_fn() -> int:
            return int(batch_size * 0.9)

    reduce = reduce_batch_size_fn

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        clear_device_cache()
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            given = ", ".join(f"{name}={value}" for name, value in zip(params[1:], args[1:], strict=False))
            raise TypeError(
                f"Batch size was passed into `{function.__name__}` as the first argument when called."
                f"Remove this as the decorator already does so: `{function.__name__}({given})`"
            )
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not should_reduce_batch_size(exc):
                    raise
                del exc  # its traceback holds the frames (and tensors) of the failed attempt
                clear_device_cache()
                batch_size = reduce()

    return decorator
